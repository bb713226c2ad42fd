"""launch/local.py: P real processes joined by jax.distributed on 127.0.0.1.

The fast tests run the launcher on a stub program (prefixes, arguments, exit codes, signals); the
slow ones run main.py in two processes and compare with one process on the same 8-device mesh.
"""

import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.conftest import REPO, TINY_FLAGS, read_jsonl, train_losses

LAUNCHER = os.path.join(REPO, "launch", "local.py")


# Stands in for main.py: `--act_I=...` says what process I does.
STUB = textwrap.dedent(
  """
  import os, signal, sys, time
  flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
  me = flags["process_id"]
  print("argv", *sys.argv[1:])
  print("env", *(f"{k}={os.environ.get(k)}" for k in sorted(os.environ) if k.startswith("JAX_")))
  print(f"pid {os.getpid()}")
  print(f"hello from {me}")
  print(f"warning from {me}", file=sys.stderr, end="")  # No newline: the launcher adds one.
  sys.stderr.flush()
  act = flags.get(f"act_{me}", "ok")
  if act.startswith("exit"):
    time.sleep(0.5)
    sys.exit(int(act[4:]))
  if act == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  if act == "polite":
    def bye(signum, frame):
      print(f"got {signal.Signals(signum).name}", flush=True)
      sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    signal.signal(signal.SIGINT, bye)
  if act != "ok":
    print("ready", flush=True)
    time.sleep(120)
  """
)


@pytest.fixture
def stub(tmp_path):
  path = tmp_path / "stub.py"
  path.write_text(STUB)
  return str(path)


def _run(argv, tag: str | None, timeout: float, env=None):
  """Runs argv to completion; afterwards no process whose command line holds `tag` (a path unique
  to the test) is left."""
  try:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
  finally:
    # On a timeout subprocess.run kills the launcher; its processes die with it (PR_SET_PDEATHSIG),
    # and this catches any that did not.
    for pid in _processes_mentioning(tag) if tag else []:
      os.kill(pid, signal.SIGKILL)


def _launch(*args, tag: str | None, timeout=60, env=None):
  return _run([sys.executable, LAUNCHER, *args], tag, timeout, env)


