"""The local and peer checkpoint tiers: a lost host costs a few steps (trainer/cadence.py's lost_steps:
2 with a copy every step), not a persistent checkpoint interval.

Every `checkpoint.local_every` steps the loop dispatches a copy of the whole train state (params,
variables, EMA, optimizer state, RNG, step) on its devices, which the next step does not donate (or,
where the devices lack room for it beside the step, straight into pinned host memory:
checkpoint.local_copy_in), and goes on; the tier's writer thread waits for it, brings this process's
shards to host memory with the data position and the config (`checkpoint.local_pace_mib` at a time, a
part per step the loop dispatches, so that the transfers run beside steps queued before them: on a TPU a
step dispatched behind a whole copy's transfers waited for them; or after PACE_WAIT_S without a step),
frees the device copy, and writes the copy to `checkpoint.local_dir` (host-local, by default a folder
under /dev/shm) and sends the same bytes to its partner, a process on another host where there is one,
over the peer service (trainer/cluster/peers.py), which keeps it in its own local_dir. Both sides keep
their newest three (KEEP) and the newest a check saw (a run with checks resumes only from one). The next
copy waits for the previous one's write: the loop never runs more than one copy ahead of what is whole
on disk. A copy becomes whole only once the loop has released it, after the step's metrics row and
evaluation are written: a resume truncates metrics.jsonl to the restored step, so a copy whole before
its row would leave a hole in the history.

A copy on disk, whole or torn: trainer/checkpoint/local_copies.py.

Restore (trainer/checkpoint/restore.py asks before the persistent tier): trainer/checkpoint/local_restore.py.
"""

import collections
import hashlib
import json
import os
import queue
import shutil
import socket
import statistics
import threading
import time

import jax

from errors import UserError
from trainer import device_memory
from trainer.cadence import CopyPolicy
from trainer.checkpoint import local_copies as copies
from trainer.checkpoint import local_room
from trainer.checkpoint.local_shards import device_copy, host_copy, pinned_copy, state_bytes
from trainer.cluster import multihost, peers
from trainer.observe.metrics import console

PUT, GET = 2, 3  # Peer-service message types (peers.PROBE is 1).
_PEER_TIMEOUT_S = 120.0
# How long a copy's next part waits for a step: a loop that is not stepping (taking a batch, evaluating,
# saving) never holds a copy back longer, so a lost host still loses no more than lost_steps says.
PACE_WAIT_S = 0.1


