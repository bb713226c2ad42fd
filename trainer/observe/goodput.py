"""Where a run's wall time went: summary.json's `goodput`, from process start to the summary.

Each second is booked once, by the clock (trainer/observe/clock.py), in the phase it is spent in, and
each phase has its category (no category is the rest of another): start-up (imports, building, init,
opening the data), restore, compile, productive steps, data wait (the loop waiting for its next
batch), checkpoint blocking (the loop's share of saving: the rest is written in the background),
evaluation, profiling (starting, stopping and reading back the profile window's trace), and steps
trained again: `lost_to_restarts` (steps an earlier run of this workdir had trained already, known
from the `batch` field of its metrics rows: up to log_every - 1 unlogged steps before a kill count
as productive; process 0 knows, the others count none) and `lost_to_rollbacks` (steps a NaN rollback
threw away). `unaccounted` is the wall time minus their sum: a few hundredths at most.
"""

import time

from trainer.observe.clock import CATEGORIES


class Ledger:
  def __init__(self, started: float):
    """`started`: when this run's process started (time.time())."""
    self.started = started
    self.trained_before = -1  # The last global batch an earlier run of this workdir logged as trained.
    self.seconds = dict.fromkeys(CATEGORIES, 0.0)
    self._steps: dict[int, tuple[str, float]] = {}  # Step -> (category, seconds), for rollbacks.

  def add(self, category: str, seconds: float) -> None:
    self.seconds[category] += seconds

  def step(self, step: int, batch: int, seconds: float) -> None:
    """The time of `step` (trained on global batch `batch`), beyond its data wait, saving and evaluating."""
    category = "lost_to_restarts" if batch <= self.trained_before else "productive_steps"
    self.seconds[category] += seconds
    self._steps[step] = (category, seconds)

  def saved(self, step: int) -> None:
    """A checkpoint at `step`: no rollback goes before it, so earlier steps' records can go."""
    self._steps = {s: v for s, v in self._steps.items() if s > step}

  def discard_after(self, step: int) -> None:
    """A rollback to `step`: the steps after it were trained for nothing."""
    for s in [s for s in self._steps if s > step]:
      category, seconds = self._steps.pop(s)
      self.seconds[category] -= seconds
      self.seconds["lost_to_rollbacks"] += seconds

  def split(self) -> dict:
    """{category: seconds, ..., wall_s, unaccounted_s, goodput}: goodput is productive / wall."""
    wall = time.time() - self.started
    out = {k: round(v, 4) for k, v in self.seconds.items()}
    out["wall_s"] = round(wall, 4)
    out["unaccounted_s"] = round(wall - sum(self.seconds.values()), 4)
    out["goodput"] = round(self.seconds["productive_steps"] / wall, 4) if wall > 0 else None
    return out


def line(split: dict) -> str:
  """'goodput 71%: productive 8.1 s, compile 2.0 s, ...' (the non-zero categories, largest first)."""
  parts = sorted(((split[k], k) for k in CATEGORIES if split[k] > 0.005), reverse=True)
  text = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for v, k in parts)
  return f"goodput {100 * (split['goodput'] or 0):.0f}% of {split['wall_s']:.1f} s: {text}"
