"""When periodic work runs: one rule for logging, saving, evaluating, the local tier's copies and the
integrity checks, and a clock for saving.

`itstime(step, every, last_step, last=True)`: every N steps (0: never), and the run's last step where
`last` asks for it (logging and saving always do).

`ByClock` adds work by the clock (checkpoint.every_s's saves, a hook's every_s), so a slow model still
saves about that often: at each logging step process 0 decides whether the next logging step is due
(whether the clock will have run out by then, if the window lasts as long as the last one) and
publishes the decision in the coordination service's key-value store; every process reads it when
that step comes, a whole window after it was made. Every process decides the same, nobody waits for a
slow clock, and no step runs a collective for it.

`CopyCadence` decides the same way how often the local tier copies (its CopyPolicy says whether it
decides at all): once a logging window until a copy's work is measured, then every step while that
work fits in a tenth of a step, else every N steps, so that copies cost the loop little and never set
its pace; once windows with and without a copy in flight show what a copy costs the loop, by that. The
steps' pace it judges by comes from windows without a copy in flight where there are any.
"""

import collections
import dataclasses
import json
import math
import statistics
import time

import jax

from trainer.cluster import multihost
from trainer.observe.metrics import console


def itstime(step: int, every: int, last_step: int | None = None, last: bool = False) -> bool:
  """Whether `step` is on the cadence of `every` steps (0: never), or is the last step and `last`."""
  return (every > 0 and step % every == 0) or (last and step == last_step)


