"""SIGINT and SIGTERM before the training loop takes over, and in the modes that save nothing.

main.py installs these handlers first thing, before JAX is imported. Until trainer/cluster/preemption.py
replaces them (in the loop, where a signal means "save and stop"), a signal raises `Interrupted`,
which main.py turns into one line, `interrupted during start-up (SIGTERM): nothing to save`, and the
conventional exit code 128 + N: a scheduler reads it as "did not finish", and a user's Ctrl-C never
prints a traceback. No JAX import here: this module runs before JAX is loaded.

In a multi-process job, jax.distributed.initialize installs JAX's own SIGTERM handler (its
preemption service); a SIGTERM after joining is held there, and the loop saves at its first step.
"""

import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_phase = "start-up"


class Interrupted(BaseException):  # Not an Exception: no `except Exception` on the way may swallow it.
  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum
    self.name = signal.Signals(signum).name
    self.phase = _phase

  @property
  def exit_code(self) -> int:
    return 128 + self.signum

  def line(self) -> str:
    return f"interrupted during {self.phase} ({self.name}): nothing to save"


def _raise(signum, frame) -> None:
  raise Interrupted(signum)


def install() -> None:
  for signum in SIGNALS:
    signal.signal(signum, _raise)


def during(phase: str) -> None:
  """Names what a signal would interrupt, for its line ('start-up', '--mode=eval', ...)."""
  global _phase
  _phase = phase
