"""trainer/cadence.py: one rule for everything periodic, and saves by the clock (checkpoint.every_s),
decided by process 0 a logging window ahead and read by every process through the coordination service."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY_FLAGS, tiny_config
from trainer.cadence import CopyCadence, CopyPolicy, itstime, slowdown, steps_per_copy
from trainer.train import train

TIMED = {"steps": 8, "log_every": 2, "checkpoint.every": 100, "checkpoint.keep": 10}


def _decisions(out: str) -> list[str]:
  """The local tier's lines that change how often it copies."""
  return [line for line in out.splitlines() if line.startswith("local tier: a copy") and "from step" in line]


def _saved(workdir) -> list[int]:
  return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")))


def test_itstime_is_every_n_steps_and_the_last_when_asked():
  assert [s for s in range(1, 11) if itstime(s, 4)] == [4, 8]
  assert [s for s in range(1, 11) if itstime(s, 4, 10, last=True)] == [4, 8, 10]
  assert [s for s in range(1, 11) if itstime(s, 0, 10, last=True)] == [10]  # 0: never, but the last.


def test_the_local_tier_copies_less_often_where_a_copy_takes_more_than_a_tenth_of_the_steps(capsys):
  assert steps_per_copy(1, copy_s=0.005, step_s=0.2) == 1  # A fortieth of a step: every step.
  assert steps_per_copy(1, copy_s=0.06, step_s=0.2) == 4  # A copy's work at most a tenth of 4 steps.
  assert steps_per_copy(4, copy_s=0.06, step_s=0.17) == 4  # 3.5 steps needed: no change in the band.
  assert steps_per_copy(16, copy_s=0.06, step_s=0.17) == 4  # A third of N or less: fewer steps.
  assert steps_per_copy(8, copy_s=0.001, step_s=0.17) == 1
  assert [s for s in range(1, 10) if CopyCadence(CopyPolicy.of(3), 4, 1).due(s)] == [
    3,
    6,
    9,
  ]  # local_every=3, always.
  assert not any(CopyCadence(CopyPolicy.of(0), 4, 1).due(s) for s in range(1, 10))  # Off.
  copies = CopyCadence(CopyPolicy.of(-1), log_every=4, timeout_s=1)
  copies.begin(0, 0)
  due, waited, window_s = [], 0.0, 0.0
  for step in range(1, 81):
    copy_s = 0.4 if step <= 70 else 0.005  # Then copies become cheap.
    window_s += max(0.1, copy_s / copies.every)  # Steps of 0.1 s, held to the pace of the copies...
    waited += max(0.0, copy_s / copies.every - 0.1)  # ... by the loop's waits for them.
    due += [step] if copies.due(step) else []
    if step % 4 == 0:
      copies.decide(step, copy_s=copy_s, step_s=window_s / 4, waited_s=waited)
      window_s = 0.0
  # A copy a logging window until one is measured. 0.4 s copies of 0.1 s steps: the waits taken out,
  # the first decision sees the steps' own 0.1 s and holds from the next logging step on, a window
  # later: 64 steps a copy (0.4 s is a tenth of 40 steps) from step 8, said once; copies of 5 ms are a
  # twentieth of a step: every step again.
  assert due == [4, 64, 76, 77, 78, 79, 80], due
  # Copies dear again: 64 steps a copy from step 88 on, and a window that a copy slowed to 0.2 s per
  # step (the copy's own cost in the loop) does not call for copies more often (32: a tenth of 20 steps).
  for step, window_s in ((84, 0.4), (88, 0.4), (92, 0.8), (96, 0.4), (100, 0.4)):
    copies.due(step)
    copies.decide(step, copy_s=0.4, step_s=window_s / 4, waited_s=waited)
  assert copies.due(104) is False and copies.every == 64
  lines = _decisions(capsys.readouterr().out)
  assert lines[2:] == [
    "local tier: a copy every 64 steps from step 88 (a copy's work 0.40 s, 0.100 s per step); "
    "a lost host costs up to 68 steps"  # A kill just before a copy is whole, 4 steps after its own.
  ], lines
  assert lines[:2] == [
    "local tier: a copy every 64 steps from step 8 (a copy's work 0.40 s, 0.100 s per step); "
    "a lost host costs up to 68 steps",
    "local tier: a copy every step from step 76 (a copy's work 0.01 s, 0.100 s per step); "
    "a lost host costs up to 2 steps",
  ], lines


