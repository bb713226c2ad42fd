"""Real multi-process jobs on 127.0.0.1 that go wrong: a stalled process (SIGSTOP), processes started
with different configs, a process stuck in a read (a killed one, restarted: tests/test_chaos.py).
Every job must end by itself, non-zero, with a report: never hang. (A hybrid DCN x ICI mesh that
matches one process: tests/test_local_launcher_main.py.)"""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from launch.local import free_port
from tests.conftest import REPO, TINY_FLAGS, train_losses

pytestmark = pytest.mark.slow

LAUNCHER = os.path.join(REPO, "launch", "local.py")
STEP_TIMEOUT_S = 4  # Below JAX's heartbeat timeout (40 s here): the watchdog reports first, with stacks.
LONG = [
  *TINY_FLAGS,
  "--config.steps=100000",
  "--config.checkpoint.every=100000",
  f"--config.watchdog.step_timeout_s={STEP_TIMEOUT_S}",
]


def _launch(workdir, *flags):
  env = {**os.environ, "JAX_HEARTBEAT_TIMEOUT_S": "40"}
  return subprocess.Popen(
    [sys.executable, LAUNCHER, "--processes=2", "--cpu_devices=4", "--grace_s=5", "--"]
    + [f"--workdir={workdir}", *flags],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
  )


def _child(launcher, process_id):
  for proc in psutil.Process(launcher.pid).children(recursive=True):
    try:
      if f"--process_id={process_id}" in proc.cmdline():
        return proc
    except psutil.NoSuchProcess:
      pass
  raise AssertionError(f"no process {process_id}")


def _wait_for_steps(workdir, launcher, n, timeout=120):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if os.path.exists(os.path.join(workdir, "metrics.jsonl")) and len(train_losses(workdir)) >= n:
      return
    assert launcher.poll() is None, launcher.stdout.read()
    time.sleep(0.1)
  raise AssertionError("training did not start")


def _cleanup(launcher):
  for proc in psutil.Process(launcher.pid).children(recursive=True) if launcher.poll() is None else []:
    try:
      proc.send_signal(signal.SIGCONT)
      proc.kill()
    except psutil.NoSuchProcess:
      pass
  if launcher.poll() is None:
    launcher.kill()
  launcher.wait(timeout=30)


PEER_TIMEOUT_S = 4  # Below half of JAX's heartbeat timeout (40 s here): our report comes first.


def test_a_stalled_process_is_named_by_its_peer_in_one_line_whatever_the_phase_budget(tmp_path):
  """SIGSTOP on process 1, with the default 300 s step budget: process 0 stops hearing from it and
  says so in one line within the peer timeout, its stacks in a file, not on the console; exit 3."""
  flags = [*TINY_FLAGS, "--config.steps=100000", f"--config.watchdog.peer_timeout_s={PEER_TIMEOUT_S}"]
  launcher = _launch(tmp_path, *flags)
  try:
    _wait_for_steps(str(tmp_path), launcher, 3)
    stalled = _child(launcher, 1)
    step = max(train_losses(str(tmp_path)))
    stalled.send_signal(signal.SIGSTOP)
    t0 = time.time()
    out, _ = launcher.communicate(timeout=PEER_TIMEOUT_S + 30)
    took = time.time() - t0
  finally:
    _cleanup(launcher)
  assert launcher.returncode == 3, out
  assert PEER_TIMEOUT_S <= took <= PEER_TIMEOUT_S + 15, (took, out)
  lost = re.search(
    r"\[p0\] error: process 0 lost contact with process 1 \(silent for \d+ s\) while in \w+ at step (\d+)",
    out,
  )
  assert lost, out
  assert step <= int(lost.group(1)) <= step + 3
  assert "Thread 0x" not in out and "Check failure" not in out, out  # No stack on the console,
  with open(tmp_path / "crashes" / "process_0.txt") as f:
    assert "(most recent call first)" in f.read()  # but in the workdir.


def test_processes_with_different_configs_stop_before_training(tmp_path):
  port = free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, "main.py", "--cpu_devices=4", f"--coordinator_address=127.0.0.1:{port}"]
      + [
        "--num_processes=2",
        f"--process_id={i}",
        f"--workdir={tmp_path}",
        *TINY_FLAGS,
        f"--config.steps={5 + i}",
      ],
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={**os.environ, "JAX_HEARTBEAT_TIMEOUT_S": "10", "JAX_INIT_TIMEOUT_S": "60"},
    )
    for i in range(2)
  ]
  try:
    outs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, out in zip(procs, outs, strict=True):
    assert p.returncode != 0, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out  # Exactly one, on every process.
    assert (
      "disagree on config.steps: 5 here, 6 there" in errors[0] or "config.steps: 6 here, 5 there" in errors[0]
    ), out
    assert "step 1/" not in out
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


def test_a_process_stuck_in_a_read_is_named_though_its_watchdog_thread_reports(tmp_path):
  # Process 1's main thread blocks in its wait for global batch 4 (a sleep: the GIL is released, its
  # watchdog thread goes on reporting); process 0 waits for it in the step's collectives.
  launcher = subprocess.Popen(
    [sys.executable, LAUNCHER, "--processes=2", "--cpu_devices=4", "--grace_s=5"]
    + ["--main=tests/main_with_pauses.py", "--", "read=600@4/p1", f"--workdir={tmp_path}", *LONG],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env={**os.environ, "JAX_HEARTBEAT_TIMEOUT_S": "40"},
  )
  try:
    out, _ = launcher.communicate(timeout=STEP_TIMEOUT_S + 90)
  finally:
    _cleanup(launcher)
  assert launcher.returncode != 0, out
  # Whichever watchdog fires first (both deadlines pass within milliseconds) names process 1.
  assert re.search(r"\[p[01]\] watchdog: suspect process 1: furthest behind \((this )?process", out), out
  assert "in data at step 5" in out, out
