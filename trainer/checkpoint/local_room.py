"""How much room the local and peer tiers (trainer/checkpoint/local.py) need, where their copies go by
default, and what they hold in host memory (said at the start and in --mode=inspect)."""

import hashlib
import os
import shutil
import tempfile

import jax

from trainer import device_memory
from trainer.cadence import CopyPolicy
from trainer.checkpoint.local_copies import KEEP
from trainer.checkpoint.local_shards import state_bytes


def default_dir(workdir: str) -> str:
  """A per-run folder under $LOCAL_TIER_BASE, else in host memory (/dev/shm) where there is one, else in
  the system's temporary folder."""
  base = os.environ.get("LOCAL_TIER_BASE") or (
    "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  )
  run = hashlib.sha1(os.path.abspath(workdir).encode()).hexdigest()[:12]
  return os.path.join(base, f"jax-template-{run}")


def shortfall(local_dir: str, state_bytes: int, partnered: bool = True) -> str | None:
  """Why `local_dir` cannot hold the tiers' copies, or None: KEEP copies of this process's shards, KEEP
  of its partner's where it has one, and the spare of each that the next copy is written over."""
  try:
    os.makedirs(local_dir, exist_ok=True)
    held = _bytes_under(local_dir)  # The run's own copies, written over: room too.
    have = shutil.disk_usage(local_dir).free + held
  except OSError as e:
    return f"checkpoint.local_dir={local_dir} cannot be used ({e.strerror or e})"
  need = (1 + partnered) * (KEEP + 1) * state_bytes
  if have < need:
    return (
      f"checkpoint.local_dir={local_dir} has {have / 2**20:.1f} MiB of room and the local and peer tiers "
      f"need {memory_line(state_bytes, partnered)}"
    )
  # A folder in host memory (tmpfs, /dev/shm) is often as large as the memory itself, which the process
  # and the copy in flight (its shards read from the devices, and a pinned copy) need too.
  available = device_memory.host_available_bytes() if _in_memory(local_dir) else None
  more = need - held + 2 * state_bytes
  if available is None or more <= available:
    return None
  return (
    f"checkpoint.local_dir={local_dir} is in host memory, of which {available / 2**20:.1f} MiB is "
    f"available, and the local and peer tiers need {memory_line(state_bytes, partnered)} and "
    f"{2 * state_bytes / 2**20:.1f} MiB for the copy in flight"
  )


def _in_memory(folder: str) -> bool:
  """Whether `folder` lies on a file system kept in memory (the longest mount point above it)."""
  path, best, kind = os.path.realpath(folder), "", ""
  try:
    with open("/proc/mounts") as f:
      mounts = [line.split()[1:3] for line in f]
  except OSError:
    return False
  for point, fs in mounts:
    if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
      best, kind = point, fs
  return kind in ("tmpfs", "ramfs")


ROOM = (
  "give it more room (docker --shm-size, a Kubernetes emptyDir with medium Memory and a sizeLimit), "
  "point checkpoint.local_dir elsewhere, or set checkpoint.local_every=0"
)


def memory_line(state_bytes: int, partnered: bool = True) -> str:
  """What the tiers hold in host memory per process (process 0's shards stand for every process's); one
  process alone has no partner's copies to hold."""
  partners = " and as many of its partner's" if partnered else ", no partner's: one process"
  return (
    f"up to {(1 + partnered) * (KEEP + 1) * state_bytes / 2**20:.1f} MiB of host memory per process "
    f"({KEEP + 1} copies of its {state_bytes / 2**20:.1f} MiB of shards{partners})"
  )


def copy_place(copy_in: str, step_bytes: int, state_bytes: int, limit: int | None) -> str:
  """Where a copy is taken ('device' or 'host', checkpoint.local_copy_in): on the devices it costs the
  next step nothing but holds one more state (`state_bytes` on the fullest device) beside the step's
  `step_bytes` while it runs; in pinned host memory it takes no device memory, but the next step waits
  for its transfers. auto: on the devices unless the two exceed HEADROOM of the device's memory `limit`."""
  if copy_in != "auto":
    return copy_in
  return "host" if _crowded(step_bytes, state_bytes, limit) else "device"


# The share of a device's memory that a step and a copy beside it may plan on: XLA's peak is its plan,
# and on a TPU the allocator reserves the step's temporaries in one block. Device copies were never
# measured above it (lm_125m's step and a copy on a v5e come close to its memory: docs/results.md).
HEADROOM = 0.9


def _crowded(step_bytes: int, state_bytes: int, limit: int | None) -> bool:
  return limit is not None and step_bytes + state_bytes > HEADROOM * limit


def place_line(place: str, step_bytes: int, state_bytes: int, limit: int | None) -> str:
  if place == "device":
    return f"copies taken on the devices (one more state there while one is in flight: {_mib(state_bytes)})"
  line = "copies taken in pinned host memory (the next step waits for their transfers)"
  if _crowded(step_bytes, state_bytes, limit):
    line += f": the step's {_mib(step_bytes)} and a copy's {_mib(state_bytes)} exceed {HEADROOM:.0%} of a "
    line += f"device's {_mib(limit)}"
  return line


def inspect_line(config, target, place_said: str) -> str:
  """--mode=inspect's account of the tiers' memory (`target`: the abstract state, with shardings)."""
  if not CopyPolicy.of(config.checkpoint.local_every).copies:
    return "local and peer tiers: off (checkpoint.local_every=0)"
  per_device = max(device_memory.bytes_per_device(target, addressable_only=False).values(), default=0)
  return (
    f"local and peer tiers: {memory_line(state_bytes(target))} for process {jax.process_index()}'s "
    f"{len(jax.local_devices())} devices (the fullest device holds {_mib(per_device)} of the "
    f"state: a process copies its devices' distinct shards); {place_said}"
  )


def _mib(n: int) -> str:
  return f"{n / 2**20:.1f} MiB"


def _bytes_under(folder: str) -> int:
  total = 0
  for root, _, files in os.walk(folder):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total
