"""One clock for the loop's phases: `with clock.phase("checkpoint", step):` beats the watchdog with
that phase's budget, and on leaving books the seconds spent in it, once, in goodput (the Ledger) and
in the open metrics window.

Phases nest, and a second goes to the innermost open phase only: a step's time is what the clock
measured inside it outside the phases inside it (its data wait, save, evaluation, profiling), never a
subtraction that every new phase must join. Leaving an inner phase beats the watchdog for the outer
one again, with a fresh deadline.
"""

import contextlib
import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class Phase:
  category: str  # Where goodput books it (trainer/observe/goodput.py).
  budget: str  # The watchdog.* key that bounds it.


# Every phase, in the order the loop enters them within a step: at the same step, an earlier phase is
# behind a later one (the watchdog's suspect). "step" is booked as productive (goodput.Ledger.step); what a
# restart threw away is booked from the clock saved with the checkpoint (goodput.Ledger.resume).
PHASES = {
  "startup": Phase("startup", "startup_timeout_s"),
  "restore": Phase("restore", "restore_timeout_s"),
  "compile": Phase("compile", "compile_timeout_s"),
  "profiling": Phase("profiling", "compile_timeout_s"),  # Reading a long trace back takes a while.
  "data": Phase("data_wait", "step_timeout_s"),
  "step": Phase("productive_steps", "step_timeout_s"),
  "checkpoint": Phase("checkpoint_blocking", "step_timeout_s"),
  "eval": Phase("evaluation", "step_timeout_s"),
  "hooks": Phase("hooks", "step_timeout_s"),  # An experiment's periodic work (trainer/hooks.py).
  "finish": Phase("checkpoint_blocking", "step_timeout_s"),  # The last write, then the summary.
}
# Goodput's categories: the phases', and the time restarts and rollbacks threw away.
CATEGORIES = (*dict.fromkeys(p.category for p in PHASES.values()), "lost_to_restarts", "lost_to_rollbacks")


class Open:
  """A phase being timed. The block may set `category` (a restore that found nothing is start-up) or
  `batch` (the global batch a step trained on, for the loop)."""

  def __init__(self, name: str, step: int, budget_s: float, since: float):
    self.name, self.step, self.budget_s = name, step, budget_s
    self.category, self.batch = PHASES[name].category, None
    self.since, self.seconds = since, 0.0  # Booked to this phase so far (inner phases excluded).


class Clock:
  def __init__(self, watchdog, ledger, watchdog_config):
    self.watchdog, self.ledger = watchdog, ledger
    watchdog.phase_order = {name: i for i, name in enumerate(PHASES)}  # Who is behind, at the same step.
    self.window = None  # The metrics window the loop has open (trainer/observe/metrics.py), if any.
    self._budgets = {name: getattr(watchdog_config, p.budget) for name, p in PHASES.items()}
    self._open: list[Open] = []

  @contextlib.contextmanager
  def phase(self, name: str, step: int, budget_s: float | None = None, since: float | None = None):
    """Times the block as `name` at `step`, within `budget_s` (default: the phase's own budget).
    `since`: when it began, if before now (start-up begins at process start)."""
    now = time.time()
    if self._open:
      self._book(self._open[-1], now)
    frame = Open(
      name, step, self._budgets[name] if budget_s is None else budget_s, now if since is None else since
    )
    self._open.append(frame)
    self.watchdog.beat(name, step, frame.budget_s)
    try:
      yield frame
    finally:
      self._book(frame, time.time())
      self._open.pop()
      self._close(frame)
      if self._open:
        outer = self._open[-1]
        outer.since = time.time()
        self.watchdog.beat(outer.name, outer.step, outer.budget_s)

  def snapshot(self, ended: bool) -> dict:
    """The clock a checkpoint saves (goodput.Ledger.snapshot), the open phases' seconds so far included:
    `ended`, the run stops at this save (its last step, or a stop on a signal)."""
    now, pending = time.time(), {}
    for frame in self._open:
      seconds = frame.seconds + (now - frame.since if frame is self._open[-1] else 0.0)
      pending[frame.category] = pending.get(frame.category, 0.0) + seconds
    return self.ledger.snapshot(pending, ended)

  def _book(self, frame: Open, now: float) -> None:
    frame.seconds += now - frame.since
    frame.since = now

  def _close(self, frame: Open) -> None:
    if frame.name == "step":
      self.ledger.step(frame.step, frame.seconds)
    else:
      self.ledger.add(frame.category, frame.seconds)
    if self.window is not None:
      self.window.add_phase(frame.name, frame.seconds)