def _lines(text, prefix):
  """Lines of `text` that start with `prefix`, with the prefix removed."""
  return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def _gone(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  return False


def _pids_of(result, n):
  pids = [int(_lines(result.stdout, f"[p{i}] pid ")[0]) for i in range(n)]
  assert len(pids) == n
  return pids


def _processes_mentioning(text: str) -> list[int]:
  """Live processes whose command line contains `text` (a test's unique temporary directory)."""
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit() and int(entry) != os.getpid():
      try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
          if text.encode() in f.read():
            found.append(int(entry))
      except OSError:
        pass  # Ended while we looked.
  return found


def test_prefixes_arguments_and_environment(stub):
  env = {**os.environ, "JAX_HEARTBEAT_TIMEOUT_S": "7"}  # A value already set is kept.
  result = _launch("--processes=3", "--cpu_devices=2", f"--main={stub}", "--", "--foo=bar", tag=stub, env=env)
  assert result.returncode == 0, result.stderr
  assert all(re.match(r"\[p[0-2]\] ", line) for line in result.stdout.splitlines()), result.stdout
  assert all(re.match(r"\[(p[0-2]|launch)\] ", line) for line in result.stderr.splitlines()), result.stderr
  ports = set()
  for i in range(3):
    assert _lines(result.stdout, f"[p{i}] hello from ") == [str(i)]
    assert _lines(result.stderr, f"[p{i}] warning from ") == [str(i)]
    (argv,) = _lines(result.stdout, f"[p{i}] argv ")
    coordinator, *rest = argv.split()
    assert rest == ["--num_processes=3", f"--process_id={i}", "--cpu_devices=2", "--foo=bar"]
    host, port = coordinator.removeprefix("--coordinator_address=").split(":")
    assert host == "127.0.0.1"
    ports.add(port)
    (child_env,) = _lines(result.stdout, f"[p{i}] env ")
    assert "JAX_INIT_TIMEOUT_S=60" in child_env.split()
    assert "JAX_HEARTBEAT_TIMEOUT_S=7" in child_env.split()
    assert f"JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:{port}" in child_env.split()
  assert len(ports) == 1


def test_one_failure_stops_the_others(stub):
  t0 = time.monotonic()
  result = _launch(
    "--processes=3", "--cpu_devices=1", f"--main={stub}", "--", "--act_0=sleep", "--act_1=exit3", tag=stub
  )
  assert result.returncode == 3, result.stderr
  assert time.monotonic() - t0 < 20  # Process 0 would sleep 120 s.
  assert "[launch] process 1 exited with code 3; stopping [0]" in result.stderr
  assert all(_gone(pid) for pid in _pids_of(result, 3))


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(stub):
  t0 = time.monotonic()
  result = _launch(
    "--processes=2",
    "--cpu_devices=1",
    "--grace_s=1",
    f"--main={stub}",
    "--",
    "--act_0=stubborn",
    "--act_1=exit4",
    tag=stub,
  )
  assert result.returncode == 4, result.stderr
  assert time.monotonic() - t0 < 20
  assert "killing them" in result.stderr
  assert all(_gone(pid) for pid in _pids_of(result, 2))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_passed_on_to_every_process(stub, sig):
  launcher = subprocess.Popen(
    [sys.executable, LAUNCHER, "--processes=2", "--cpu_devices=1", f"--main={stub}", "--"]
    + ["--act_0=polite", "--act_1=polite"],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in launcher.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + 30
    while sum(line.endswith("ready\n") for line in seen) < 2:
      seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
    launcher.send_signal(sig)
    assert launcher.wait(timeout=20) == 128 + sig
    launcher.stdout.close()
    time.sleep(0.2)  # The reader thread drains what is left.
    while not lines.empty():
      seen.append(lines.get())
    for i in range(2):
      assert f"[p{i}] got {sig.name}\n" in seen, seen
  finally:
    if launcher.poll() is None:
      launcher.kill()  # Its processes die with it (PR_SET_PDEATHSIG).
      launcher.wait(timeout=10)
    for pid in _processes_mentioning(stub):
      os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
  "args, fragment",
  [
    (["--processes=0", "--cpu_devices=1"], "--processes=0"),
    (["--processes=2"], "--cpu_devices"),
    (["--processes=2", "--cpu_devices=1", "--", "--process_id=1"], "--process_id is set by the launcher"),
  ],
)
def test_bad_launcher_arguments(args, fragment):
  result = _launch(*args, tag=None)  # Rejected before any process starts.
  assert result.returncode == 2
  assert fragment in result.stderr


# --- main.py in two processes.


def _main_single(workdir, *flags):
  argv = [sys.executable, "main.py", "--cpu_devices=8", *TINY_FLAGS, f"--workdir={workdir}", *flags]
  return _run(argv, str(workdir), timeout=180)


def _main_two(workdir, *flags, launcher_flags=()):
  launcher = ["--processes=2", "--cpu_devices=4", *launcher_flags]
  return _launch(*launcher, "--", *TINY_FLAGS, f"--workdir={workdir}", *flags, tag=str(workdir), timeout=180)


def _assert_close(a: dict, b: dict, steps):
  for s in steps:
    assert abs(a[s] - b[s]) <= 1e-5 * abs(b[s]), (s, a[s], b[s])


@pytest.fixture(scope="module")
def five_steps(tmp_path_factory):
  """A 5-step run in two processes of 4 devices, and one in a single process of 8."""
  two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
  result = _main_two(two, "--config.steps=5")
  assert result.returncode == 0, result.stdout + result.stderr
  single = _main_single(one, "--config.steps=5")
  assert single.returncode == 0, single.stdout + single.stderr
  return two, one, result


@pytest.mark.slow
def test_two_processes_train_like_one(five_steps):
  two, one, result = five_steps
  assert all(line.startswith(("[p0] ", "[p1] ")) for line in result.stdout.splitlines()), result.stdout
  assert all(line.startswith(("[p0] ", "[p1] ", "[launch] ")) for line in result.stderr.splitlines())
  assert "[p0] step 5/5" in result.stdout
  assert (two / "processes" / "process_0.jsonl").exists()
  assert (two / "processes" / "process_1.jsonl").exists()
  _assert_close(train_losses(str(two)), train_losses(str(one)), range(1, 6))


@pytest.mark.slow
def test_two_processes_resume_like_one(five_steps):
  two, one, _ = five_steps
  result = _main_two(two, "--config.steps=7")
  assert result.returncode == 0, result.stdout + result.stderr
  assert "[p0] resumed from checkpoint 5" in result.stdout
  single = _main_single(one, "--config.steps=7")
  assert single.returncode == 0, single.stdout + single.stderr
  assert "resumed from checkpoint 5" in single.stdout
  # A fresh 7-step run has another learning-rate schedule; the single process resumed the same way.
  _assert_close(train_losses(str(two)), train_losses(str(one)), range(1, 8))


@pytest.mark.slow
def test_a_failing_process_ends_the_job(tmp_path):
  # Process 1 alone fails, after joining the job: its per-process log path is taken by a directory.
  (tmp_path / "processes" / "process_1.jsonl").mkdir(parents=True)
  t0 = time.monotonic()
  launcher = subprocess.Popen(
    [sys.executable, LAUNCHER, "--processes=2", "--cpu_devices=4", "--grace_s=3", "--"]
    + [*TINY_FLAGS, "--config.steps=5", f"--workdir={tmp_path}"],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    out, err = launcher.communicate(timeout=180)
    assert launcher.returncode == 2, out + err  # main.py's `error:` exit.
    assert "[p1] error: " in err and "process_1.jsonl: Is a directory" in err, err
    assert "[launch] process 1 exited with code 2" in err, err
    assert time.monotonic() - t0 < 90
    assert _processes_mentioning(str(tmp_path)) == []  # Checked before any clean-up of ours.
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait(timeout=10)
    for pid in _processes_mentioning(str(tmp_path)):
      os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_four_processes_train_like_one_and_resume_in_one_process(tmp_path):
  """4 processes x 2 devices match 1 x 8; the 4-process checkpoint resumes in 1 process, which then
  sees exactly the global batches the 4 processes would have seen (invariant 2, 3)."""
  four, one = tmp_path / "four", tmp_path / "one"
  result = _launch(
    "--processes=4",
    "--cpu_devices=2",
    "--",
    *TINY_FLAGS,
    "--config.steps=3",
    f"--workdir={four}",
    tag=str(four),
    timeout=180,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert "[p3] " in result.stdout + result.stderr
  assert _main_single(one, "--config.steps=3").returncode == 0
  _assert_close(train_losses(str(four)), train_losses(str(one)), range(1, 4))

  resumed = _main_single(four, "--config.steps=5")  # The 4-process run, continued by one process.
  assert resumed.returncode == 0 and "resumed from checkpoint 3" in resumed.stdout, resumed.stderr
  assert _main_single(one, "--config.steps=5").returncode == 0
  _assert_close(train_losses(str(four)), train_losses(str(one)), range(1, 6))
  assert [r["batch"] for r in read_jsonl(str(four / "metrics.jsonl")) if "loss" in r] == list(range(5))
