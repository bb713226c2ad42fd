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
"""

import time

import jax

from trainer.cluster import multihost


def itstime(step: int, every: int, last_step: int | None = None, last: bool = False) -> bool:
  """Whether `step` is on the cadence of `every` steps (0: never), or is the last step and `last`."""
  return (every > 0 and step % every == 0) or (last and step == last_step)


class ByClock:
  """Work due on logging steps about every `every_s` seconds of process 0's clock (0: never), the same
  on every process: checkpoint.every_s's saves, a hook's `every_s`. `name` keeps the decisions apart."""

  def __init__(self, name: str, every_s: float, log_every: int, timeout_s: float):
    self.name, self.every_s, self.log_every, self.timeout_s = name, every_s, log_every, timeout_s
    self._last_run = time.time()
    self._client = multihost.client()
    self._decided: dict[int, bool] = {}  # Logging step -> due, as this process read or decided it.
    self._attempt = 0

  def begin(self, step: int, attempt: int) -> None:
    """The loop starts (or starts again after a rollback, `attempt`) after `step`: the first logging
    step after it is not due by the clock."""
    self._attempt, self._decided, self._last_decision = attempt, {}, time.time()
    self._publish(self._next_logging_step(step), False)

  def ran(self) -> None:
    self._last_run = time.time()

  def decide(self, step: int) -> None:
    """At logging step `step`, after its work: process 0 decides for the next logging step, which is
    due if the clock will have run out by then (a window from now, if it lasts as long as this one)."""
    now = time.time()
    window_s, self._last_decision = now - self._last_decision, now
    self._decided = {s: v for s, v in self._decided.items() if s > step}
    self._publish(self._next_logging_step(step), now + window_s - self._last_run >= self.every_s)

  def due(self, step: int) -> bool:
    """Whether logging step `step` is due by the clock: the same answer on every process."""
    if not self.every_s or step % self.log_every:
      return False
    if step not in self._decided and self._client is not None:
      try:
        value = self._client.blocking_key_value_get(self._key(step), int(1000 * self.timeout_s))
      except Exception as e:  # noqa: BLE001 - the coordination service's deadline, as its error.
        raise multihost.PeerTimeout(
          f"process 0's decision whether {self.name} runs at step {step} did not come within "
          f"{self.timeout_s:.0f} s ({type(e).__name__}): process 0 is stuck or gone"
        ) from None
      self._decided[step] = value == "1"
    return self._decided.get(step, False)

  def _publish(self, step: int, due: bool) -> None:
    if not self.every_s:
      return
    if self._client is None:
      self._decided[step] = due
    elif jax.process_index() == 0:
      self._client.key_value_set(self._key(step), "1" if due else "0", allow_overwrite=True)

  def _next_logging_step(self, step: int) -> int:
    return (step // self.log_every + 1) * self.log_every

  def _key(self, step: int) -> str:
    return f"by_clock/{self.name}/{self._attempt}/{step}"
