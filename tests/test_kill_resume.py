"""kill -9 inside the final save, SIGINT, and a second signal mid-save: the run resumes and its loss
trajectory, eval row and summary equal an uninterrupted run's exactly, with every
global batch trained exactly once."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, TINY_FLAGS, read_jsonl, valid_png

pytestmark = pytest.mark.slow

STEPS = 24
FLAGS = [
  *TINY_FLAGS,
  f"--config.steps={STEPS}",
  "--config.checkpoint.every=4",
  "--config.data.seq_len=64",
  "--config.model.embed_dim=64",
  "--config.model.num_layers=2",
]


def _start(workdir, pauses=None):
  main = ["tests/main_with_pauses.py", pauses] if pauses else ["main.py"]
  return subprocess.Popen(
    [sys.executable, *main, "--cpu_devices=8", *FLAGS, f"--workdir={workdir}"],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _rows(workdir):
  """Train rows; the file may be mid-rewrite (a resume truncates it) or end in a torn line."""
  path = os.path.join(workdir, "metrics.jsonl")
  try:
    return [r for r in read_jsonl(path) if "loss" in r]
  except (OSError, ValueError):
    return []


def _last_step(workdir):
  rows = _rows(workdir)
  return rows[-1]["step"] if rows else 0


def _wait_until(predicate, proc, timeout=120):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    if proc.poll() is not None:
      raise AssertionError(f"process ended early ({proc.returncode}):\n{proc.stdout.read()}")
    time.sleep(0.02)
  raise AssertionError("timed out")


def _partial_saves(workdir) -> set[tuple[str, int]]:
  """Partial step directories, with their inodes: a rerun that saves the same step again makes a new
  directory of the same name after removing the killed leg's."""
  found = set()
  for path in glob.glob(os.path.join(workdir, "checkpoints", "*.orbax-checkpoint-tmp*")):
    try:
      found.add((path, os.stat(path).st_ino))
    except FileNotFoundError:  # Removed (start-up clean-up, or renamed when complete) in between.
      pass
  return found


def _saving(workdir, not_these=frozenset()):
  """A save is in progress: a partial step directory other than `not_these` (a killed leg's)."""
  return bool(_partial_saves(workdir) - not_these)


def _finish(proc, timeout=180):
  try:
    out, _ = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("straight"))
  proc = _start(workdir)
  out = _finish(proc)
  assert proc.returncode == 0, out
  return _outcome(workdir)


def _outcome(workdir):
  """What the run trained and reported: losses by step, eval rows, summary (minus this run's timings)."""
  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = {
      k: v
      for k, v in json.load(f).items()
      if k
      not in (
        "wall_s",
        "compile_s",
        "startup_s",
        "tokens_trained_this_run",
        "goodput",
        "goodput_this_run",
        "tflops_per_device",
      )
    }
  evals = [{k: v for k, v in r.items() if k != "time"} for r in rows if "eval_loss" in r]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}, evals, summary


def _assert_exact_continuation(workdir, straight):
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # Nothing skipped or repeated.
  assert [r["batch"] for r in rows] == list(range(STEPS))  # Each global batch exactly once.
  losses, evals, summary = _outcome(workdir)
  assert losses == straight[0]  # Bitwise.
  assert evals == straight[1] and summary == straight[2]


def test_sigkill_in_the_final_save_resumes_exactly(tmp_path, straight):
  """Killed inside the final save, the rerun trains the last step again (from the local tier's copy of
  the step before) and ends as an uninterrupted run. (kill -9 at random moments, mid-step and
  mid-save, of a 2-process job: tests/test_chaos.py.)"""
  workdir = str(tmp_path)
  stale = frozenset(_partial_saves(workdir))
  proc = _start(workdir, pauses=f"save=60@{STEPS}")
  try:
    _wait_until(lambda: _saving(workdir, stale) and _last_step(workdir) == STEPS, proc)
    proc.send_signal(signal.SIGKILL)
  finally:
    _finish(proc)
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  proc = _start(workdir)
  out = _finish(proc)
  assert proc.returncode == 0, out
  # The last step is never a local copy (the persistent save stands for it): the step before it is.
  assert f"restored step {STEPS - 1} from the local tier: process 0 from its own copy" in out, out
  assert not _saving(workdir)  # The killed save's partial directory was cleaned, never restored.
  _assert_exact_continuation(workdir, straight)
  # The time from the copy's save to the rerun's start was lost (the killed save, the downtime); the
  # whole training's categories add up to its wall time, as the rerun's add up to its own.
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  split, this_run = summary["goodput"], summary["goodput_this_run"]
  assert split["lost_to_restarts"] > 0 and this_run["lost_to_restarts"] == 0, split
  assert split["productive_steps"] > this_run["productive_steps"] > 0, (split, this_run)
  for s in (split, this_run):
    assert abs(s["unaccounted_s"]) <= 0.02 * s["wall_s"], s
  # The plots of a resumed run (its restart marked).
  from trainer.observe import report

  written = report.main([f"--workdir={workdir}"])
  assert sorted(os.path.basename(p) for p in written) == [
    "goodput.png",
    "loss.png",
    "step_time.png",
    "throughput.png",
  ]
  assert all(valid_png(p) for p in written)


def test_sigint_saves_and_exits_zero_and_a_second_signal_mid_save_is_harmless(tmp_path, straight):
  workdir = str(tmp_path)
  proc = _start(workdir, pauses="save=2")
  try:
    _wait_until(lambda: len(_rows(workdir)) >= 6, proc)
    proc.send_signal(signal.SIGINT)  # Ctrl-C mid-step: the same path as a preemption.
    _wait_until(lambda: _saving(workdir) and len(_rows(workdir)) > 6, proc, timeout=60)
    proc.send_signal(signal.SIGTERM)  # While the preemption save is being written.
  finally:
    out = _finish(proc, timeout=60)
  assert proc.returncode == 0, out
  stopped = [line for line in out.splitlines() if line.startswith("preempted (SIGINT): saved checkpoint")]
  assert len(stopped) == 1, out
  step = int(stopped[0].split("checkpoint ")[1].split(";")[0])
  assert step < STEPS and os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))

  proc = _start(workdir)
  out = _finish(proc)
  assert proc.returncode == 0 and f"resumed from checkpoint {step}" in out, out
  _assert_exact_continuation(workdir, straight)
