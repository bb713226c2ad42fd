"""The goodput clock is saved with every checkpoint (trainer/observe/goodput.py): after two crashes and
two restarts the run's goodput is every run's time, read back from the checkpoints it resumed from,
with what each restart threw away (from the save to the restart) as lost_to_restarts."""

import json
import os

import pytest

from tests.conftest import tiny_config
from trainer import loop as loop_lib
from trainer.train import train

CONFIG = {"checkpoint.every": 2, "checkpoint.local_every": 0}


class Crash(BaseException):
  pass


def _clock(workdir, step: int) -> dict:
  with open(os.path.join(workdir, "checkpoints", str(step), "data", "metadata")) as f:
    return json.load(f)["clock"]


def _crash_at(monkeypatch, step: int) -> None:
  """The process dies at `step`'s row, after the save before it (a kill, in-process)."""
  real = loop_lib.Loop._log

  def log(self, at, *args):
    if at == step:
      raise Crash
    return real(self, at, *args)

  monkeypatch.setattr(loop_lib.Loop, "_log", log)


def test_goodput_after_two_restarts_is_every_runs_time_from_the_saved_clocks(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  for crash in (3, 5):
    _crash_at(monkeypatch, crash)
    with pytest.raises(Crash):
      train(tiny_config(**CONFIG), workdir)
    monkeypatch.undo()
  summary = train(tiny_config(**CONFIG), workdir)
  total, this_run = summary["goodput"], summary["goodput_this_run"]
  c2, c4, c6 = (_clock(workdir, s) for s in (2, 4, 6))
  assert not c2["ended"] and not c4["ended"] and c6["ended"]  # Only the last step's save ends a run.
  # Each restart lost the time from the save it resumed from to its own start: the first between
  # checkpoints 2 and 4, both by 6; nothing is lost after the final save.
  assert c2["seconds"]["lost_to_restarts"] == 0 < c4["seconds"]["lost_to_restarts"]
  assert c4["seconds"]["lost_to_restarts"] < c6["seconds"]["lost_to_restarts"] == total["lost_to_restarts"]
  assert this_run["lost_to_restarts"] == 0
  # Every run's time: what the clocks carried plus this run's, adding up to the whole wall time.
  for category in ("startup", "compile", "restore"):
    assert total[category] == pytest.approx(c4["seconds"][category] + this_run[category], abs=1e-3)
  assert total["wall_s"] > c6["wall_s"] > c4["wall_s"] + this_run["productive_steps"]
  assert abs(total["unaccounted_s"]) <= 0.05 * total["wall_s"], total


def test_a_run_that_ended_loses_nothing_to_the_pause_before_its_resume(tmp_path):
  workdir = str(tmp_path)
  train(tiny_config(**CONFIG), workdir, stop_after=2)  # Stopped there, as a signal would.
  assert _clock(workdir, 2)["ended"]
  summary = train(tiny_config(**CONFIG), workdir)
  assert summary["goodput"]["lost_to_restarts"] == 0
  assert summary["goodput"]["productive_steps"] > summary["goodput_this_run"]["productive_steps"] > 0
