"""SIGTERM and SIGINT at every phase of a run end it with one clear line and the documented exit code
(docs/concepts/checkpoints.md), never a traceback. The end of a run and evaluations are covered in-process
by tests/test_run_end.py; mid-step, and a second signal mid-save, by tests/test_kill_resume.py."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, TINY_FLAGS

pytestmark = pytest.mark.slow


def _start(workdir, pauses, *flags):
  return subprocess.Popen(
    [sys.executable, "tests/main_with_pauses.py", pauses, "--cpu_devices=8", *TINY_FLAGS]
    + [f"--workdir={workdir}", "--config.steps=50", *flags],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def _signal_at(proc, marker, signum):
  """Sends `signum` once the process prints `marker` (main_with_pauses.py's `pause: ...` line)."""
  deadline = time.time() + 120
  for line in proc.stdout:
    if line.startswith(marker):
      proc.send_signal(signum)
      break
    assert time.time() < deadline, "no pause"
  try:
    out, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  return out, err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_ends_with_one_line_and_128_plus_n(tmp_path, signum):
  proc = _start(tmp_path, "startup=60")
  out, err = _signal_at(proc, "pause: startup", signum)
  name = signal.Signals(signum).name
  assert proc.returncode == 128 + signum, err
  assert err.strip().splitlines()[-1] == f"interrupted during start-up ({name}): nothing to save", err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
  assert not os.path.exists(tmp_path / "checkpoints")


def test_a_signal_during_a_save_completes_it_saves_where_it_stops_and_exits_zero(tmp_path):
  proc = _start(tmp_path, "save=3@4")
  out, err = _signal_at(proc, "pause: save 4", signal.SIGTERM)
  assert proc.returncode == 0, err
  (line,) = [x for x in out.splitlines() if x.startswith("preempted (SIGTERM): saved checkpoint ")]
  stopped = int(line.split("checkpoint ")[1].split(";")[0])
  assert line.endswith("; run the same command to resume") and 4 < stopped < 50, out
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert 4 in saved and saved[-1] == stopped, saved  # The save in flight completed.
