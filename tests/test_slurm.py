"""launch/slurm/train.sbatch on a real single-node SLURM that the test starts (tests/slurm_cluster.py).

Two tasks of 4 logical CPU devices, submitted with sbatch, train like one process of 8; a second
submission resumes; the time-limit warning (USR1) makes the job save, requeue itself and resume.
Missing SLURM binaries are installed with apt-get (root only). Where SLURM cannot run, every test here
is skipped with the exact reason, which `-rs` / `-ra` prints in the summary: never a silent pass.
"""

import contextlib
import os
import re
import subprocess
import sys
import time

import pytest

from launch import gpu_flags
from launch.local import CHILD_ENV_DEFAULTS
from tests import slurm_cluster as local_cluster
from tests.conftest import REPO, TINY_FLAGS, read_jsonl, train_losses

SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")
CONFIG = next(f.split("=", 1)[1] for f in TINY_FLAGS if f.startswith("--config="))
CONFIG_FLAGS = [f for f in TINY_FLAGS if not f.startswith("--config=")]

pytestmark = [pytest.mark.slow, pytest.mark.needs_root]  # apt-get installs SLURM where it is missing.


def _skip_loudly(reason: str):
  message = f"SLURM unavailable, SLURM launcher NOT tested: {reason}"
  print(f"\n{'!' * 20} {message}", file=sys.stderr, flush=True)
  pytest.skip(message)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
  """The environment (SLURM_CONF) of a single-node cluster with 8 CPUs, stopped after the module."""
  if reason := local_cluster.install(timeout_s=300):
    _skip_loudly(reason)
  with contextlib.ExitStack() as stack:
    try:
      env = stack.enter_context(local_cluster.running(str(tmp_path_factory.mktemp("slurm")), cpus=8))
    except local_cluster.Unavailable as e:
      _skip_loudly(str(e))
    yield env


def _job_env(slurm_env, workdir):
  return {
    **slurm_env,
    **CHILD_ENV_DEFAULTS,  # Short jax.distributed timeouts: a broken job fails in seconds.
    "CONFIG": CONFIG,
    "WORKDIR": str(workdir),
    "VENV": sys.prefix,
    "CPU_DEVICES": "4",
  }


def _sbatch_argv(log, *extra):
  # Two tasks on the one node; no GPUs to ask for.
  return ["sbatch", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", f"--output={log}", *extra]


def _read(path) -> str:
  try:
    with open(path) as f:
      return f.read()
  except FileNotFoundError:
    return "(no output file)"


def _lines(text, prefix):
  """Lines of `text` that start with `prefix`, with the prefix removed."""
  return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def _submit_and_wait(slurm_env, workdir, log, *main_flags, timeout=150):
  """sbatch --wait; returns (exit code, the job's output so far)."""
  argv = [*_sbatch_argv(log, "--wait"), SBATCH, *CONFIG_FLAGS, *main_flags]
  env = _job_env(slurm_env, workdir)
  try:
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    pytest.fail(f"sbatch --wait took over {timeout} s; job output:\n{_read(log)}")
  return r.returncode, r.stdout + r.stderr + _read(log)


def _single(workdir, *flags):
  """The reference: one process of 8 logical CPU devices, the same flags."""
  argv = [sys.executable, "main.py", "--cpu_devices=8", *TINY_FLAGS, f"--workdir={workdir}", *flags]
  r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)
  assert r.returncode == 0, r.stdout + r.stderr
  return r.stdout


def _assert_close(a: dict, b: dict, steps):
  for s in steps:
    assert abs(a[s] - b[s]) <= 1e-5 * abs(b[s]), (s, a[s], b[s])


def _train_steps(workdir):
  return [r["step"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]


def test_sbatch_trains_like_one_process(slurm, tmp_path):
  workdir, single = tmp_path / "run", tmp_path / "single"
  code, out = _submit_and_wait(slurm, workdir, tmp_path / "first.out", "--config.steps=4")
  assert code == 0, out
  assert "2 processes on 1 nodes" in out, out
  assert re.search(r"^0: .*step 4/4", out, re.M), out  # srun --label: process 0's line.
  assert _train_steps(workdir) == [1, 2, 3, 4]
  assert (workdir / "processes" / "process_0.jsonl").exists()
  assert (workdir / "processes" / "process_1.jsonl").exists()
  _single(single, "--config.steps=4")
  _assert_close(train_losses(str(workdir)), train_losses(str(single)), range(1, 5))
  # Resuming through SLURM: test_time_limit_warning_saves_requeues_and_resumes.


def _squeue(slurm_env, job: str, fmt: str) -> str:
  r = subprocess.run(
    ["squeue", "-h", "-j", job, "-o", fmt], env=slurm_env, capture_output=True, text=True, timeout=10
  )
  return r.stdout.strip()


def _sinfo_state(slurm_env) -> str:
  r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=slurm_env, capture_output=True, text=True, timeout=10)
  return r.stdout.strip()


def _wait_for(what, predicate, log, timeout):
  deadline = time.monotonic() + timeout
  while not (found := predicate()):
    if time.monotonic() > deadline:
      pytest.fail(f"no {what} within {timeout} s; job output:\n{_read(log)}")
    time.sleep(0.3)
  return found


