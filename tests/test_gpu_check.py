"""benchmarks/gpu_check.sh: one line and exit 0 without a GPU; its checks run end to end at toy sizes
on CPU (`--allow_cpu`), so the script a GPU machine runs once is not first tried there."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_gpu_check_without_a_gpu_says_so_in_one_line():
  if shutil.which("nvidia-smi"):
    pytest.skip("this machine has nvidia-smi")
  r = subprocess.run(["benchmarks/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and r.stderr == "", r
  [line] = r.stdout.splitlines()
  assert line.startswith("gpu_check: no NVIDIA GPU"), line


@pytest.mark.slow
def test_gpu_check_runs_every_check_on_cpu_at_toy_sizes():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # Its own device count: one.
  r = subprocess.run(
    [sys.executable, "benchmarks/gpu_check.py", "--allow_cpu"],
    cwd=REPO,
    env={**env, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
  checks = [line.split("|")[1].strip() for line in table[1:]]
  expected = [
    "bf16_vs_fp32",
    "transfer",
    "checkpoint",
    "lm_125m",
    "memory",
    "recompute",
    "moe_dropless",
    "flash",
    "attention",
  ]
  assert checks == expected, table
  assert all(line.rstrip().endswith("| ok |") for line in table[1:]), table
  # The child without deterministic kernels ran (before the parent took the devices: a TPU has one owner).
  [recompute] = [line for line in table if line.startswith("| recompute |")]
  assert "; with XLA's defaults: " in recompute, recompute


def test_gpu_check_only_runs_the_checks_it_names_and_refuses_others():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = lambda only: subprocess.run(  # noqa: E731
    [sys.executable, "benchmarks/gpu_check.py", "--allow_cpu", f"--only={only}"],
    cwd=REPO,
    env={**env, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=120,
  )
  r = run("transfer")
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  assert [line.split("|")[1].strip() for line in r.stdout.splitlines() if line.startswith("| ")][1:] == [
    "transfer"
  ]
  r = run("transfer,memory")
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
    "error: --only=transfer,memory: no check memory; the checks: bf16_vs_fp32, transfer, checkpoint, "
    "lm_125m, recompute, moe_dropless, flash, attention"
  ], r.stderr
