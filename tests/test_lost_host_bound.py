"""The worst case a lost host costs (trainer/cadence.py's lost_steps), with kills at random points of
the local tier's copy pipeline, not after its copies are whole (tests/test_local_tier.py waits for them).

In process: two processes' real LocalTiers, linked by real peer services on 127.0.0.1, stepped as
trainer/loop.py steps them, are interrupted at random points (a part's pacing, the write, the rename
that makes a copy whole, the send, the partner's receive, between steps), the host lost with or
without its storage; what a restart resumes from is the newest step every process holds whole
(LocalTier.holdings, local.newest_common), and the steps lost never exceed lost_steps, which the
worst placement attains. Then a two-process job is killed three times where it stands (the steps drawn
from the seed), once at that worst placement; its losses equal an uninterrupted run's bit for bit.
"""

import json
import os
import re
import shutil
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import TINY_FLAGS, train_losses
from tests.test_local_tier import _Job, _process_pid
from trainer.cadence import lost_steps
from trainer.checkpoint import local, local_copies, local_restore
from trainer.cluster import peers

pytestmark = pytest.mark.slow

SEED = 20261207
LEAVES, LEAF_BYTES = 12, 1024  # The simulated state: a part per leaf at a pace of 1 KiB.


class _HostLost(BaseException):
  """The host died here (BaseException: the tier's writer keeps it as its error, as a kill would)."""