def test_time_limit_warning_saves_requeues_and_resumes(slurm, tmp_path):
  workdir, log = tmp_path / "run", tmp_path / "job.out"
  # More steps than it will run: the job is interrupted, resumes, and is cancelled.
  argv = [*_sbatch_argv(log, "--parsable"), SBATCH, *CONFIG_FLAGS, "--config.steps=100000"]
  r = subprocess.run(argv, cwd=REPO, env=_job_env(slurm, workdir), capture_output=True, text=True, timeout=30)
  assert r.returncode == 0, r.stdout + r.stderr
  job = r.stdout.strip().split(";")[0]
  try:
    _wait_for("training step", lambda: re.search(r"^0: step \d+/", _read(log), re.M), log, timeout=90)
    # What SLURM sends near the time limit (--signal=B:USR1@120): to the batch shell only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True, timeout=10)
    saved = _wait_for(
      "checkpoint on preemption",
      lambda: re.search(r"preempted \(SIGTERM\): saved checkpoint (\d+)", _read(log)),
      log,
      60,
    )
    step = int(saved.group(1))
    # SLURM holds a requeued job for ~2 minutes; release it sooner, but not within the second the old
    # run was killed: slurmd rejects the job's credential if it is not newer than that ("revoked").
    _wait_for("requeued job", lambda: _squeue(slurm, job, "%T") == "PENDING", log, timeout=30)
    _wait_for("idle node", lambda: _sinfo_state(slurm) == "idle", log, timeout=30)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, check=True, timeout=10)
    _wait_for("resume", lambda: f"0: resumed from checkpoint {step}" in _read(log), log, timeout=90)
  finally:
    subprocess.run(["scancel", job], env=slurm, timeout=10)
  out = _read(log)
  assert "requeueing job" in out, out
  assert f"job {job} (restart 1)" in out, out
  assert os.path.isdir(workdir / "checkpoints" / str(step))


STUB_PYTHON = """#!/bin/bash
# Stands in for the venv's python: runs the script's own snippets (-c), prints what main.py would get.
if [[ "$1" == "-c" || "$1" == launch/* ]]; then exec {python} "$@"; fi
echo "argv $*"
env | grep -E '^(JAX_|XLA_|NCCL_|CUDA_VISIBLE_DEVICES=)' | sed 's/^/env /'
"""


@pytest.mark.parametrize(
  "tasks_per_node, cuda_visible, device_ids",
  [
    (1, None, ["0,1,2,3,4,5,6,7"]),  # One process per node drives every GPU of the node.
    (2, None, ["0", "1"]),  # One per GPU: each its own, numbered by SLURM_LOCALID.
    (2, "5", ["0", "0"]),  # SLURM bound one GPU to each task: it is GPU 0 of those it sees.
    (1, "0,1,2,3", ["0,1,2,3"]),  # Four GPUs listed by SLURM.
  ],
)
def test_gpu_mode_environment(slurm, tmp_path, tasks_per_node, cuda_visible, device_ids):
  """Without CPU_DEVICES: what each process of main.py gets (a stub stands in for python)."""
  venv, workdir, log = tmp_path / "venv", tmp_path / "run", tmp_path / "job.out"
  (venv / "bin").mkdir(parents=True)
  (venv / "bin" / "python").write_text(STUB_PYTHON.format(python=sys.executable))
  (venv / "bin" / "python").chmod(0o755)
  env = {**_job_env(slurm, workdir), "VENV": str(venv)}
  del env["CPU_DEVICES"]
  # The test session's own compilation cache (conftest) too: the script's default is what is checked.
  for key in (
    "XLA_FLAGS",
    "NCCL_DEBUG",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "JAX_LOCAL_DEVICE_IDS",
    "JAX_COMPILATION_CACHE_DIR",
  ):
    env.pop(key, None)
  if cuda_visible is not None:
    env["CUDA_VISIBLE_DEVICES"] = cuda_visible  # As SLURM's GPU plugin would set it.
  argv = ["sbatch", "--wait", "--nodes=1", f"--ntasks-per-node={tasks_per_node}", "--gpus-per-node=0"]
  argv += [f"--output={log}", SBATCH, "--config.steps=3"]
  r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  out = r.stdout + r.stderr + _read(log)
  assert r.returncode == 0, out
  for i, ids in enumerate(device_ids):
    assert _lines(out, f"{i}: argv ") == [f"main.py --config={CONFIG} --workdir={workdir} --config.steps=3"]
    got = dict(line.split("=", 1) for line in _lines(out, f"{i}: env "))
    assert got["JAX_LOCAL_DEVICE_IDS"] == ids, out
    assert got["JAX_PROCESS_ID"] == str(i)
    assert "JAX_COMPILATION_CACHE_DIR" not in got  # main.py's default: the user's cache, shared by runs.
    assert got["NCCL_DEBUG"] == "WARN"
    assert got["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"
    assert got["XLA_FLAGS"].split() == gpu_flags.xla_flags().split()
    if len(device_ids) > 1:
      assert got["JAX_NUM_PROCESSES"] == str(len(device_ids))
      assert re.fullmatch(r"127\.0\.0\.1:6\d{4}", got["JAX_COORDINATOR_ADDRESS"]), out
    else:  # One process runs alone: trainer/cluster/runtime.py joins no job.
      assert "JAX_NUM_PROCESSES" not in got and "JAX_COORDINATOR_ADDRESS" not in got, out
