"""The watchdog: who it names, and the budget of each phase (restore and compile apart from start-up;
evaluation mode watched too). The multi-process cases are in tests/test_multihost_failures.py."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_FLAGS, tiny_config
from trainer.cluster import watchdog
from trainer.observe.clock import PHASES
from trainer.train import train

NOW = 1000.0
ORDER = {name: i for i, name in enumerate(PHASES)}  # What the clock hands the watchdog.


def _report(phase, step, since_ago, reported_ago=0.5):
  return {"phase": phase, "step": step, "since": NOW - since_ago, "time": NOW - reported_ago}


def test_a_peer_whose_main_thread_is_stuck_is_named_though_its_thread_reports():
  mine = _report("step", 7, 20)  # Blocked in a collective, waiting for process 2.
  reports = {1: _report("step", 7, 20), 2: _report("data", 7, 21)}  # 2 waits for a read; thread alive.
  lines = watchdog.peer_lines(reports, 0, mine, NOW, ORDER)
  assert "watchdog: process 2 in data at step 7 for 21 s (last report 0 s ago)" in lines
  assert lines[-1].startswith("watchdog: suspect process 2: furthest behind")


def test_a_peer_that_stopped_reporting_is_named_and_equals_are_not_suspected():
  mine = _report("step", 7, 20)
  lines = watchdog.peer_lines({1: _report("step", 7, 20), 2: _report("step", 5, 60, 30)}, 0, mine, NOW, ORDER)
  assert lines[-1] == "watchdog: suspect process 2: it stopped reporting (stopped, wedged or dead)"
  lines = watchdog.peer_lines({1: _report("step", 7, 20)}, 0, mine, NOW, ORDER)
  assert not any("suspect" in line for line in lines)  # Nobody is behind: no guess.


def _main(workdir, pauses, *flags):
  return subprocess.run(
    [sys.executable, "tests/main_with_pauses.py", pauses, "--cpu_devices=8", *TINY_FLAGS]
    + [f"--workdir={workdir}", *flags],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=180,
  )


@pytest.mark.slow
def test_restore_has_its_own_budget_and_evaluation_mode_is_watched(tmp_path):
  train(tiny_config(steps=4), str(tmp_path), stop_after=2)
  # A restore slower than the start-up budget, within its own: the run resumes and finishes.
  slow_restore = _main(tmp_path, "restore=6", "--config.steps=4", "--config.watchdog.startup_timeout_s=4")
  assert slow_restore.returncode == 0, slow_restore.stderr
  assert "resumed from checkpoint 2" in slow_restore.stdout
  # --mode=eval whose evaluation hangs ends with the watchdog's report instead of hanging.
  hung = _main(
    tmp_path,
    "eval=60",
    "--mode=eval",
    "--config.watchdog.compile_timeout_s=2",
    "--config.watchdog.step_timeout_s=2",
  )
  assert hung.returncode == watchdog.EXIT_CODE, hung.stderr
  assert "watchdog: process 0 stuck in eval at step 4" in hung.stderr


def test_a_straggler_is_the_process_far_above_the_others_median():
  from trainer.observe import straggler

  w = lambda data, dispatch: {"step": 40, "data_s": data, "dispatch_s": dispatch}
  windows = {0: w(0.01, 0.02), 1: w(0.31, 0.33), 2: w(0.02, 0.03)}
  found = straggler.find(windows, factor=3.0, min_s=0.05)
  assert [(p, m) for p, m, *_ in found] == [(1, "data_s"), (1, "dispatch_s")]
  assert straggler.line(*found[0], factor=3.0) == (
    "straggler: process 1's data wait is 0.310 s/step against a median of 0.015 s/step on the other "
    "processes (window ending at step 40; straggler.factor=3)"
  )
  # Above the factor but within min_s is noise; two processes compare with each other; 0 is off.
  assert straggler.find({0: w(0.001, 0.001), 1: w(0.01, 0.01)}, 3.0, 0.05) == []
  assert [p for p, *_ in straggler.find({0: w(0.0, 0.0), 1: w(0.4, 0.4)}, 3.0, 0.05)] == [1, 1]
  assert straggler.find(windows, factor=0.0, min_s=0.0) == []
