"""Whether this process's devices can hold a state before anything is read onto them (a restore).

An accelerator reports its own memory (`memory_stats`: the allocator's limit and what is in use). CPU
devices report none: they share the host's memory, of which the kernel's MemAvailable and a
container's cgroup limit (v2 memory.max, v1 memory.limit_in_bytes) bound what can still be taken.
Only the state's own bytes are counted (not a step's temporaries): a state that cannot even be held
is refused; one that fits may still run out of memory in its first step, which says so itself.
"""

import math
import os

import jax


def shard_bytes(leaf) -> int:
  """Bytes each device holds of one array, from its sharding's shard shape."""
  return math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def bytes_per_device(tree, addressable_only: bool = True) -> dict:
  """{device: bytes of `tree` it holds}, for this process's devices or every device of the job
  (`tree`'s leaves carry shardings)."""
  out = {}
  for leaf in jax.tree.leaves(tree):
    for device in leaf.sharding.addressable_devices if addressable_only else leaf.sharding.device_set:
      out[device] = out.get(device, 0) + shard_bytes(leaf)
  return out


def _read_int(path: str) -> int | None:
  try:
    with open(path) as f:
      text = f.read().split()[0]
  except (OSError, IndexError):
    return None
  return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit.


def host_available_bytes() -> int | None:
  """What this process can still allocate on the host: MemAvailable, or less under a cgroup limit."""
  bounds = []
  try:
    with open("/proc/meminfo") as f:
      bounds += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
  except OSError:
    pass
  try:
    with open("/proc/self/cgroup") as f:
      groups = [line.strip().split(":", 2) for line in f]
  except OSError:
    groups = []
  for _, controllers, path in (g for g in groups if len(g) == 3):
    if controllers == "":  # v2: one unified hierarchy.
      base, names = "/sys/fs/cgroup" + path, ("memory.max", "memory.current")
    elif "memory" in controllers.split(","):
      base, names = "/sys/fs/cgroup/memory" + path, ("memory.limit_in_bytes", "memory.usage_in_bytes")
    else:
      continue
    limit, used = (_read_int(os.path.join(base, n)) for n in names)
    if limit is not None and used is not None and limit < 2**60:  # v1 writes a huge number for none.
      bounds.append(limit - used)
  return min(bounds) if bounds else None


def shortfall(tree) -> str | None:
  """Why this process's devices cannot hold `tree`, or None when they can (or nothing says how much
  they have)."""
  held = bytes_per_device(tree)
  if not held:
    return None
  stats = {d: d.memory_stats() or {} for d in held}
  if all("bytes_limit" in s for s in stats.values()):
    free = {d: s["bytes_limit"] - s.get("bytes_in_use", 0) for d, s in stats.items()}
    worst = max(held, key=lambda d: held[d] - free[d])
    if held[worst] <= free[worst]:
      return None
    return (
      f"the state needs {_gib(held[worst])} on {worst} (per device, on {jax.device_count()} devices), "
      f"which has {_gib(free[worst])} free"
    )
  available = host_available_bytes()
  total = sum(held.values())
  if available is None or total <= available:
    return None
  return (
    f"the state needs {_gib(total)} of host memory for this process's {len(held)} "
    f"{next(iter(held)).platform} devices ({_gib(max(held.values()))} per device, on "
    f"{jax.device_count()} devices), and the host has {_gib(available)} available"
  )


def step_bytes(compiled) -> int:
  """One device's memory while the compiled step runs (0 where nothing says: a backend without the
  analysis, a step wrapped by a test)."""
  m = compiled.memory_analysis() if hasattr(compiled, "memory_analysis") else None
  return 0 if m is None else program_bytes(m)


def program_bytes(m) -> int:
  """One device's memory while a compiled program runs, from its memory analysis `m`: on a TPU, XLA's
  peak of the program's live buffers (what the allocator held while lm_125m's step ran; the sum of its
  temporaries overstated that by a third: docs/results.md); elsewhere arguments + outputs - donated +
  temporaries (XLA's peak on CPU counts the arguments alone)."""
  if jax.default_backend() == "tpu" and getattr(m, "peak_memory_in_bytes", 0) > 0:
    return m.peak_memory_in_bytes
  return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def limits() -> dict:
  """{device: bytes its allocator may hold} for this process's devices that report it (not CPUs)."""
  stats = {d: d.memory_stats() or {} for d in jax.local_devices()}
  return {d: s["bytes_limit"] for d, s in stats.items() if "bytes_limit" in s}


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB"