class _Pipeline:
  """Two processes' tiers stepped as trainer/loop.py steps them: both dispatch step s (a part of each
  copy in flight goes), then each in turn, in `orders[s]`, waits for its copy in flight where a copy is
  due, saves the next, writes step s's row and releases the copy. One process can so finish step k + N
  while the other still waits for its copy k, as in a job: the loop waits after dispatching the step.
  Between actions the writers settle (a part waits for a step, PACE_WAIT_S being long), so each kill
  lands where it was drawn. `kill`: the one point armed, (where, process, step, n)."""

  def __init__(self, folder, services, every: int, pace_kib: int, kill: tuple, orders: list):
    self.every, self.kill_at, self.orders = every, kill, orders
    self.world = threading.Lock()  # Orders the loop's actions and a kill.
    self.completed, self.over, self.victim, self.lost_at = 0, False, None, None
    self.done: dict[tuple[int, int], int] = {}  # (process, step): steps completed when it was sent.
    # Per process: its copy in flight; the parts it began, the steps dispatched and those its parts took
    # since its save; whether its writer waits for a step.
    self.flight, self.parts, self.stepped, self.acquired = [0, 0], [0, 0], [0, 0], [0, 0]
    self.parked = [False, False]
    addresses = {p: s.address for p, s in enumerate(services)}
    self.tiers = []
    for p in range(2):
      with pytest.MonkeyPatch.context() as m:
        m.setattr(jax, "process_index", lambda p=p: p)
        tier = local.LocalTier(str(folder), "key", {}, link_timeout_s=0.2, pace_mib=pace_kib / 1024)
      tier.processes, tier.partner, tier._addresses = 2, 1 - p, lambda: addresses
      tier._next_part = lambda p=p, paced=tier._next_part: self._next_part(p, paced)
      services[p].streams[local.PUT] = lambda sock, n, p=p: self._receive(p, sock, n)
      self.tiers.append(tier)

  # --- The kill, and the hooks where it lands.
  def kill(self, victim: int, error=_HostLost):
    with self.world:
      if not self.over:
        self.over, self.victim, self.lost_at = True, victim, self.completed
    raise error("host lost")

  def alive(self, error=_HostLost) -> None:
    if self.over:  # The job is gone: no process touches a copy again.
      raise error("host lost")

  def _armed(self, where: str, process: int, step: int) -> bool:
    return self.kill_at[:3] == (where, process, step)

  def _next_part(self, p: int, paced) -> None:
    self.alive()
    self.parts[p] += 1
    if self._armed("pace", p, self.flight[p]) and self.parts[p] == self.kill_at[3]:
      self.kill(p)
    self.parked[p] = True
    paced()
    self.parked[p], self.acquired[p] = False, self.acquired[p] + 1
    self.alive()

  def stage(self, original, folder, step, fill, hashed=True):
    """A copy's write (own or a partner's): torn after `n` bytes where a write is armed."""
    self.alive(OSError)
    p = self._owner(folder)
    if p is None or not self._armed("write", p, step):
      return original(folder, step, fill, hashed)
    cut = self.kill_at[3]

    def torn(w):
      written = 0

      def write(data):
        nonlocal written
        data = memoryview(data).cast("B")
        if written + len(data) >= cut:
          w.write(data[: cut - written])
          self.kill(p)
        written += len(data)
        return w.write(data)

      fill(types.SimpleNamespace(write=write))

    return original(folder, step, torn, hashed)

  def commit(self, original, folder, step, manifest):
    """The rename that makes a copy whole: a kill just before it where armed."""
    self.alive(OSError)
    p = self._owner(folder)
    if p is not None and self._armed("commit", p, step):
      self.kill(p)
    return original(folder, step, manifest)

  def _receive(self, p: int, sock, n: int):
    self.alive(OSError)
    return self.tiers[p]._receive(sock, n)

  def read_to_file(self, original, sock, n, f):
    """A partner's copy arriving (process_R/held/S/STEP.tmp): torn after `n` bytes where its send (the
    sender lost) or its receive (the receiver lost) is armed."""
    receiver, sender, step = map(int, re.search(r"process_(\d+)/held/(\d+)/(\d+)\.tmp", f.name).groups())
    for where, victim in (("send", sender), ("receive", receiver)):
      if self._armed(where, sender, step):
        original(sock, min(self.kill_at[3], n), f)
        self.kill(victim, OSError)  # The service answers an error; the sender finds the job gone.
    return original(sock, n, f)

  def request(self, original, address, kind, payload, timeout_s, file=None):
    """A send to the partner; when it returns the partner holds the copy whole."""
    self.alive()
    try:
      reply = original(address, kind, payload, timeout_s, file=file)
    except peers.PeerError:
      self.alive()
      raise
    n = int.from_bytes(payload[:8], "big")
    sent = json.loads(bytes(payload[8 : 8 + n]))
    with self.world:
      self.done[(sent["process"], sent["step"])] = self.completed
    return reply

  def _owner(self, folder) -> int | None:
    """The process whose own copies `folder` holds, else None (a partner's)."""
    return next((p for p, t in enumerate(self.tiers) if t.own == folder), None)

  # --- The loop.
  def _settle(self) -> None:
    """Until every writer waits for the loop: for a step (each dispatched one spent), or for a copy."""

    def waiting(p: int) -> bool:
      return self.tiers[p]._idle.is_set() or (self.parked[p] and self.acquired[p] == self.stepped[p])

    deadline = time.time() + 30
    while not self.over and not (waiting(0) and waiting(1)):
      assert time.time() < deadline, "a writer neither waits for a step nor finishes"
      time.sleep(0.0005)

  def run(self, steps: int, state) -> None:
    try:
      for s in range(1, steps + 1):
        with self.world:
          if self.over:
            return
          for p, tier in enumerate(self.tiers):
            self.stepped[p] += 1
            tier.stepped()
        self._settle()
        for p in map(int, self.orders[s]):
          due = s % self.every == 0
          if due:
            try:
              self.tiers[p].wait()
            except (_HostLost, OSError):
              if not self.over:
                raise
          with self.world:
            if self.over:
              return
            if due:
              self.flight[p], self.parts[p], self.stepped[p], self.acquired[p] = s, 0, 0, 0
              self.tiers[p].save(s, state, {"step": s}, checked=True, finite_flags=[])
            self.completed = s  # Process p's row of step s is written.
            if due:
              self.tiers[p].release()
          if self._armed("loop", p, s):
            try:
              self.kill(p)
            except _HostLost:
              return
          self._settle()
    finally:
      self.over = True  # The writers find the job gone at their next hook and end.
      for tier in self.tiers:
        try:
          tier.close(finished=False)
        except (_HostLost, OSError):  # The writer's error, raised by close's wait: close again.
          tier.close(finished=False)

  def resumed(self, wiped: bool) -> int:
    """The step a restart resumes from: the newest every process holds whole (0: the start)."""
    if wiped:  # A replacement host: its own copies and those it held for its partner are gone.
      shutil.rmtree(self.tiers[self.victim].root)
    holdings = {p: t.holdings() for p, t in enumerate(self.tiers)}
    return local_restore.newest_common(holdings, 2) or 0

  def whole(self, parts: int) -> int:
    """Steps a copy is in flight, from its save to sent whole by both processes (the most of those that
    got there: trainer/cadence.py measures the same); before any did, what the pacing makes of it, a part
    a step, the next copy's wait rushing the rest."""
    spans = [
      max(self.done[(0, k)], self.done[(1, k)]) - k + 1
      for (p, k) in self.done
      if p == 0 and (1, k) in self.done
    ]
    return max(spans) if spans else min(max(parts, 1), self.every)


