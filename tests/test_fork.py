"""The fork command copies an experiment and its config into a copy of the repository; nothing else
in the copy changes, and there `make check`'s tests of the new experiment (its pulse, its verify, the
contract's naming) pass, under a name that sorts before the template's own."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

# A fork named to sort before the template's own experiments: `make check`'s tests that walk every
# config and experiment (a pulse and verify of each) and the contract's, run in the copy.
NAME = "aaa_first"
CHECK = ["tests/test_configs.py", "tests/test_experiment_contract.py", "-k", f"{NAME} or named or missing"]


def _files(root):
  out = {}
  for d, dirs, names in os.walk(root):
    dirs[:] = [x for x in dirs if x not in (".git", ".venv", "__pycache__", "runs", "datasets")]
    for name in names:
      path = os.path.join(d, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
  return out


def test_fork_trains_and_verifies_and_touches_nothing_else(tmp_path):
  copy = tmp_path / "repo"
  ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "runs", "datasets", "*.egg-info")
  shutil.copytree(REPO, copy, ignore=ignore)
  before = _files(copy)
  run = lambda *argv: subprocess.run(argv, cwd=copy, capture_output=True, text=True, timeout=300)

  result = run(sys.executable, "-m", "experiments.new", NAME, "--from=vit")
  assert result.returncode == 0, result.stderr
  assert f"configs/{NAME}.py:tiny" in result.stdout
  after = _files(copy)
  new = {f"experiments/{NAME}.py", f"experiments/{NAME}_keys.py", f"configs/{NAME}.py"}
  assert set(after) - set(before) == new
  assert {k: after[k] for k in before} == before  # The trainer and the other experiments are untouched.
  with open(copy / "configs" / f"{NAME}.py") as f:
    text = f.read()
  assert f'base.get_config("{NAME}")' in text and f"--config=configs/{NAME}.py" in text
  # The ViT's measured figures stay with the ViT: the fork's recipe is to fill in.
  assert "Expect: (fill in once measured" in text and "0.89" not in text and "measured)" not in text

  result = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CHECK)
  assert result.returncode == 0, result.stdout + result.stderr
  ran = run(sys.executable, "-m", "pytest", "-q", "--collect-only", *CHECK)
  assert ran.stdout.count(NAME) >= 2, ran.stdout  # Its pulse and its verify were among them.

  again = run(sys.executable, "-m", "experiments.new", NAME, "--from=lm")
  assert again.returncode == 2 and again.stderr.startswith(f"error: experiments/{NAME}.py exists already")

  # Periodic work and an evaluator, in the fork's own file: they run on their cadence, nothing else changes.
  forked = _files(copy)
  with open(copy / "experiments" / f"{NAME}.py", "a") as f:
    f.write(HOOK)
  workdir = tmp_path / "hooked"
  trained = run(
    sys.executable, "main.py", f"--config=configs/{NAME}.py:tiny", f"--workdir={workdir}", "--cpu_devices=8"
  )
  assert trained.returncode == 0, trained.stderr
  assert {k for k, v in _files(copy).items() if forked.get(k) != v} == {f"experiments/{NAME}.py"}
  with open(workdir / "metrics.jsonl") as f:
    rows = [r for r in map(json.loads, f) if r.get("event") == "hook"]
  assert [r["step"] for r in rows] == [1, 2] and all(r["weights/norm"] > 0 for r in rows), rows
  with open(workdir / "summary.json") as f:
    summary = json.load(f)
  assert 0 < summary["eval_top_score_share_positive"] < 1 and "eval_loss" in summary, summary


HOOK = """

def hooks(config):
  import jax
  import numpy as np

  from trainer.hooks import Hook

  def weights_norm(ctx):
    squares = sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(ctx.params))
    ctx.writer.scalar("norm", squares**0.5)

  return [Hook("weights", weights_norm, every=1, on="process_0")]


def evaluators(config):
  import jax
  import jax.numpy as jnp

  from trainer.hooks import Evaluator

  def top_score(ctx):  # Evaluated like eval_loss: eval_top_score_share_positive.
    leaves = [jnp.ravel(x) for x in jax.tree.leaves(ctx.params)]
    return {"share_positive": float(jnp.mean(jnp.concatenate(leaves) > 0))}

  return [Evaluator("top_score", top_score)]


import dataclasses  # noqa: E402 - appended to the fork, as a user would.

EXPERIMENT = dataclasses.replace(EXPERIMENT, hooks=hooks, evaluators=evaluators)
"""