def test_copies_that_slow_the_steps_without_a_wait_are_judged_by_the_steps_without_them(capsys):
  """A copy in pinned host memory holds up the next step for its transfers, which no wait of the loop's
  shows (a TPU v5e host: steps of 0.31 s ran at 1.62 s copied every step). Until a copy's work is
  measured the tier copies once a logging window, and the pace N is judged by is that of the windows
  without a copy in flight: 64 steps a copy (0.4 s is a tenth of 40 steps of 0.1 s), not 8."""
  copies = CopyCadence(CopyPolicy.of(-1), log_every=4, timeout_s=1)
  copies.begin(0, 0)
  assert capsys.readouterr().out == (
    "local tier: a copy every 4 steps until a line says otherwise; a lost host costs up to 8 steps\n"
  )
  busy, due = 0.0, []
  for step in range(1, 41):
    due += [step] if copies.due(step) else []
    if step % 4 == 0:
      copied = any(s in due for s in range(step - 4, step))  # In flight through the window.
      busy += 2.0 if copied else 0.0
      copies._window_s = lambda step, copied=copied: 2.0 if copied else 0.4
      work = 0.4 if step > 4 else 0.0  # The first copy is in flight at the first decision.
      copies.decide(step, copy_s=work, step_s=0.5 if copied else 0.1, waited_s=0.0, busy_s=busy, span_s=0.5)
  assert due == [4, 8] and copies.every == 64, due  # Windows a copy slowed to 0.5 s a step moved nothing.
  lines = _decisions(capsys.readouterr().out)
  assert lines == [
    "local tier: a copy every 64 steps from step 12 (a copy's work 0.40 s, 0.100 s per step); "
    "a lost host costs up to 69 steps"  # Copies whole 5 steps after their own (0.5 s in flight).
  ], lines
  CopyCadence(CopyPolicy.of(-1), log_every=1, timeout_s=1).begin(
    0, 0
  )  # Logging every step: a copy every step.
  assert capsys.readouterr().out == (
    "local tier: copies every step until a line says otherwise; a lost host costs up to 2 steps\n"
  )


def test_once_windows_with_and_without_a_copy_show_what_copies_cost_the_loop_the_cadence_goes_by_that(capsys):
  """Steps 1% slower beside a copy (a TPU host with slack, the transfers paced): N is the fewest steps
  whose copies cost the loop at most COST_SHARE and leave room for a copy's work, not ten copies' work."""
  assert slowdown([(0.0, 0.1), (0.0, 0.1), (1.0, 0.101)]) is None  # One window beside a copy: not yet.
  assert slowdown([(0.0, 0.1), (0.1, 0.1), (1.0, 0.101), (0.9, 0.101), (0.4, 0.5)]) == pytest.approx(
    0.001 / 0.9 / (0.1 - 0.001 / 0.9 * 0.05)  # Medians of each group; the window in between left out.
  )
  assert slowdown([(0.0, 0.1), (0.0, 0.1), (1.0, 0.09), (1.0, 0.09)]) == 0.0  # Faster: no cost.
  assert steps_per_copy(64, copy_s=0.4, step_s=0.1, slower=0.01, span_s=1.0) == 8  # Work's room: 5 steps.
  assert steps_per_copy(64, copy_s=0.4, step_s=0.1, slower=0.05, span_s=2.0) == 64  # 50 steps: in the band.
  assert steps_per_copy(64, copy_s=0.4, step_s=0.1, slower=0.2, span_s=2.0) == 256  # A host without slack.
  copies = CopyCadence(CopyPolicy.of(-1), log_every=4, timeout_s=1)
  copies.begin(0, 0)
  copies._window_s = lambda step: 0.4  # Windows of 4 steps of 0.1 s.
  busy, due = 0.0, []
  for step in range(1, 101):
    due += [step] if copies.due(step) else []
    if step % 4 == 0:
      beside = 0.4 if step % 16 == 0 else 0.0  # A copy in flight through every fourth window.
      busy += beside
      step_s = 0.101 if beside else 0.1
      copies.decide(step, copy_s=0.4, step_s=step_s, waited_s=0.0, busy_s=busy, span_s=1.0)
  lines = _decisions(capsys.readouterr().out)
  assert lines == [
    "local tier: a copy every 64 steps from step 8 (a copy's work 0.40 s, 0.100 s per step); "
    "a lost host costs up to 74 steps",  # Copies whole 10 steps after their own (1 s in flight).
    "local tier: a copy every 8 steps from step 52 (a copy's work 0.40 s, 0.100 s per step; steps 1.0% "
    "slower beside a copy in flight for 1.00 s); a lost host costs up to 16 steps",  # 2N at most.
  ], lines
  assert due[-3:] == [80, 88, 96] and copies.every == 8