@pytest.fixture
def services(monkeypatch):
  """Two peer services on 127.0.0.1 under one secret, and the pipeline's hooks on the functions the
  tier calls through their modules; `current[-1]` is the pipeline they report to."""
  monkeypatch.setenv(peers.SECRET_ENV, "lost-host-bound-" + "x" * 16)
  monkeypatch.setattr(peers, "_secret", [])
  monkeypatch.setattr(local, "PACE_WAIT_S", 60.0)  # A part goes with a step only: each kill lands as drawn.
  made = [peers.PeerService(p, "127.0.0.1", 0, secret=peers.job_secret()) for p in range(2)]
  current: list[_Pipeline] = []

  def hook(module, name):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: getattr(current[-1], name)(original, *a, **k))

  for module, names in ((local_copies, ("stage", "commit")), (peers, ("read_to_file", "request"))):
    for name in names:
      hook(module, name)
  yield made, current
  for service in made:
    service.close()


def test_a_host_lost_anywhere_in_the_copy_pipeline_costs_at_most_lost_steps_and_the_worst_place_costs_that(
  tmp_path, services
):
  """24 kills drawn at random (N, pace, the copy, its process and where: a part, a byte of the write,
  the rename, a byte of the send or the receive, between steps; the host's storage kept or wiped), then
  4 at the worst place: the rename of copy k by the process that waits for it last, at step k + N, after
  the other process finished that step. Each loses at most lost_steps(N, whole), N + whole at most
  (whole: a copy's steps in flight); the worst place loses exactly that, 2N (the next copy's wait
  rushes copy k, so whole = N): a step more than the killed process had finished."""
  made, current = services
  rng = np.random.default_rng(SEED)
  print(f"seed {SEED}")
  state = {f"w{i}": jnp.full(LEAF_BYTES // 4, i, jnp.float32) for i in range(LEAVES)}
  seen = []
  for i in range(28):
    worst = i >= 24
    every = int(rng.integers(2, 5))
    pace_kib = 1 if worst else int(rng.choice([0, 1, 2, 3, 4, 6, 12]))  # 0: at once.
    parts = -(-LEAVES // pace_kib) if pace_kib else 0  # A part per pace_kib leaves of 1 KiB.
    copy = every * int(rng.integers(1, 4))
    orders = [rng.permutation(2) for _ in range(copy + 2 * every + 1)]
    if worst:
      kill = ("commit", int(orders[copy + every][1]), copy, 0)
    else:
      where = str(rng.choice(["write", "commit", "send", "receive", "loop"] + ["pace"] * (2 * bool(parts))))
      n = int(rng.integers(1, parts + 1)) if where == "pace" else int(rng.integers(0, LEAVES * LEAF_BYTES))
      copy = int(rng.integers(1, copy + 2 * every)) if where == "loop" else copy
      kill = (where, int(rng.integers(0, 2)), copy, n)
    current.append(_Pipeline(tmp_path / str(i), made, every, pace_kib, kill, orders))
    current[-1].run(len(orders) - 1, state)
    run, wiped = current[-1], bool(rng.integers(0, 2))
    assert run.victim is not None, f"{kill} never came"
    back, whole = run.resumed(wiped), run.whole(parts)
    what = f"{kill} p{run.victim} {'wiped' if wiped else 'kept'}"
    seen.append((worst, every, whole, run.lost_at - back, what))
    print(f"N={every} whole={whole}: {what}: lost {run.lost_at - back} of at most {lost_steps(every, whole)}")
  assert all(lost <= lost_steps(every, whole) for _, every, whole, lost, _ in seen), seen
  assert sum(lost > every for _, every, _, lost, _ in seen[:24]) >= 5, seen  # More than the old "up to N".
  assert all(lost == lost_steps(every, whole) == 2 * every for worst, every, whole, lost, _ in seen if worst)


EVERY, STEPS = 3, 30
REPLACED = ("--config.checkpoint.every=", "--config.checkpoint.local_every=")
JOB_FLAGS = [
  *(f for f in TINY_FLAGS if not f.startswith(REPLACED)),
  f"--config.steps={STEPS}",
  "--config.checkpoint.every=100",  # The last step only: every resume is the local tier's (or the start).
  f"--config.checkpoint.local_every={EVERY}",
  # A part per shard, 115 of them a process: a copy's transfers outlast its N steps, so the next copy's
  # wait makes it whole, N steps after its own (whole = N, the most lost_steps allows for).
  "--config.checkpoint.local_pace_mib=0.000001",
]


def _steps_trained_again(lines: list[str]) -> list[int]:
  """For each restart, the last step process 0 finished before it, less the step the next run began at."""
  last, ends, starts = 0, [], []
  for line in lines:
    if m := re.match(r"\[p0\] step (\d+)/", line):
      last = int(m.group(1))
    elif line.startswith("[launch] restart"):
      ends.append(last)
    elif m := re.match(r"\[p0\] params: [\d,]+; steps (\d+) ->", line):
      starts.append(int(m.group(1)))
  return [end - start for end, start in zip(ends, starts[1:], strict=True)]


def test_a_two_process_job_killed_where_it_stands_loses_at_most_lost_steps_and_its_losses_stay_bit_for_bit(
  tmp_path,
):
  """Copies every 3 steps, each whole 3 steps after its own: lost_steps(3, 3) = 6. Kills at a random step
  (of a random process, a random moment into it), at the worst place (process 1's rename of copy k,
  once process 0 has finished step k + 3: 6 steps), and at a random step again; no kill waits for a
  copy to be whole."""
  rng = np.random.default_rng(SEED)
  bound = lost_steps(EVERY, EVERY)
  first = int(rng.integers(4, 10))
  worst = EVERY * (first // EVERY + 2)  # A copy the second run makes.
  third = worst + int(rng.integers(1, 2 * EVERY + 3))
  victims = [int(v) for v in rng.integers(0, 2, size=2)]
  print(
    f"seed {SEED}: kills of p{victims[0]} at step {first}, p1 at copy {worst}, p{victims[1]} at step {third}"
  )
  local_dir, pauses = tmp_path / "local", tmp_path / "pauses"
  pauses.write_text("")
  straight = _Job(tmp_path / "straight", tmp_path / "straight_local", None, flags=JOB_FLAGS)
  restarts = ("--max_restarts=3", "--restart_backoff_s=0.5")
  job = _Job(tmp_path / "run", local_dir, pauses, *restarts, flags=JOB_FLAGS)
  try:
    seen = job.wait_for(f"[p0] step {first}/")
    time.sleep(float(rng.uniform(0, 0.1)))
    pauses.write_text(f"local=60@{worst}/p1")  # Read by the next run at its start.
    os.kill(_process_pid(job.proc.pid, victims[0]), 9)
    restart = job.wait_for("[launch] restart", seen)
    job.wait_for(f"[p1] pause: local {worst}", restart)
    # In either order: process 1 finished step k + 3 before it waited for copy k, so process 0 may too.
    seen = job.wait_for(f"[p0] step {worst + EVERY}/", restart)
    pauses.write_text("")
    os.kill(_process_pid(job.proc.pid, 1), 9)
    seen = job.wait_for(f"[p0] step {third}/", job.wait_for("[launch] restart", seen))
    time.sleep(float(rng.uniform(0, 0.1)))
    os.kill(_process_pid(job.proc.pid, victims[1]), 9)
    assert job.finish() == 0, job.output()
    assert straight.finish() == 0, straight.output()
  finally:
    job.finish(timeout=1)
    straight.finish(timeout=1)
  again = _steps_trained_again(job.lines)
  print(f"steps trained again after each kill: {again}, at most {bound}")
  assert len(again) == 3 and max(again) <= bound, job.output()
  assert again[1] == bound, job.output()  # Process 0 finished step k + 3; process 1's copy k never whole.
  assert f"restored step {worst - EVERY} from the local tier" in job.output(), job.output()
  assert train_losses(str(tmp_path / "run")) == train_losses(str(tmp_path / "straight"))
