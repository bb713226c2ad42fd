"""main.py with hooks added to the LM experiment, for tests only (a fork writes them in its own
experiment file; tests/test_fork.py does that):

  python tests/main_with_hooks.py MAIN_FLAGS...

- `gathered` (process 0 only, every 4 steps): the parameters' sum of squares from host copies of the
  whole state, as a scalar.
- `boom` (every process, every 5 steps): raises on process 1.
- the evaluator `probe` (every process, at each evaluation): the LM task scorer's log-likelihoods and
  greedy tokens (experiments/_lm_tasks.py) of fixed token ids, from the weights as the mesh holds them.
- ERROR_LINE_LATE_S=S: process 1 finds its `error:` line S seconds after the others.
- EXIT_LATE_S=S: process 1 exits S seconds after it says it is leaving (a loaded machine's delay).
"""

import dataclasses
import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import _lm_tasks, lm  # noqa: E402
from trainer.cluster import failures  # noqa: E402
from trainer.hooks import Evaluator, Hook  # noqa: E402

PAIRS = [([3, 5, 7], [9, 11]), ([4], [6, 8, 10])]  # (context, continuation) token ids.
PROMPTS, NEW = [[3, 5, 7], [4]], 3


def probe(model, seq_len: int) -> dict:
  """{metric: value} of the task scorer on `model`: also what the test computes on one device."""
  lls = _lm_tasks.loglikelihoods(model, PAIRS, seq_len)
  tokens = _lm_tasks.continuations(model, PROMPTS, NEW)
  return {f"ll{i}": float(v) for i, v in enumerate(lls)} | {
    "tokens": float(sum(tokens.ravel() * 32.0 ** np.arange(tokens.size)))
  }


def _gathered(ctx) -> None:
  leaves = jax.tree.leaves(ctx.params)
  assert all(isinstance(x, np.ndarray) for x in leaves), "process_0 hooks get host copies"
  ctx.writer.scalar("params_sq", sum(float(np.sum(np.square(x, dtype=np.float64))) for x in leaves))


def _boom(ctx) -> None:
  if jax.process_index() == 1:
    raise RuntimeError("a bug in the fork's hook")


def _late_on_process_1(call, seconds: float):
  """`call` (main.py's error line, os._exit), made `seconds` late on process 1: process 0 must not
  leave the job first."""

  def late(*args):
    if jax.process_index() == 1:
      time.sleep(seconds)
    return call(*args)

  return late


if __name__ == "__main__":  # Importing it (the test does, for `probe`) changes nothing.
  if late_s := float(os.environ.get("ERROR_LINE_LATE_S", 0)):
    failures.error_line = _late_on_process_1(failures.error_line, late_s)
  if late_s := float(os.environ.get("EXIT_LATE_S", 0)):
    os._exit = _late_on_process_1(os._exit, late_s)
  lm.EXPERIMENT = dataclasses.replace(
    lm.EXPERIMENT,
    evaluators=lambda config: [Evaluator("probe", lambda ctx: probe(ctx.model(), ctx.config.data.seq_len))],
    hooks=lambda config: [Hook("gathered", _gathered, every=4, on="process_0"), Hook("boom", _boom, every=5)],
  )
  sys.argv[0] = os.path.join(REPO, "main.py")
  runpy.run_path(sys.argv[0], run_name="__main__")