def test_copies_that_leave_no_window_without_one_are_measured_in_a_window_left_without(capsys):
  """Copies every step, each a twentieth of a step's work, and steps 10% slower beside them (the ~107M
  model on CPU devices): no window is without a copy, so one in PROBE_AFTER + 1 is left without copies;
  two of them show the cost, and the tier copies every 4 steps (copies in flight 0.05 s cost 10% of
  that: under COST_SHARE of 4 steps)."""
  copies = CopyCadence(CopyPolicy.of(-1), log_every=4, timeout_s=1)
  copies.begin(0, 0)
  copies._window_s = lambda step: 0.4
  busy, due = 0.0, []
  for step in range(1, 161):
    due += [step] if copies.due(step) else []
    if step % 4 == 0:  # The window since the last logging step: the copies made at its steps.
      copied = any(s in due for s in range(step - 4, step))
      busy += 0.4 if copied else 0.0
      step_s = 0.11 if copied else 0.1
      copies.decide(step, copy_s=0.005, step_s=step_s, waited_s=0.0, busy_s=busy, span_s=0.05)
  probes = [72, 73, 74, 75, 144, 145, 146, 147]  # The first window's copy at step 4 is quiet too.
  assert [s for s in range(1, 152) if s not in due] == [1, 2, 3, 5, 6, 7, *probes]  # A copy a window first.
  assert due[-3:] == [152, 156, 160] and copies.every == 4
  out = capsys.readouterr().out.splitlines()
  probes = [line for line in out if line.startswith("local tier: no copies")]
  assert probes == [
    f"local tier: no copies in steps {s}-{s + 3}, a window that measures the steps without them; a lost "
    "host there costs up to 6 steps"
    for s in (72, 144)
  ], probes
  lines = _decisions("\n".join(out))
  assert lines == [
    "local tier: a copy every step from step 8 (a copy's work 0.01 s, 0.100 s per step); a lost host "
    "costs up to 2 steps",
    "local tier: a copy every 4 steps from step 152 (a copy's work 0.01 s, 0.100 s per step; steps 10.0% "
    "slower beside a copy in flight for 0.05 s); a lost host costs up to 5 steps",
  ], lines


def test_a_run_whose_copies_outlast_its_steps_copies_less_often_and_says_so(tmp_path):
  """The default cadence in a real run: each own copy held 1 s where a step takes a few hundredths,
  so after a window or two the tier copies every 2**k steps instead of setting the loop's pace."""
  flags = [*TINY_FLAGS, "--config.steps=24", "--config.log_every=2", "--config.checkpoint.every=100"]
  flags += ["--config.checkpoint.local_every=-1", f"--config.checkpoint.local_dir={tmp_path / 'local'}"]
  main = [sys.executable, "tests/main_with_pauses.py", "local=1", "--cpu_devices=8"]
  result = subprocess.run(
    main + flags + [f"--workdir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stdout + result.stderr
  said = "local tier: a copy every 2 steps until a line says otherwise; a lost host costs up to 4 steps\n"
  assert said in result.stdout, result.stdout
  said = _decisions(result.stdout)
  line = r"local tier: a copy every (\d+) steps from step \d+ \(a copy's work [\d.]+ s, [\d.]+ s per step\); "
  found = [re.fullmatch(line + r"a lost host costs up to (\d+) steps", s).groups() for s in said]
  every = [int(n) for n, _ in found]
  assert every and every[-1] >= 8, result.stdout  # Copies of 1 s, steps of 0.01-0.1 s.
  # A kill just before a copy is whole: N steps and those it was in flight, 2N at most.
  assert all(int(n) < int(lost) <= 2 * int(n) for n, lost in found), result.stdout
  copies = result.stdout.count("pause: local")
  assert copies <= 10, result.stdout  # Not 23: 1 to 3 every step, then fewer and fewer.


def test_a_run_slower_than_every_s_saves_at_each_logging_step_after_the_first(tmp_path):
  """Each step outlasts every_s: the first logging step was decided at the start (no save), each later
  one at the logging step before it (a save); by steps alone only the last step saves."""
  train(tiny_config(**TIMED, **{"checkpoint.every_s": 1e-3}), str(tmp_path / "timed"))
  assert _saved(tmp_path / "timed") == [4, 6, 8]
  train(tiny_config(**TIMED, **{"checkpoint.every_s": 3600.0}), str(tmp_path / "steps"))
  assert _saved(tmp_path / "steps") == [8]


def test_two_processes_agree_on_the_saves_by_process_0s_clock(tmp_path):
  """A save is a collective: had the processes decided differently, the job would hang, not finish."""
  launcher = [sys.executable, "launch/local.py", "--processes=2", "--cpu_devices=4", "--"]
  flags = [*TINY_FLAGS, *(f"--config.{k}={v}" for k, v in TIMED.items())]
  flags += ["--config.checkpoint.every_s=0.001", "--config.checkpoint.local_every=0"]
  result = subprocess.run(
    [*launcher, *flags, f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=240
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert _saved(tmp_path) == [4, 6, 8]
