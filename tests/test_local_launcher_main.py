"""launch/local.py running main.py in 2 and 4 processes: the same losses as one process on the same
8-device mesh (a hybrid one, a straggler and a profile window among them), and SIGINT. Resuming and
failing processes under restarts: tests/test_chaos.py; the launcher's own behaviour on a stub
program: tests/test_local_launcher.py."""

import os
import re
import signal
import sys

import pytest

from tests.conftest import TINY_FLAGS, read_jsonl, train_losses
from tests.test_local_launcher import _Background, _launch, _run


def _main_single(workdir, *flags):
  argv = [sys.executable, "main.py", "--cpu_devices=8", *TINY_FLAGS, f"--workdir={workdir}", *flags]
  return _run(argv, str(workdir), timeout=180)


def _main_two(workdir, *flags, launcher_flags=()):
  launcher = ["--processes=2", "--cpu_devices=4", *launcher_flags]
  return _launch(*launcher, "--", *TINY_FLAGS, f"--workdir={workdir}", *flags, tag=str(workdir), timeout=180)


def _assert_close(a: dict, b: dict, steps):
  for s in steps:
    assert abs(a[s] - b[s]) <= 1e-5 * abs(b[s]), (s, a[s], b[s])


PADDED = ["--config.data.num_examples=68"]


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory):
  """A 5-step run in two processes of 4 devices, and one in a single process of 8. 68 records: the
  last batch of the epoch (step 5) has 4 valid rows of 16, so one process's rows are all padding.
  The two processes' mesh is hybrid: its data axis runs across them (DCN), fsdp x tensor within each
  (ICI). Process 1 is slow to read each batch (a straggler), and steps 2..3 are profiled."""
  two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
  hybrid = ["--config.mesh.dcn_data=2", "--config.mesh.data=1"]
  profile = ["--config.profile.start_step=1", "--config.profile.steps=2"]
  pauses = {"launcher_flags": ["--main=tests/main_with_pauses.py"]}
  result = _main_two(two, "read=0.4/p1", "--config.steps=5", *hybrid, *profile, *PADDED, **pauses)
  assert result.returncode == 0, result.stdout + result.stderr
  single = _main_single(one, "--config.steps=5", *PADDED)
  assert single.returncode == 0, single.stdout + single.stderr
  return two, one, result


@pytest.mark.slow
def test_two_processes_train_like_one(five_steps):
  two, one, result = five_steps
  assert all(line.startswith(("[p0] ", "[p1] ")) for line in result.stdout.splitlines()), result.stdout
  assert all(line.startswith(("[p0] ", "[p1] ", "[launch] ")) for line in result.stderr.splitlines())
  assert "[p0] step 5/5" in result.stdout
  assert "mesh {'data': 2, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 2}" in result.stdout
  assert (two / "processes" / "process_0.jsonl").exists()
  assert (two / "processes" / "process_1.jsonl").exists()
  _assert_close(train_losses(str(two)), train_losses(str(one)), range(1, 6))
  for run in (two, one):  # The padded batch was reached.
    rows = [r for r in read_jsonl(str(run / "metrics.jsonl")) if "loss" in r]
    assert [r["valid_examples"] for r in rows] == [16, 16, 16, 16, 4]


