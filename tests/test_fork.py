"""The fork command copies an experiment and its config into a copy of the repository; the new
experiment trains 2 steps there, and nothing else in the copy changed."""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

# Verify of the ViT it copies: tests/test_configs.py (the same code under another name).
CHECK = """
import runpy
from trainer.train import train
cfg = runpy.run_path("configs/mine.py")["get_config"]("tiny")
assert cfg.experiment == "mine", cfg.experiment
summary = train(cfg, "runs/mine")
assert summary["final_step"] == 2, summary
print("trained mine")
"""


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

  result = run(sys.executable, "-m", "experiments.new", "mine", "--from=vit")
  assert result.returncode == 0, result.stderr
  assert "configs/mine.py:tiny" in result.stdout
  after = _files(copy)
  assert set(after) - set(before) == {"experiments/mine.py", "experiments/mine_keys.py", "configs/mine.py"}
  assert {k: after[k] for k in before} == before  # The trainer and the other experiments are untouched.
  with open(copy / "configs" / "mine.py") as f:
    text = f.read()
  assert 'base.get_config("mine")' in text and "--config=configs/mine.py" in text
  # The ViT's measured figures stay with the ViT: the fork's recipe is to fill in.
  assert "Expect: (fill in once measured" in text and "0.89" not in text and "measured)" not in text

  result = run(sys.executable, "-c", CHECK)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "trained mine" in result.stdout

  again = run(sys.executable, "-m", "experiments.new", "mine", "--from=lm")
  assert again.returncode == 2 and again.stderr.startswith("error: experiments/mine.py exists already")
