"""trainer/hooks.py: an experiment's periodic work, run on its cadence with the state, written to
metrics.jsonl and TensorBoard, booked by the clock; a hook that raises ends the run with one line and
exit 8, after its step is saved, on every process."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import exit_codes
from errors import UserError
from experiments import lm
from tests import main_with_hooks
from tests.conftest import REPO, TINY_FLAGS, patch_experiment, read_jsonl, tiny_config
from trainer import components, hooks
from trainer import experiment as experiment_lib
from trainer.modes.export import load
from trainer.train import train


def _hook_rows(workdir):
  return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("event") == "hook"]


def test_hooks_run_on_their_cadence_with_the_state_and_write_rows_text_and_images(tmp_path, monkeypatch):
  seen = []

  def sample(ctx):
    model = ctx.model()  # The weights merged back into the model: run it, as a sampler would.
    logits = model(np.zeros((1, 4), np.int32))
    seen.append((ctx.step, logits.shape))
    ctx.writer.scalar("logit_mean", float(np.mean(logits)))
    ctx.writer.text("note", f"step {ctx.step}")

  def picture(ctx):
    ctx.writer.image("grid", np.linspace(0, 1, 12).reshape(3, 4))

  patch_experiment(
    monkeypatch,
    lm,
    hooks=lambda config: [
      hooks.Hook("sample", sample, every=2),
      hooks.Hook("picture", picture, every=3, on="process_0"),
      # By the clock, on logging steps: every step outlasts 1 ms, so each one after the first.
      hooks.Hook("clock", lambda ctx: ctx.writer.scalar("step", ctx.step), every_s=1e-3),
    ],
  )
  summary = train(tiny_config(log_every=2), str(tmp_path))
  assert [s for s, _ in seen] == [2, 4, 6] and seen[0][1] == (1, 4, 32)
  rows = _hook_rows(tmp_path)
  assert [(r["step"], r["hook"]) for r in rows] == [
    (2, "sample"),
    (3, "picture"),
    (4, "sample"),
    (4, "clock"),
    (6, "sample"),
    (6, "picture"),
    (6, "clock"),
  ]
  assert rows[0]["sample/note"] == "step 2" and isinstance(rows[0]["sample/logit_mean"], float)
  assert os.path.exists(tmp_path / rows[1]["picture/grid"])  # A PNG under WORKDIR/hooks/picture/.
  assert any(n.startswith("events") for n in os.listdir(tmp_path / "tensorboard"))
  assert summary["goodput"]["hooks"] > 0  # Booked as its own phase.


def test_a_hook_that_raises_names_itself_and_its_line_and_saves_its_step(tmp_path, monkeypatch):
  def broken(ctx):
    raise KeyError("no_such_metric")

  patch_experiment(monkeypatch, lm, hooks=lambda config: [hooks.Hook("broken", broken, every=3)])
  with pytest.raises(
    hooks.HookFailed,
    match=r"hook 'broken' raised at step 3: KeyError: 'no_such_metric' \(.*test_hooks.py:\d+\)",
  ) as e:
    train(tiny_config(), str(tmp_path))
  assert e.value.exit_code == exit_codes.HOOK_EXIT == 8
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]  # Step 3 saved though not on schedule.


def test_an_evaluator_reports_beside_eval_loss_and_one_that_raises_ends_the_run_saved(tmp_path, monkeypatch):
  calls = []

  def count(ctx):
    calls.append(ctx.step)
    return {"params": len(jax.tree.leaves(ctx.params)), "step": ctx.step}

  def broken(ctx):
    if ctx.step == 4:
      return [1.0]  # Not {metric: number}.
    return {}

  made = [hooks.Evaluator("count", count), hooks.Evaluator("broken", broken)]
  patch_experiment(monkeypatch, lm, evaluators=lambda config: made)
  with pytest.raises(
    hooks.HookFailed, match=r"evaluator 'broken' raised at step 4: TypeError: returned list"
  ):
    train(tiny_config(eval_every=2, steps=6, **{"checkpoint.every": 3}), str(tmp_path))
  rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_loss" in r]
  assert [(r["step"], r["eval_count_step"]) for r in rows] == [(2, 2.0)] and rows[0]["eval_count_params"] > 0
  assert calls == [2, 4] and sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "4"]


@pytest.mark.parametrize(
  "made, problem",
  [
    ([object()], "each must be a trainer.hooks.Evaluator"),
    ([hooks.Evaluator("a", print), hooks.Evaluator("a", print)], "'a' of .*: its name is used twice"),
    ([hooks.Evaluator("a-b", print)], "name it with a word"),
    ([hooks.Evaluator("a", print, on="rank0")], "on must be 'all' or 'process_0'"),
  ],
)
def test_a_malformed_evaluator_is_one_error(made, problem, monkeypatch):
  patch_experiment(monkeypatch, lm, evaluators=lambda config: made)
  with pytest.raises(UserError, match=problem):
    hooks.load_evaluators(experiment_lib.load("lm"), tiny_config())


def test_an_evaluator_named_like_the_emas_metrics_is_refused(monkeypatch):
  from trainer import evaluate

  patch_experiment(monkeypatch, lm, evaluators=lambda config: [hooks.Evaluator("ema", print)])
  config = tiny_config()
  with pytest.raises(UserError, match="'ema' of .*: its name is used twice"):
    evaluate.evaluators(components.build(config, with_data=False), config)


@pytest.mark.parametrize(
  "made, problem",
  [
    ([object()], "each must be a trainer.hooks.Hook"),
    ([hooks.Hook("a", print, every=1), hooks.Hook("a", print, every=2)], "'a' of .*: its name is used twice"),
    ([hooks.Hook("a", print, every=1, on="rank0")], "on must be 'all' or 'process_0'"),
    ([hooks.Hook("a", print)], "one of them > 0"),
  ],
)
def test_a_malformed_hook_is_one_error(made, problem, monkeypatch):
  patch_experiment(monkeypatch, lm, hooks=lambda config: made)
  with pytest.raises(UserError, match=problem):
    hooks.load(experiment_lib.load("lm"), tiny_config())


def test_two_processes_gather_for_process_0_and_stop_together_when_one_raises(tmp_path):
  """`gathered` sees the whole state on process 0; `boom` raises on process 1 at step 5: both processes
  save step 5 and exit 8, each with its line (process 1's even when it comes late). The evaluator
  `probe` scores token ids with the LM's task scorer on the weights as 2 processes hold them: what one
  device computes from checkpoint 4."""
  launcher = [
    sys.executable,
    "launch/local.py",
    "--processes=2",
    "--cpu_devices=4",
    "--main=tests/main_with_hooks.py",
  ]
  flags = [
    *TINY_FLAGS,
    "--config.steps=8",
    "--config.checkpoint.every=4",
    "--config.checkpoint.local_every=0",
    "--config.eval_every=2",
  ]
  # Process 1's line comes late, and its exit after saying it leaves: process 0, which hosts the
  # coordination service, must wait for both, or JAX aborts process 1 first ("Terminating process
  # because the JAX distributed service ...").
  env = {**os.environ, "ERROR_LINE_LATE_S": "1.5", "EXIT_LATE_S": "0.5"}
  result = subprocess.run(
    [*launcher, "--", *flags, f"--workdir={tmp_path}"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=240,
    env=env,
  )
  out = result.stdout + result.stderr
  assert result.returncode == exit_codes.HOOK_EXIT, out[-3000:]
  assert "Terminating process" not in out, out[-3000:]
  assert "error: hook 'boom' raised at step 5: RuntimeError: a bug in the fork's hook" in out
  assert "error: hook 'boom' raised on another process at step 5" in out
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "5"]
  [row] = _hook_rows(tmp_path)
  assert row["step"] == 4 and row["gathered/params_sq"] > 0
  evals = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_probe_ll0" in r}
  assert sorted(evals) == [2, 4]
  loaded = load(str(tmp_path), 4)
  model = components.build(loaded.config, with_data=False).mdef.merge(loaded.params, loaded.variables)
  one_device = main_with_hooks.probe(model, loaded.config.data.seq_len)
  assert evals[4]["eval_probe_tokens"] == one_device["tokens"]
  for k in ("ll0", "ll1"):
    assert evals[4][f"eval_probe_{k}"] == pytest.approx(one_device[k], rel=1e-5)
