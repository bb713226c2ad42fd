"""Where a run's wall time went: summary.json's `goodput` (the whole training, every run of the
workdir) and `goodput_this_run` (from this process's start to the summary).

Each second is booked once, by the clock (trainer/observe/clock.py), in the phase it is spent in, and
each phase has its category (no category is the rest of another): start-up (imports, building, init,
opening the data), restore, compile, productive steps, data wait (the loop waiting for its next
batch), checkpoint blocking (the loop's share of saving: the rest is written in the background),
evaluation, hooks (the experiment's periodic work), profiling (starting, stopping and reading back the
profile window's trace), `lost_to_rollbacks` (steps a NaN rollback threw away) and
`lost_to_restarts`. `unaccounted` is the wall time minus their sum: a few hundredths at most.

The clock is saved with every checkpoint (its `clock`, beside the data position; the local tier's
copies too): every run's seconds up to the save, the wall time, and when it was saved. A run that
resumes from it starts its ledger there, on every process, and books the time from that save to its
own start as `lost_to_restarts`: the work done after the save and thrown away, and the downtime;
unless the run that saved it had ended there (its last step, or a stop on a signal), which is a new
session, not a loss.
"""

import time

from trainer.observe.clock import CATEGORIES


class Ledger:
  def __init__(self, started: float):
    """`started`: when this run's process started (time.time())."""
    self.started = started
    self.seconds = dict.fromkeys(CATEGORIES, 0.0)  # This run's.
    self.before, self.wall_before = dict.fromkeys(CATEGORIES, 0.0), 0.0  # Earlier runs', from a checkpoint.
    self._steps: dict[int, tuple[str, float]] = {}  # Step -> (category, seconds), for rollbacks.

  def resume(self, clock: dict | None) -> None:
    """Earlier runs' time, from the clock saved with the checkpoint this run starts from (None: a
    checkpoint written before clocks were saved, or a fresh start)."""
    if not clock:
      return
    self.before = {k: float(clock["seconds"].get(k, 0.0)) for k in CATEGORIES}
    gap = 0.0 if clock.get("ended") else max(self.started - clock["saved_at"], 0.0)
    self.before["lost_to_restarts"] += gap
    self.wall_before = clock["wall_s"] + gap

  def snapshot(self, pending: dict, ended: bool) -> dict:
    """The clock a checkpoint saves: every run's seconds so far (`pending`: the phases still open)."""
    now = time.time()
    seconds = {k: round(self.before[k] + self.seconds[k] + pending.get(k, 0.0), 4) for k in CATEGORIES}
    return {
      "seconds": seconds,
      "wall_s": self.wall_before + now - self.started,
      "saved_at": now,
      "ended": ended,
    }

  def add(self, category: str, seconds: float) -> None:
    self.seconds[category] += seconds

  def step(self, step: int, seconds: float) -> None:
    """The time of `step`, beyond its data wait, saving and evaluating."""
    self.seconds["productive_steps"] += seconds
    self._steps[step] = ("productive_steps", seconds)

  def saved(self, step: int) -> None:
    """A checkpoint at `step`: no rollback goes before it, so earlier steps' records can go."""
    self._steps = {s: v for s, v in self._steps.items() if s > step}

  def discard_after(self, step: int) -> None:
    """A rollback to `step`: the steps after it were trained for nothing."""
    for s in [s for s in self._steps if s > step]:
      category, seconds = self._steps.pop(s)
      self.seconds[category] -= seconds
      self.seconds["lost_to_rollbacks"] += seconds

  def split(self, whole: bool = True) -> dict:
    """{category: seconds, ..., wall_s, unaccounted_s, goodput} of the whole training (every run of
    the workdir), or of this run alone; goodput is productive / wall."""
    wall = time.time() - self.started + (self.wall_before if whole else 0.0)
    seconds = {k: v + (self.before[k] if whole else 0.0) for k, v in self.seconds.items()}
    out = {k: round(v, 4) for k, v in seconds.items()}
    out["wall_s"] = round(wall, 4)
    out["unaccounted_s"] = round(wall - sum(seconds.values()), 4)
    out["goodput"] = round(seconds["productive_steps"] / wall, 4) if wall > 0 else None
    return out


def line(split: dict) -> str:
  """'goodput 71%: productive 8.1 s, compile 2.0 s, ...' (the non-zero categories, largest first)."""
  parts = sorted(((split[k], k) for k in CATEGORIES if split[k] > 0.005), reverse=True)
  text = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for v, k in parts)
  return f"goodput {100 * (split['goodput'] or 0):.0f}% of {split['wall_s']:.1f} s: {text}"
