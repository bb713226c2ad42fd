"""SIGTERM / SIGINT: every process agrees on a step, saves there, and exits 0.

One process: our own handler sets a flag; the loop stops after the step in flight. Several processes:
JAX's preemption service owns SIGTERM (installed by jax.distributed.initialize) and agrees on a step
all processes reach (multihost_utils.reached_preemption_sync_point, called every step by everyone);
SIGINT is turned into SIGTERM so both signals take the same path. A second signal while saving only
sets the flag again: the save in progress completes and nothing is half-written.
"""

import signal

import jax
from jax.experimental import multihost_utils


class Preemption:
  def __init__(self):
    self.received: str | None = None
    self._multi = jax.process_count() > 1
    self._previous = {}
    if not self._multi:
      self._install(signal.SIGTERM, self._note)
    self._install(signal.SIGINT, self._to_sigterm if self._multi else self._note)

  def _install(self, signum, handler) -> None:
    try:
      self._previous[signum] = signal.signal(signum, handler)
    except ValueError:  # Not the main thread (e.g. a test runner's worker): no signal handling.
      pass

  def _note(self, signum, frame) -> None:
    self.received = self.received or signal.Signals(signum).name  # The first signal is the cause.

  def _to_sigterm(self, signum, frame) -> None:
    self.received = self.received or signal.Signals(signum).name
    signal.raise_signal(signal.SIGTERM)  # To JAX's preemption notifier, which tells every process.

  def should_stop(self, step: int) -> bool:
    """Same answer on every process for a given step; call it at every step on every process."""
    if self._multi:
      if multihost_utils.reached_preemption_sync_point(step):
        self.received = self.received or "SIGTERM"
        return True
      return False
    return self.received is not None

  def restore_handlers(self) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
