"""trainer/cadence.py: one rule for everything periodic, and saves by the clock (checkpoint.every_s),
decided by process 0 a logging window ahead and read by every process through the coordination service."""

import os
import subprocess
import sys

from tests.conftest import REPO, TINY_FLAGS, tiny_config
from trainer.cadence import itstime
from trainer.train import train

TIMED = {"steps": 8, "log_every": 2, "checkpoint.every": 100, "checkpoint.keep": 10}


def _saved(workdir) -> list[int]:
  return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")))


def test_itstime_is_every_n_steps_and_the_last_when_asked():
  assert [s for s in range(1, 11) if itstime(s, 4)] == [4, 8]
  assert [s for s in range(1, 11) if itstime(s, 4, 10, last=True)] == [4, 8, 10]
  assert [s for s in range(1, 11) if itstime(s, 0, 10, last=True)] == [10]  # 0: never, but the last.


def test_a_run_slower_than_every_s_saves_at_each_logging_step_after_the_first(tmp_path):
  """Each step outlasts every_s: the first logging step was decided at the start (no save), each later
  one at the logging step before it (a save); by steps alone only the last step saves."""
  train(tiny_config(**TIMED, **{"checkpoint.every_s": 1e-3}), str(tmp_path / "timed"))
  assert _saved(tmp_path / "timed") == [4, 6, 8]
  train(tiny_config(**TIMED, **{"checkpoint.every_s": 3600.0}), str(tmp_path / "steps"))
  assert _saved(tmp_path / "steps") == [8]


def test_two_processes_agree_on_the_saves_by_process_0s_clock(tmp_path):
  """A save is a collective: had the processes decided differently, the job would hang, not finish."""
  launcher = [sys.executable, "launch/local.py", "--processes=2", "--cpu_devices=4", "--"]
  flags = [*TINY_FLAGS, *(f"--config.{k}={v}" for k, v in TIMED.items())]
  flags += ["--config.checkpoint.every_s=0.001", "--config.checkpoint.local_every=0"]
  result = subprocess.run(
    [*launcher, *flags, f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=240
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert _saved(tmp_path) == [4, 6, 8]