class _Published:
  """A value process 0 decides at a logging step for the next logging step and publishes in the
  coordination service's key-value store; every process reads it when that step comes, a whole window
  after it was made: every process acts the same, nobody waits, and no step runs a collective for it.
  `name` keeps the decisions apart, `what` says in an error what was decided."""

  def __init__(self, name: str, what: str, log_every: int, timeout_s: float):
    self.name, self.what, self.log_every, self.timeout_s = name, what, log_every, timeout_s
    self._client = multihost.client()
    self._decided: dict[int, str] = {}  # Logging step -> value, as this process read or decided it.
    self._attempt = 0
    self._last_decision = time.time()

  def _restart(self, step: int, attempt: int, value: str) -> None:
    """The loop starts (or starts again after a rollback, `attempt`) after `step`."""
    self._attempt, self._decided, self._last_decision = attempt, {}, time.time()
    self._publish(self._next_logging_step(step), value)

  def _forget(self, step: int) -> None:
    """Forgets the decisions up to `step`, read or made: each is needed up to its own step only."""
    self._decided = {s: v for s, v in self._decided.items() if s > step}

  def _window_s(self, step: int) -> float:
    """Seconds since the last decision (a logging window), forgetting decisions up to `step`."""
    now = time.time()
    window_s, self._last_decision = now - self._last_decision, now
    self._forget(step)
    return window_s

  def _read(self, step: int) -> str | None:
    """The value published for logging step `step`, the same on every process."""
    if step not in self._decided and self._client is not None:
      try:
        self._decided[step] = self._client.blocking_key_value_get(self._key(step), int(1000 * self.timeout_s))
      except Exception as e:  # noqa: BLE001 - the coordination service's deadline, as its error.
        raise multihost.PeerTimeout(
          f"process 0's decision {self.what} at step {step} did not come within "
          f"{self.timeout_s:.0f} s ({type(e).__name__}): process 0 is stuck or gone"
        ) from None
    return self._decided.get(step)

  def _publish(self, step: int, value: str) -> None:
    if self._client is None:
      self._decided[step] = value
    elif jax.process_index() == 0:
      self._client.key_value_set(self._key(step), value, allow_overwrite=True)

  def _next_logging_step(self, step: int) -> int:
    return (step // self.log_every + 1) * self.log_every

  def _key(self, step: int) -> str:
    return f"{self.name}/{self._attempt}/{step}"


class ByClock(_Published):
  """Work due on logging steps about every `every_s` seconds of process 0's clock (0: never), the same
  on every process: checkpoint.every_s's saves, a hook's `every_s`."""

  def __init__(self, name: str, every_s: float, log_every: int, timeout_s: float):
    super().__init__(f"by_clock/{name}", f"whether {name} runs", log_every, timeout_s)
    self.every_s = every_s
    self._last_run = time.time()

  def begin(self, step: int, attempt: int) -> None:
    """The first logging step after `step` is not due by the clock."""
    if self.every_s:
      self._restart(step, attempt, "0")

  def ran(self) -> None:
    self._last_run = time.time()

  def decide(self, step: int) -> None:
    """At logging step `step`, after its work: process 0 decides for the next logging step, which is
    due if the clock will have run out by then (a window from now, if it lasts as long as this one)."""
    window_s = self._window_s(step)
    if self.every_s:
      due = time.time() + window_s - self._last_run >= self.every_s
      self._publish(self._next_logging_step(step), "1" if due else "0")

  def due(self, step: int) -> bool:
    """Whether logging step `step` is due by the clock: the same answer on every process."""
    return bool(self.every_s) and step % self.log_every == 0 and self._read(step) == "1"


@dataclasses.dataclass(frozen=True)
class CopyPolicy:
  """checkpoint.local_every, decoded here alone: the local tier off (0), a copy every N steps (N > 0),
  or as often as measured copies allow (-1, CopyCadence's decisions)."""

  every: int = 0  # N of a fixed cadence.
  measured: bool = False

  @classmethod
  def of(cls, local_every: int) -> "CopyPolicy":
    return cls(max(local_every, 0), local_every < 0)

  @property
  def copies(self) -> bool:
    return self.measured or self.every > 0


@dataclasses.dataclass(frozen=True)
class Decision:
  """What process 0 publishes for a logging step's window (as JSON): copy every `every` steps, or none in
  this window (`probe`, which measures the steps without them), with the measurements behind it."""

  every: int
  probe: bool = False
  copy_s: float | None = None  # A copy's work, the seconds per step, and a copy's steps until whole.
  step_s: float | None = None
  whole: int = 1
  slower_pct: float | None = None  # Steps this much slower beside a copy in flight for span_s.
  span_s: float | None = None

  def dumps(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  def why(self) -> str:
    if self.copy_s is None:
      return ""
    why = f"a copy's work {self.copy_s:.2f} s, {self.step_s:.3f} s per step"
    if self.slower_pct is not None:
      why += f"; steps {self.slower_pct:.1f}% slower beside a copy in flight for {self.span_s:.2f} s"
    return f" ({why})"


class CopyCadence(_Published):
  """When the local tier copies (trainer/checkpoint/local.py), by its CopyPolicy. Every N steps: each
  copy waits for the one before (copies slower than N steps set the loop's pace). Measured: once a
  logging window until a copy's work is known (a copy in pinned host memory holds up the next step in a
  way no wait shows, so steps copied every step would misstate the steps' pace), then every step while
  a copy's work fits in WORK_SHARE of a step, else every N steps (a power of two), so that copies cost
  the loop little and never set its pace. At each logging step process 0 compares a copy's work (the
  median of its last eight) with the steps' own pace (_pace) and decides N for the window after the
  next logging step; a change is said in one line with the worst case a lost host costs (lost_steps).
  Once windows with a copy in flight and windows without show how much slower a step runs beside a
  copy (`slowdown`), N is the fewest steps whose copies cost the loop at most COST_SHARE and leave room
  for a copy's work. Where copies leave no window without one (every step, say), one window in
  PROBE_AFTER + 1 is left without copies to measure against, said with what a lost host costs there."""

  def __init__(self, policy: CopyPolicy, log_every: int, timeout_s: float, checked_every: int = 0):
    super().__init__("local_cadence", "how often the local tier copies", log_every, timeout_s)
    # A run with checks resumes only from a copy a check saw: copies at its checked steps too (checked),
    # and a lost host costs what their interval allows, whatever N.
    self.checked_every = checked_every if policy.copies else 0
    self.fixed, self.adapts = policy.every, policy.measured
    self.every, self._from, self._waited_s, self._busy_s = self.fixed or 1, 0, 0.0, 0.0
    # (warmed up, quiet, own seconds per step) of the last eight windows: the pace N is judged by.
    self._step_times: collections.deque[tuple[bool, bool, float]] = collections.deque(maxlen=8)
    # (share of the window a copy was in flight, its seconds per step): slowdown's, windows mostly
    # without a copy and mostly beside one apart, so that rare quiet windows (probes) are not crowded out.
    self._quiet: collections.deque[tuple[float, float]] = collections.deque(maxlen=8)
    self._busy: collections.deque[tuple[float, float]] = collections.deque(maxlen=8)
    self._unquiet, self._quiet_until = 0, 0  # Windows since a quiet one; a probe's window's end.
    self._windows = 0  # Since the loop began: the first WARM_UP are not measured.

  def begin(self, step: int, attempt: int) -> None:
    self.every, self._from = self.fixed or 1, step
    self._step_times.clear()
    self._quiet.clear()
    self._busy.clear()
    self._unquiet, self._quiet_until, self._windows = 0, 0, 0
    if self.adapts:  # A copy a logging window until one is measured: the steps between go without.
      self.every = self.log_every
      self._restart(step, attempt, Decision(self.every).dumps())
    if self.checked_every:
      console(
        f"local tier: a run with checks resumes only from a copy a check saw, taken every "
        f"{self.checked_every} steps; a lost host costs up to {_steps(self._lost(1))}"
      )
    elif self.fixed or self.adapts:
      how = f"a copy every {self.every} steps" if self.every > 1 else "copies every step"
      until = " until a line says otherwise" if self.adapts else ""
      console(f"local tier: {how}{until}; a lost host costs up to {_steps(self._lost(self.every))}")

  def due(self, step: int) -> bool:
    """Whether `step` is copied: the same answer on every process."""
    if not (self.fixed or self.adapts):
      return False
    if self.adapts and step % self.log_every == 0 and (value := self._read(step)) is not None:
      decision = Decision(**json.loads(value))
      self._quiet_until = step + self.log_every if decision.probe else 0
      if decision.every != self.every:
        self.every = decision.every
        how = f"every {self.every} steps" if self.every > 1 else "every step"
        lost = _steps(self._lost(decision.whole))
        console(f"local tier: a copy {how} from step {step}{decision.why()}; a lost host costs up to {lost}")
      if decision.probe and not self.checked_every:  # Checked steps are copied all the same.
        last = step + self.log_every - 1
        console(
          f"local tier: no copies in steps {step}-{last}, a window that measures the steps without them; a "
          f"lost host there costs up to {_steps(lost_steps(self.every, decision.whole) + self.log_every)}"
        )
    return step % self.every == 0 and step >= self._quiet_until

  def _pace(self) -> float:
    """The steps' own seconds per step, the median of the last eight windows': those without a copy in
    flight where there are any (a copy in pinned host memory holds up a step in a way no wait shows),
    after the loop's warm-up where there are any (the first windows run slower than later ones), else
    all, the loop's waits for copies taken out."""
    windows = self._step_times
    for pick in ((lambda warm, quiet: warm and quiet), (lambda warm, quiet: quiet), (lambda *_: True)):
      if chosen := [own for warm, quiet, own in windows if pick(warm, quiet)]:
        return statistics.median(chosen)
    return 0.0

  def checked(self, step: int) -> bool:
    """Whether `step` is copied as a step the checks see (a run with checks resumes only from one)."""
    return bool(self.checked_every) and step % self.checked_every == 0

  def _lost(self, whole: int) -> int:
    """The worst case a lost host costs now: lost_steps of the copies it can resume from."""
    if self.checked_every:
      return lost_steps(self.checked_every, self.checked_every)
    return lost_steps(self.every, whole)

  def decide(
    self, step: int, copy_s: float, step_s: float, waited_s: float, busy_s: float = 0.0, span_s: float = 0.0
  ) -> None:
    """At logging step `step`: process 0 decides N for the next logging step from `copy_s`, a copy's
    work (to host memory, written, checksummed and sent: the median of the last eight), and `step_s`,
    the window's seconds per step (its metrics row's: saves and evaluations left out). `waited_s`, the
    seconds the loop has waited for copies' work so far, is taken out of it: N is judged against the
    steps' own pace, not the one copies set, so it gets there in one decision. And N is judged against
    the median of the last eight windows: the window a copy lands in is slower by what the copy took
    from the loop, which alone would call for copies more often, right after one. `busy_s`, the
    seconds copies have been in flight so far, and `span_s`, a copy's time in flight (the median of the
    last eight), measure it instead once they can (`slowdown`)."""
    window_s = self._window_s(step)
    steps, self._from = max(step - self._from, 1), step
    own = max(step_s - (waited_s - self._waited_s) / steps, 0.0)
    load = (min((busy_s - self._busy_s) / max(window_s, 1e-9), 1.0), own)
    self._unquiet = 0 if load[0] <= QUIET else self._unquiet + 1
    self._windows += 1
    if self._windows > WARM_UP and load[0] <= QUIET:
      self._quiet.append(load)
    elif self._windows > WARM_UP and load[0] >= BUSY:
      self._busy.append(load)
    self._step_times.append((self._windows > WARM_UP, load[0] <= QUIET, own))
    self._waited_s, self._busy_s, step_s = waited_s, busy_s, self._pace()
    if self.adapts:
      slower = slowdown([*self._quiet, *self._busy])
      # No copy's work measured yet (the first one in flight): N as it is.
      every = steps_per_copy(self.every, copy_s, step_s, slower, span_s) if copy_s else self.every
      probe = self._unquiet >= PROBE_AFTER
      self._unquiet = 0 if probe else self._unquiet
      whole = math.ceil(max(span_s, copy_s) / max(step_s, 1e-9) - 1e-6)  # A copy's steps in flight, at least.
      measured = {"slower_pct": 100 * slower, "span_s": span_s} if slower is not None else {}
      decision = Decision(every, probe, copy_s, step_s, max(whole, 1), **measured)
      self._publish(self._next_logging_step(step), decision.dumps())


def lost_steps(every: int, whole: int) -> int:
  """The most steps a lost host costs with a copy every `every` steps, each whole (paced to host memory,
  written, sent) `whole` steps after its own: a kill just before copy k is whole falls back to copy
  k - every. The next copy waits for the one before, so no copy is in flight longer than `every` of its
  own process's steps; but a process waits for copy k after it dispatched the step after those, which
  another process can finish (its row written) before copy k is whole: one step more
  (tests/test_lost_host_bound.py kills there)."""
  return every + min(max(whole, 1), every)


def _steps(n: int) -> str:
  return f"{n} steps" if n > 1 else "a step"


# The share of the time between copies that a copy's work may take. Much of that work runs beside the
# loop (writes, checksums, transfers), but not all of it: a tenth keeps the cost under the tiers' 3%
# where a third of the work comes out of the loop's time (benchmarks/local_tier.py --accelerator
# --every=-1). It decides until the cost is measured (slowdown).
WORK_SHARE = 0.1
# Measured instead (slowdown): the share of the loop's time copies may take, with room to spare for the
# measurement's noise under the 3% the tiers are held to; and the room a copy's work needs between copies
# (the next copy waits for it).
COST_SHARE, WORK_ROOM = 0.02, 1.25
# A window is quiet where copies were in flight for at most QUIET of it, beside one for at least BUSY.
QUIET, BUSY, PROBE_AFTER = 0.25, 0.5, 16
# The windows after the loop begins that are not measured: the first copies' new files and the caches'
# warm-up make a copy's cost to the steps look larger than it is later.
WARM_UP = 4


def slowdown(loads) -> float | None:
  """How much slower a step runs while a copy is in flight, as a fraction of the steps' own pace, from
  (share of a window a copy was in flight, its seconds per step): the slope between the medians of the
  windows mostly without a copy (QUIET) and those mostly beside one (BUSY), two of each at least, or
  None. Medians, not a least-squares line: one window slowed by something else (a save, the host's
  other work) moves them little."""
  quiet = [(f, s) for f, s in loads if f <= QUIET]
  busy = [(f, s) for f, s in loads if f >= BUSY]
  if len(quiet) < 2 or len(busy) < 2:
    return None
  (fq, sq), (fb, sb) = ((statistics.median(x) for x in zip(*group, strict=True)) for group in (quiet, busy))
  slope = (sb - sq) / (fb - fq)
  own = sq - slope * fq
  return max(slope, 0.0) / own if own > 0 else None


def steps_per_copy(
  every: int, copy_s: float, step_s: float, slower: float | None = None, span_s: float = 0.0
) -> int:
  """The next N from the present one: the power of two of steps whose time a copy's work takes at most
  WORK_SHARE of, or, measured (`slower`: slowdown's fraction while a copy is in flight for `span_s`),
  whose time a copy's cost to the loop takes at most COST_SHARE of and a copy's work WORK_ROOM fits in;
  when that is more than N or at most a third of it (the band between keeps N from flapping); else N."""
  need = copy_s / WORK_SHARE / max(step_s, 1e-9)
  if slower is not None:
    need = max(copy_s * WORK_ROOM, slower * span_s / COST_SHARE) / max(step_s, 1e-9)
  if need > every or 3 * need <= every:
    return 1 if need <= 1 else min(2 ** math.ceil(math.log2(need)), 1 << 16)
  return every