class LocalTier:
  """This process's copies (local_dir/process_I/own) and those it holds for others (.../held/J)."""

  def __init__(
    self, local_dir: str, fingerprint: str, config_json: dict, link_timeout_s: float, pace_mib: float = 0
  ):
    self.fingerprint, self.config_json = fingerprint, config_json
    self.pace_bytes = pace_mib * 2**20 or float("inf")  # Transferred per dispatched step (0: at once).
    self.take = device_copy  # Or pinned_copy: place().
    self._steps, self._rush = threading.Semaphore(0), threading.Event()  # Pacing: stepped(), wait().
    self._paced_s = 0.0  # The copy in flight's waits for steps: not its work.
    self.link_timeout_s = link_timeout_s  # How long a send to the partner is tried again.
    self.me, self.processes = jax.process_index(), jax.process_count()
    self.root = os.path.join(local_dir, f"process_{self.me}")
    self.own = os.path.join(self.root, "own")
    self._writer: threading.Thread | None = None  # Started by the first copy (_serve).
    self._jobs: queue.Queue = queue.Queue(maxsize=1)
    self._idle = threading.Event()  # No copy in flight.
    self._idle.set()
    self._released, self._kept = threading.Event(), False
    self._error: BaseException | None = None
    self._works = collections.deque(maxlen=8)  # The last copies' work: work_s.
    self._spans = collections.deque(maxlen=8)  # The last copies' time in flight, saved to done: span_s.
    self._busy_s, self._saved_at = 0.0, None  # Copies' time in flight so far: busy_s.
    self.waited_s = 0.0  # The loop's waits for copies' work in all (not for their steps): CopyCadence.
    self._step_ran_at = 0.0  # When the copy in flight's step had run on the devices.
    os.makedirs(self.own, exist_ok=True)
    self.partner = None
    self._service = peers.service()
    if self._service is not None:
      self._service.streams[PUT] = self._receive
      self._service.handlers[GET] = self._send
      hosts = multihost.gather("local_tier_hosts", {"host": socket.gethostname()}, timeout_s=600)
      self.partner = partner(self.me, [hosts[p]["host"] for p in range(self.processes)])

  def place(self, copy_in: str, compiled_step, target) -> None:
    """Takes copies on the devices or in pinned host memory (checkpoint.local_copy_in), now that the
    step's memory is known; said where they go to host memory."""
    step = device_memory.step_bytes(compiled_step)
    held = max(device_memory.bytes_per_device(target).values(), default=0)
    limit = min(device_memory.limits().values(), default=None)
    place = local_room.copy_place(copy_in, step, held, limit)
    self.take = pinned_copy if place == "host" else device_copy
    if place == "host":
      console(f"local tier: {local_room.place_line(place, step, held, limit)}")

  def held(self, source: int) -> str:
    return os.path.join(self.root, "held", str(source))

  # --- Saving (when trainer/cadence.py's CopyCadence says).
  def save(self, step: int, state, position: dict, checked: bool, finite_flags: list) -> None:
    """Copies the state on its devices (dispatched, not waited for: the loop keeps the next step queued
    while this one runs); a thread then brings this process's shards to host memory once the step has
    run, and writes and sends them. `finite_flags`: the (finite, count) scalars of the steps since the
    loop last checked; a copy of a state after a non-finite step is dropped."""
    self.wait()
    on_devices = self.take(state)  # Not donated by the next step, unlike `state`.
    record = {"step": step, "position": position, "config": self.config_json}
    manifest = {"step": step, "process": self.me, "processes": self.processes, "checked": checked}
    self._released, self._kept = threading.Event(), False
    self._steps, self._rush = threading.Semaphore(0), threading.Event()  # Steps from now pace this copy.
    self._saved_at = time.time()
    self._idle.clear()
    if self._writer is None:
      self._writer = threading.Thread(target=self._serve, daemon=True, name="local_tier_writer")
      self._writer.start()
    self._jobs.put(([on_devices], finite_flags, record, manifest))  # A box the writer empties: freed early.

  @property
  def work_s(self) -> float:
    """A copy's work (to host memory, written, sent), the median of the last eight: one copy's varies
    several-fold on a loaded host. For trainer/cadence.py's CopyCadence."""
    return statistics.median(self._works) if self._works else 0.0

  @property
  def span_s(self) -> float:
    """A copy's time in flight, from the loop's save to written and sent (the median of the last
    eight): while the loop may run slower beside it. For CopyCadence."""
    return statistics.median(self._spans) if self._spans else 0.0

  @property
  def busy_s(self) -> float:
    """The seconds copies have been in flight so far, the one in flight included. For CopyCadence."""
    saved_at = self._saved_at
    return self._busy_s + (time.time() - saved_at if saved_at is not None else 0.0)

  def stepped(self) -> None:
    """The loop has dispatched a step: the copy in flight may start one more part's transfers."""
    self._steps.release()

  def _next_part(self) -> None:
    """Until a step dispatched since the copy is not yet spent on a part, for PACE_WAIT_S at most, unless
    the loop waits for the copy. A part per step, not a part after each step: the loop dispatches a
    logging window's steps together, then waits for them, so a part each time the writer finds a new
    step went one per window and left most of the copy's transfers for the next copy's wait."""
    started = time.time()
    if not self._rush.is_set():
      self._steps.acquire(timeout=PACE_WAIT_S)  # wait() releases it too.
    self._paced_s += time.time() - started

  def release(self) -> None:
    """The step's rows are written: its copy may become whole (written and sent)."""
    self._kept = True
    self._released.set()

  def _serve(self) -> None:
    """The writer: one thread for the run, so each copy's host memory reuses the last one's malloc arena
    (a thread per copy grew the process's memory by about a copy's size each time on a TPU host:
    docs/concepts/checkpoints.md)."""
    while (job := self._jobs.get()) is not None:
      try:
        self._write(*job)
      finally:
        del job  # The copy's host memory, freed before the next one is waited for.
        span = time.time() - self._saved_at
        self._spans.append(span)
        self._saved_at, self._busy_s = None, self._busy_s + span  # (Read unlocked: never counted twice.)
        self._idle.set()

  def _write(self, on_devices: list, finite_flags: list, record: dict, manifest: dict) -> None:
    """Brings the shards to host memory, writes them straight to their file (checksummed on the way), makes
    the copy whole once released, then streams the file to the partner."""
    step = record["step"]
    try:
      finite = all(bool(ok) for ok, _ in jax.device_get(finite_flags))
      started = self._step_ran_at = time.time()  # The step has run: the copy's work starts.
      if not finite:
        return  # The loop rolls back when it checks these steps; their copies must not exist.
      self._paced_s = 0.0
      paced = self._next_part if self.pace_bytes < float("inf") else lambda: None
      record["shards"] = host_copy(on_devices.pop(), self.pace_bytes, paced)  # Device memory freed after.
      digest = copies.stage(self.own, step, lambda w: copies.dump_record(record, w.write))
      staged_s = time.time() - started - self._paced_s
      self._released.wait()
      released = time.time()
      if not self._kept:  # The loop failed before the step's rows: the copy is dropped.
        shutil.rmtree(os.path.join(self.own, f"{step}.tmp"), ignore_errors=True)
        return
      manifest = {**manifest, "fingerprint": self.fingerprint, copies.CHECKSUM: digest}
      copies.commit(self.own, step, manifest)
      if self.partner is not None:
        self._send_to_partner(step, manifest)
      self._works.append(staged_s + time.time() - released)
    except BaseException as e:  # noqa: BLE001 - raised in the loop by wait().
      self._error = e

  def _send_to_partner(self, step: int, manifest: dict) -> None:
    """Streams the copy to the partner, again while the link fails for up to the peer timeout: a flap
    shorter than that costs nothing (the partner drops a half-received copy as torn, and a copy is
    checked against its checksum before any use); a partition longer ends the run, as liveness would."""
    header = json.dumps(manifest).encode()
    prefix = len(header).to_bytes(8, "big") + header
    deadline = time.time() + self.link_timeout_s
    while True:
      with open(os.path.join(self.own, str(step), copies.SHARDS), "rb") as f:
        try:  # Each attempt may stall up to _PEER_TIMEOUT_S (a large copy on a slow link takes long).
          peers.request(self._addresses()[self.partner], PUT, prefix, _PEER_TIMEOUT_S, file=f)
          return
        except peers.PeerError:
          if time.time() >= deadline:
            raise
      time.sleep(0.5)

  def wait(self, raise_error: bool = True) -> None:
    """The copy in flight written (and sent); its error, if any, raised here: a full local disk, or a
    partner unreachable for longer than the peer timeout, ends the run like any failing save."""
    if not self._idle.is_set():
      started = time.time()
      self._rush.set()  # The rest of the copy's transfers at once.
      self._steps.release()
      self._released.set()  # Never released (an error after the copy): dropped, not written.
      self._idle.wait()
      # Waiting for the copy's step to run is the pipeline's; only the wait for its work counts.
      self.waited_s += time.time() - max(started, self._step_ran_at)
    if self._error is not None and raise_error:
      error, self._error = self._error, None
      raise error

  def _addresses(self) -> dict[int, str]:
    return peers.addresses()

  # --- The peer service's side: copies of a partner's shards.
  def _receive(self, sock, length: int) -> bytes:
    """A partner's copy, streamed from the socket to its file, whole once every byte has arrived. Not
    checksummed here (CPU time that logical CPU devices take from the step): its checksum is checked
    before it is ever used, as every copy's is (holdings), so a copy damaged on the way is skipped."""
    n = int.from_bytes(peers.read_exactly(sock, 8), "big")
    manifest = json.loads(peers.read_exactly(sock, n))
    folder, step = self.held(int(manifest["process"])), int(manifest["step"])
    os.makedirs(folder, exist_ok=True)
    copies.stage(folder, step, lambda f: peers.read_to_file(sock, length - 8 - n, f), hashed=False)
    copies.commit(folder, step, manifest)
    return b"{}"

  def _send(self, payload: bytes) -> list:
    asked = json.loads(payload)
    copy = copies.read_copy(self.held(int(asked["process"])), int(asked["step"]))
    if copy is None:
      raise ValueError(
        f"process {self.me} holds no whole copy of step {asked['step']} of process {asked['process']}"
      )
    header = json.dumps(copy[0]).encode()
    return [len(header).to_bytes(8, "big") + header, copy[1]]

  # --- Restoring.
  def holdings(self) -> dict:
    """What this process holds whole: its own steps and others' under this run's fingerprint, and how
    many copies were written under another (another layout or process count)."""
    held_root = os.path.join(self.root, "held")
    sources = sorted(filter(str.isdigit, os.listdir(held_root))) if os.path.isdir(held_root) else []
    found = {
      "own": copies.whole_manifests(self.own),
      **{s: copies.whole_manifests(self.held(int(s))) for s in sources},
    }
    ours = lambda m: m.get("fingerprint") == self.fingerprint  # noqa: E731
    mine = {k: sorted(st for st, m in got.items() if ours(m)) for k, got in found.items()}
    checked = {
      k: sorted(st for st, m in got.items() if ours(m) and m.get("checked")) for k, got in found.items()
    }
    others = sum(not ours(m) for got in found.values() for m in got.values())
    own, own_checked = mine.pop("own"), checked.pop("own")
    return {"own": own, "held": mine, "other": others, "checked": {"own": own_checked, "held": checked}}

  def load(self, step: int, holders: dict[int, dict]):
    """(record, where) of this process's copy of `step`: its own, else fetched from a holder."""
    copy = copies.read_copy(self.own, step)
    where = "its own copy"
    if copy is None:
      holder = next(p for p, h in sorted(holders.items()) if step in h["held"].get(str(self.me), []))
      body = peers.request(
        self._addresses()[holder],
        GET,
        json.dumps({"process": self.me, "step": step}).encode(),
        _PEER_TIMEOUT_S,
      )
      n = int.from_bytes(body[:8], "big")
      manifest, blob = json.loads(body[8 : 8 + n]), memoryview(body)[8 + n :]  # A view: no second copy.
      if copies.checksum(blob) != manifest[copies.CHECKSUM]:
        raise OSError(f"process {holder}'s copy of step {step} arrived damaged")
      copy, where = (manifest, blob), f"process {holder}'s copy"
    return copies.load_record(copy[1]), where

  def discard_after(self, step: int) -> set[int]:
    """Removes own and held copies newer than `step` (a rollback, a failed check, a resume from before
    them), the copy in flight finished or dropped first (its error kept for the next wait); their steps."""
    self.wait(raise_error=False)
    held_root = os.path.join(self.root, "held")
    held = [os.path.join(held_root, n) for n in os.listdir(held_root)] if os.path.isdir(held_root) else []
    return copies.discard_after([self.own, *held], step)

  def close(self, finished: bool) -> None:
    """Waits for the copy in flight and ends the writer; a finished run (its last step persistent) frees
    the memory."""
    self.wait()
    if self._writer is not None:
      self._jobs.put(None)
      self._writer = None
    if finished:
      shutil.rmtree(self.root, ignore_errors=True)
      try:
        os.rmdir(os.path.dirname(self.root))  # The run's folder, once no process has copies in it.
      except OSError:
        pass