@pytest.mark.slow
def test_the_slow_process_is_named_and_every_process_reports_its_profile(five_steps):
  two, _, result = five_steps
  # (Round trips on loopback under a loaded CI machine may come and go; the slow reader must be named.)
  named = [line for line in result.stdout.splitlines() if "straggler:" in line and "link round" not in line]
  assert [line.split(" s/step")[0][:-6] for line in named] == ["[p0] straggler: process 1's data wait is"], (
    named
  )
  rows = [r for r in read_jsonl(str(two / "metrics.jsonl")) if "loss" in r]
  assert any(r.get("stragglers") == [1] for r in rows) and not any(0 in r.get("stragglers", []) for r in rows)
  # One table on process 0's console, a line per process; each process's own split in its file.
  # Process 1's own lines (its pauses) may interleave with the table: read process 0's lines only.
  lines = result.stdout[result.stdout.index("[p0] profile of steps 2..3") :].splitlines()
  table = [line for line in lines if line.startswith("[p0] ")]
  assert table[2].split()[1] == "0" and table[3].split()[1] == "1", table[:5]
  for p in (0, 1):
    (profile,) = [
      r for r in read_jsonl(str(two / "processes" / f"process_{p}.jsonl")) if r.get("event") == "profile"
    ]
    # A trace, and each device's time in it split into compute, collectives, wait and idle, which add
    # up to the window's span.
    assert profile["steps"] == [2, 3] and os.path.exists(profile["trace"])
    assert len(profile["devices"]) == 4 and "logical CPU devices share" in profile["note"]
    for device in profile["devices"].values():
      assert device["compute_s"] > 0 and device["all-reduce_s"] > 0, device
      assert abs(sum(device.values()) - profile["span_s"]) <= 1e-3 * profile["span_s"] + 1e-6, device
    # The ops that took the most time, by their HLO names: within what the devices ran per step.
    ops = profile["top_ops"]
    assert 0 < len(ops) <= 8 and all(" " not in o["op"] and "%" not in o["op"] for o in ops), ops
    assert [o["s"] for o in ops] == sorted((o["s"] for o in ops), reverse=True), ops
    busy = sum(v for k, v in profile["mean"].items() if k != "idle_s")
    assert 0 < sum(o["s"] for o in ops) <= 2 * busy, (ops, profile["mean"])  # XLA:CPU may overlap ops.
  assert any(line.startswith("[p0] largest ops, process 0: ") for line in table), table


@pytest.mark.slow
def test_two_processes_stop_on_sigint_save_and_exit_0_without_library_chatter(tmp_path):
  args = [
    "--processes=2",
    "--cpu_devices=4",
    "--",
    *TINY_FLAGS,
    "--config.steps=1000",
    f"--workdir={tmp_path}",
  ]
  with _Background(args, tag=str(tmp_path)) as job:
    job.read_until(lambda seen: any(line.startswith("[p0] step 3/") for line in seen), timeout=150)
    job.proc.send_signal(signal.SIGINT)  # Training, past the first steps.
    assert job.wait(timeout=60) == 0, job.err
    out, err = job.seen, job.err
    assert any(re.match(r"\[p0\] preempted \(SIGINT\): saved checkpoint \d+", line) for line in out), out
    assert not [line for line in err if "SIGTERM caught" in line]  # JAX's, for the SIGINT turned SIGTERM.
    assert not [line for line in out + err if "[Gloo]" in line or line.strip() in ("[p0]", "[p1]")]


@pytest.mark.slow
def test_four_processes_train_like_one(five_steps, tmp_path):
  """4 processes x 2 devices match 1 x 8 (the fixture's), the padded batch included: with 4 valid rows
  of 16, three processes' rows are all padding (invariants 2, 3), with the recompute check on every
  other step (each process rotates its own two devices) finding nothing. Resuming on fewer
  processes: tests/test_chaos.py."""
  _, one, _ = five_steps
  four = tmp_path / "four"
  result = _launch(
    "--processes=4",
    "--cpu_devices=2",
    "--",
    *TINY_FLAGS,
    "--config.steps=5",
    "--config.checks.recompute_every=2",
    *PADDED,
    f"--workdir={four}",
    tag=str(four),
    timeout=180,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert (four / "processes" / "process_3.jsonl").exists()  # Process 3 trained (it prints nothing itself).
  _assert_close(train_losses(str(four)), train_losses(str(one)), range(1, 6))
  assert [r["batch"] for r in read_jsonl(str(four / "metrics.jsonl")) if "loss" in r] == list(range(5))
