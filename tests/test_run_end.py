"""The end of a run, interrupted at each phase, and what every report counts.

A kill during the final evaluation or before the summary, then a rerun, leaves the same summary and
the same eval row as an uninterrupted run; a signal during an evaluation ends cleanly; metrics rows
count whole windows and exclude saving and evaluating from throughput; rollbacks and rolled-back
work are counted across restarts; stale per-process files are named. In-process, tiny model: a "kill"
is an exception that skips the rest of train(), leaving on disk what a kill -9 at that moment leaves.
"""

import json
import os
import signal
import struct
import time

import pytest

from tests.conftest import read_jsonl, tiny_config
from trainer import loop, train
from trainer.observe import metrics

STEPS = 4
VOLATILE = (
  "wall_s",
  "compile_s",
  "startup_s",
  "tokens_trained_this_run",
  "goodput",
  "goodput_this_run",
  "tflops_per_device",
  "compiled_flops_per_step",  # A rerun that only finishes the summary compiles no train step.
)  # Of this run, not of the trained model.


class Killed(BaseException):
  pass


def _summary(workdir):
  with open(os.path.join(workdir, "summary.json")) as f:
    return {k: v for k, v in json.load(f).items() if k not in VOLATILE}


def _eval_rows(workdir):
  return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "eval_loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("straight"))
  train.train(tiny_config(steps=STEPS), workdir)
  return _summary(workdir), _eval_rows(workdir)


def _kill_on(monkeypatch, module, name, when=lambda: True):
  real = getattr(module, name)

  def killing(*args, **kwargs):
    if when():
      raise Killed
    return real(*args, **kwargs)

  monkeypatch.setattr(module, name, killing)


@pytest.mark.parametrize("phase", ["final evaluation", "summary"])
def test_a_kill_after_the_final_checkpoint_is_finished_by_the_rerun(tmp_path, monkeypatch, straight, phase):
  workdir = str(tmp_path)
  with monkeypatch.context() as m:
    if phase == "final evaluation":
      _kill_on(m, loop, "evaluate")
    else:  # After the eval row is written, before summary.json.
      _kill_on(m, train.MetricsLog, "close")
    with pytest.raises(Killed):
      train.train(tiny_config(steps=STEPS), workdir)
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(STEPS)))

  train.train(tiny_config(steps=STEPS), workdir)
  summary, eval_rows = straight
  assert _summary(workdir) == summary
  assert [{k: v for k, v in r.items() if k != "time"} for r in _eval_rows(workdir)] == [
    {k: v for k, v in r.items() if k != "time"} for r in eval_rows
  ]  # One eval row, the same.
  train.train(tiny_config(steps=STEPS), workdir)  # Now complete: nothing to do.
  assert _summary(workdir) == summary


def _signal_during_evaluation(monkeypatch, signum, which):
  calls = []
  real = loop.evaluate

  def evaluate(*args):
    calls.append(1)
    if len(calls) == which:
      os.kill(os.getpid(), signum)  # Our handler notes it; the evaluation goes on.
    return real(*args)

  monkeypatch.setattr(loop, "evaluate", evaluate)


def test_a_signal_during_the_final_evaluation_finishes_the_run(tmp_path, monkeypatch, straight, capsys):
  _signal_during_evaluation(monkeypatch, signal.SIGTERM, which=1)
  before = signal.getsignal(signal.SIGTERM)
  summary = train.train(tiny_config(steps=STEPS), str(tmp_path))
  assert summary["preempted_by"] == "SIGTERM"
  assert {k: v for k, v in _summary(tmp_path).items() if k != "preempted_by"} == {
    k: v for k, v in straight[0].items() if k != "preempted_by"
  }
  assert "SIGTERM received at the end of training: the run finished anyway" in capsys.readouterr().out
  assert signal.getsignal(signal.SIGTERM) == before  # Restored when train() returns.


def test_a_signal_during_an_evaluation_saves_at_the_next_step(tmp_path, monkeypatch, capsys):
  _signal_during_evaluation(monkeypatch, signal.SIGINT, which=1)
  summary = train.train(tiny_config(steps=6, eval_every=2), str(tmp_path))
  assert summary["final_step"] == 3 and summary["preempted_by"] == "SIGINT"
  assert "preempted (SIGINT): saved checkpoint 3" in capsys.readouterr().out
  assert os.path.isdir(os.path.join(tmp_path, "checkpoints", "3"))


def test_rows_count_whole_windows_and_throughput_excludes_evaluation(tmp_path, monkeypatch):
  real = loop.evaluate
  monkeypatch.setattr(loop, "evaluate", lambda *a: (time.sleep(1.0), real(*a))[1])
  config = tiny_config(steps=6, log_every=3, eval_every=3, **{"checkpoint.every": 3})
  summary = train.train(config, str(tmp_path))
  rows = [r for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "loss" in r]
  assert [r["valid_examples"] for r in rows] == [3 * 16, 3 * 16]  # Every step of the window.
  assert [r["valid_tokens"] for r in rows] == [3 * 16 * 16, 3 * 16 * 16]
  # The evaluation at step 3 (1 s) counts in neither window's training time.
  assert all(r["step_time_s"] < 0.25 for r in rows), rows
  process = [r for r in read_jsonl(os.path.join(tmp_path, "processes", "process_0.jsonl")) if "steps" in r]
  assert process[0]["checkpoint_block_s"] > 0  # The save at step 3 is in step 3's own row.
  assert summary["tokens_trained_this_run"] == 6 * 16 * 16


def _events(path):
  """TensorBoard event records of one file (TFRecord framing), parsed with tensorboardX's protos."""
  from tensorboardX.proto import event_pb2

  events, data = [], open(path, "rb").read()
  while data:
    (n,) = struct.unpack("<Q", data[:8])
    events.append(event_pb2.Event.FromString(data[12 : 12 + n]))
    data = data[12 + n + 4 :]
  return events


def test_a_resume_purges_tensorboard_and_names_stale_process_files(tmp_path, capsys):
  workdir = str(tmp_path)
  train.train(tiny_config(steps=STEPS), workdir, stop_after=2)
  with open(os.path.join(workdir, "processes", "process_3.jsonl"), "w") as f:
    f.write('{"step": 1}\n')  # As a run with 4 processes would have left it.
  train.train(tiny_config(steps=STEPS), workdir)
  files = sorted(os.listdir(os.path.join(workdir, "tensorboard")))
  assert len(files) == 2
  starts = [
    e.step for e in _events(os.path.join(workdir, "tensorboard", files[1])) if e.HasField("session_log")
  ]
  assert starts == [3]  # purge_step: TensorBoard hides the first run's events from step 3 on.
  assert "files of processes [3] are from an earlier run with more processes" in capsys.readouterr().out
  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert [(r["step"], r["processes"]) for r in rows if r.get("event") == "start"] == [(0, 1), (2, 1)]
  assert _summary(workdir)["processes"] == 1


def test_truncate_keeps_rows_up_to_the_step_and_drops_a_redone_eval_row(tmp_path):
  path = str(tmp_path / "m.jsonl")
  rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}, {"step": 2, "eval_loss": 1.1}, {"step": 3}]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  metrics.truncate_jsonl(path, after_step=2, drop_eval_at=2)
  assert read_jsonl(path) == rows[:2]