def partner(me: int, hosts: list[str]) -> int:
  """The process that holds `me`'s copies: the next one on another host, else simply the next one."""
  n = len(hosts)
  return next(((me + k) % n for k in range(1, n) if hosts[(me + k) % n] != hosts[me]), (me + 1) % n)


def make(config, workdir: str, fingerprint: dict, target) -> "LocalTier | None":
  """The run's tiers, or None where checkpoint.local_every is 0, or -1 and local_dir lacks room (said)."""
  c, policy = config.checkpoint, CopyPolicy.of(config.checkpoint.local_every)
  if not policy.copies:
    return None
  local_dir = os.path.abspath(c.local_dir or local_room.default_dir(workdir))
  held = state_bytes(target)  # This process's distinct shards: what each copy holds.
  partnered = jax.process_count() > 1
  short = local_room.shortfall(local_dir, held, partnered)
  timeout_s = config.watchdog.startup_timeout_s
  if not multihost.all_agree("local_tier_room", short is None, timeout_s):
    why = short or "another process's local_dir has no room"
    if not policy.measured:  # Copies every N steps were asked for: no room is the user's to fix.
      raise UserError(f"{why}: {local_room.ROOM}")
    console(
      f"warning: the local checkpoint tier is off: {why}; a lost host costs up to checkpoint.every steps"
    )
    return None
  key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
  link_timeout_s = config.watchdog.peer_timeout_s or _PEER_TIMEOUT_S
  tier = LocalTier(local_dir, key, json.loads(config.to_json()), link_timeout_s, c.local_pace_mib)
  console(f"local tier: {local_room.memory_line(held, partnered)}; {local_dir}")
  return tier
