"""The real training function runs a few steps of a tiny model on 8 logical CPU devices."""

import json
import math
import os

from tests.conftest import read_jsonl, tiny_config
from trainer.train import train


def test_train_writes_every_output_and_learns(tmp_path):
  workdir = str(tmp_path)
  summary = train(tiny_config(steps=8), workdir)

  for name in ("config.json", "metrics.jsonl", "summary.json", "processes/process_0.jsonl", "tensorboard"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["4", "6", "8"]  # keep=3

  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, 9))
  for key in ("time", "loss", "valid_examples", "learning_rate", "grad_norm", "step_time_s", "data_wait_s"):
    assert all(math.isfinite(r[key]) for r in rows), key
  assert rows[-1]["loss"] < rows[0]["loss"]
  assert rows[0]["valid_examples"] == 16 and rows[0]["valid_tokens"] == 16 * 16

  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == summary
  assert summary["final_step"] == 8
  assert summary["examples_seen"] == 8 * 16
  assert "logical CPU" in summary["devices"]
  assert math.isfinite(summary["eval_loss"]) and summary["loss_floor"] > 0

  # Where the time went: the categories, each measured where it is spent, sum to the wall time.
  split = summary["goodput"]
  assert abs(split["unaccounted_s"]) <= 0.02 * split["wall_s"], split
  assert split["productive_steps"] > 0 and split["compile"] > 0 and split["lost_to_restarts"] == 0
  assert 0 < split["goodput"] < 1
  # FLOPs: the LM's analytic count, and XLA's (which adds the optimizer and the softmax) beside it.
  assert 0.7 < summary["model_flops_per_step"] / summary["compiled_flops_per_step"] < 1.3, summary
  assert summary["mfu"] == "n/a (logical CPU)" and summary["tflops_per_device"] > 0
  assert all(r["tflops_per_device"] > 0 and "mfu" not in r for r in rows)


def test_finished_run_resumes_to_nothing_new(tmp_path):
  train(tiny_config(steps=3), str(tmp_path))
  summary = train(tiny_config(steps=3), str(tmp_path))
  assert summary["final_step"] == 3
  steps = [r["step"] for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "loss" in r]
  assert steps == [1, 2, 3]


def test_eval_mode_reevaluates_the_final_checkpoint_exactly(tmp_path):
  from trainer.evaluate import evaluate_checkpoint

  summary = train(tiny_config(steps=3), str(tmp_path))
  row = evaluate_checkpoint(tiny_config(steps=3), str(tmp_path))
  assert row["step"] == 3 and row["eval_loss"] == summary["eval_loss"]
  assert os.path.exists(os.path.join(tmp_path, "eval.json"))
