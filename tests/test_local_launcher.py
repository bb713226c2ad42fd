"""launch/local.py: P real processes joined by jax.distributed on 127.0.0.1.

These tests run the launcher on a stub program (prefixes, arguments, exit codes, signals, chatter);
tests/test_local_launcher_main.py runs main.py in several processes.
"""

import json
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

from tests.conftest import REPO

LAUNCHER = os.path.join(REPO, "launch", "local.py")


# Lines the libraries print in a 2-process main.py run (copied from one), which the launcher drops.
CHATTER = [
  "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
  # Two of Gloo's lines, printed at once by two threads of one process.
  "[Gloo] Rank [Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
  "3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
  "[Gloo] Rank 1[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
  "[Gloo] Rank 1 is connected to [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected "
  "peer ranks is : 1",
  "1",  # The end of a Gloo line another thread's landed in front of (seen on its own in a 2-process run).
  "W1201 11:55:48.708585   12918 preemption_notifier.cc:90] SIGTERM caught at 2026-12-01T11:55:48.7085+00:00",
  "",
  "  ",
]

# Stands in for main.py: `--act_I=...` says what process I does.
STUB = f"CHATTER = {CHATTER!r}\n" + textwrap.dedent(
  """
  import os, signal, sys, time
  flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
  me = flags["process_id"]
  act = flags.get(f"act_{me}", "ok")
  if act == "chatty":  # The libraries' lines, between two of its own, on both streams.
    for stream in (sys.stdout, sys.stderr):
      for line in ["before", *CHATTER, "step 5" + CHATTER[0], "after"]:
        print(line, file=stream, flush=True)
  print("argv", *sys.argv[1:])
  print("env", *(f"{k}={os.environ.get(k)}" for k in sorted(os.environ) if k.startswith("JAX_")))
  print(f"pid {os.getpid()}")
  print(f"hello from {me}")
  print(f"warning from {me}", file=sys.stderr, end="")  # No newline: the launcher adds one.
  sys.stderr.flush()
  if act.startswith("once"):  # Fails with code N in the first launch only (a restart has LAUNCH_RECOVERY).
    act = "ok" if os.environ.get("LAUNCH_RECOVERY") else "exit" + act[4:]
  if os.environ.get("LAUNCH_RECOVERY"):
    print("recovery", os.environ["LAUNCH_RECOVERY"])
  if act.startswith("exit"):
    time.sleep(0.5)
    sys.exit(int(act[4:]))
  if act == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  if act == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
  if act.startswith(("polite", "slow")):  # Stops on a signal (after 1 s when slow), exiting 0 or N.
    def bye(signum, frame):
      time.sleep(1 if act.startswith("slow") else 0)
      print(f"got {signal.Signals(signum).name}", flush=True)
      sys.exit(int(act.removeprefix("polite").removeprefix("slow") or 0))
    signal.signal(signal.SIGTERM, bye)
    signal.signal(signal.SIGINT, bye)
  if act not in ("ok", "chatty"):
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


class _Background:
  """The launcher running in the background, its output read as it comes (a full pipe would block
  it): stdout lines into `seen` (by `read_until`), stderr lines into `err`."""

  def __init__(self, args, tag: str):
    self.tag = tag
    self.proc = subprocess.Popen(
      [sys.executable, LAUNCHER, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    self.lines, self.seen, self.err = queue.Queue(), [], []
    self.readers = [
      threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True),
      threading.Thread(target=self.err.extend, args=(self.proc.stderr,), daemon=True),
    ]
    for reader in self.readers:
      reader.start()

  def read_until(self, done, timeout: float) -> None:
    """Reads stdout lines until `done(self.seen)`."""
    deadline = time.monotonic() + timeout
    while not done(self.seen):
      self.seen.append(self.lines.get(timeout=max(0.1, deadline - time.monotonic())))

  def wait(self, timeout: float) -> int:
    """The launcher's exit code, once it and its output have ended."""
    code = self.proc.wait(timeout=timeout)
    for reader in self.readers:
      reader.join(timeout=5)
    while not self.lines.empty():
      self.seen.append(self.lines.get())
    return code

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.proc.poll() is None:
      self.proc.kill()  # Its processes die with it (PR_SET_PDEATHSIG).
      self.proc.wait(timeout=10)
    for pid in _processes_mentioning(self.tag):
      os.kill(pid, signal.SIGKILL)


def _signal_job(stub, acts, signals, grace_s=10.0, timeout=30):
  """Runs one stub process per act, sends the launcher `signals` (0.5 s apart) once every process is
  ready; returns the launcher's exit code, seconds from the first signal to its exit, its stdout
  lines and its stderr."""
  args = [f"--processes={len(acts)}", "--cpu_devices=1", f"--grace_s={grace_s}", f"--main={stub}", "--"]
  with _Background(args + [f"--act_{i}={act}" for i, act in enumerate(acts)], tag=stub) as job:
    job.read_until(lambda seen: sum(line.endswith("ready\n") for line in seen) == len(acts), timeout=30)
    t0 = time.monotonic()
    for k, sig in enumerate(signals):
      time.sleep(0.5 if k else 0)
      job.proc.send_signal(sig)
    code = job.wait(timeout)
    return code, time.monotonic() - t0, job.seen, "".join(job.err)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda sig: sig.name)
def test_a_signal_reaches_every_process_and_a_clean_stop_exits_0(stub, sig):
  code, _, seen, err = _signal_job(stub, ["polite", "polite"], [sig])
  assert code == 0, err  # main.py saved and stopped: nothing failed.
  assert f"[launch] got {sig.name}; passing it to every process" in err
  for i in range(2):
    assert f"[p{i}] got {sig.name}\n" in seen, seen


def test_after_a_signal_the_first_failing_process_sets_the_exit_code(stub):
  code, _, seen, err = _signal_job(stub, ["polite", "polite5"], [signal.SIGINT])
  assert code == 5, err
  assert "[launch] process 1 exited with code 5" in err
  assert "[p0] got SIGINT\n" in seen and "[p1] got SIGINT\n" in seen


def test_after_a_signal_the_launcher_exits_128_plus_n_only_when_it_kills(stub):
  # A process slower to stop than the others, within the grace period: nothing is killed.
  code, _, seen, err = _signal_job(stub, ["polite", "slow"], [signal.SIGINT], grace_s=30)
  assert code == 0, err
  assert "killing" not in err, err
  assert "[p1] got SIGINT\n" in seen, seen
  # One that never stops is killed after the grace period...
  code, elapsed, _, err = _signal_job(stub, ["polite", "deaf"], [signal.SIGINT], grace_s=1)
  assert code == 128 + signal.SIGINT, err
  assert "[launch] processes [1] still running 1 s later; killing them" in err
  assert elapsed < 10
  # ...or at once by a second signal.
  code, elapsed, _, err = _signal_job(stub, ["deaf", "polite"], [signal.SIGTERM] * 2, grace_s=60)
  assert code == 128 + signal.SIGTERM, err
  assert "[launch] second signal; killing every process" in err
  assert elapsed < 10


def test_library_chatter_is_dropped_unless_everything_is_asked_for(stub):
  def run(*launcher_flags, main_flags=()):
    flags = ["--processes=2", "--cpu_devices=1", *launcher_flags, f"--main={stub}", "--", "--act_1=chatty"]
    result = _launch(*flags, *main_flags, tag=stub)
    assert result.returncode == 0, result.stderr
    streams = _lines(result.stdout, "[p1] "), _lines(result.stderr, "[p1] ")
    return [out[out.index("before") : out.index("after") + 1] for out in streams]

  merged = "step 5" + CHATTER[0]  # Keeps its own text: the launcher cannot split what came merged.
  assert run() == [["before", merged, "after"]] * 2
  assert run("--verbose") == [["before", *CHATTER, merged, "after"]] * 2
  assert run(main_flags=["--verbosity=0"]) == [["before", *CHATTER, merged, "after"]] * 2


def test_a_failed_job_is_relaunched_and_a_user_error_or_the_restart_budget_ends_it(stub, tmp_path):
  flags = ["--processes=2", "--cpu_devices=1", "--restart_backoff_s=0", f"--main={stub}"]
  result = _launch(*flags, "--max_restarts=2", "--", "--act_1=once11", f"--workdir={tmp_path}", tag=stub)
  assert result.returncode == 0, result.stderr
  launch = _lines(result.stderr, "[launch] ")
  assert len(launch) == 2 and launch[0].startswith("process 1 exited with code 11"), launch
  assert (
    launch[1]
    == "restart 1/2: process 1 exited with code 11; resuming from the start (no persistent checkpoint yet) "
    "or a newer local copy in 0 s"
  )
  (recovery,) = {line for line in _lines(result.stdout, "[p0] recovery ")}
  info = json.loads(recovery)
  assert (
    info["restart"] == 1
    and info["process"] == 1
    and info["died_at"] <= info["ended_at"] <= info["relaunched_at"]
  )
  # A user error (2), running out of memory at restore (5) and a miscompiled step (6) never restart; a
  # failure past the budget gives up, saying so.
  for code, why in ((2, "a user error"), (5, "out of memory"), (6, "XLA partitioned the step wrongly")):
    result = _launch(*flags, "--max_restarts=2", "--", f"--act_1=exit{code}", tag=stub)
    assert result.returncode == code
    assert f"[launch] not restarting: process 1 exited with code {code} ({why}" in result.stderr
  result = _launch(*flags, "--max_restarts=1", "--", "--act_1=exit9", tag=stub)
  assert (
    result.returncode == 9
    and "[launch] giving up after 1 restarts: process 1 exited with code 9" in result.stderr
  )


def test_elastic_drops_a_slot_that_fails_twice_at_start_up(stub, tmp_path):
  flags = ["--processes=2", "--cpu_devices=1", "--restart_backoff_s=0", "--max_restarts=3", "--elastic"]
  result = _launch(*flags, f"--main={stub}", "--", "--act_1=exit1", f"--workdir={tmp_path}", tag=stub)
  assert result.returncode == 0, result.stderr
  restarts = [line for line in _lines(result.stderr, "[launch] ") if line.startswith("restart")]
  assert restarts == [
    "restart 1/3: process 1 exited with code 1; resuming from the start (no persistent checkpoint yet) "
    "or a newer local copy in 0 s",
    "restart 2/3: process 1 exited with code 1; slot 1 did not come back: continuing on 1 processes "
    "(renumbered); "
    "resuming from the start (no persistent checkpoint yet) or a newer local copy in 0 s",
  ]
  assert _lines(result.stdout, "[p1] hello from ") == ["1", "1"]  # Twice, then never again.


@pytest.mark.parametrize(
  "args, fragment",
  [
    (["--processes=0", "--cpu_devices=1"], "--processes=0"),
    (["--processes=2", "--cpu_devices=1", "--min_processes=3"], "--min_processes=3"),
    (["--processes=2"], "--cpu_devices"),
    (["--processes=2", "--cpu_devices=1", "--", "--process_id=1"], "--process_id is set by the launcher"),
  ],
)
def test_bad_launcher_arguments(args, fragment):
  result = _launch(*args, tag=None)  # Rejected before any process starts.
  assert result.returncode == 2
  assert fragment in result.stderr


def test_the_launchers_own_lines_go_out_in_one_write(monkeypatch):
  """Under PYTHONUNBUFFERED (stderr's text layer writes straight through to the file), print writes a
  line's text and its newline apart, and a child's line pumped in between merged with it
  ('...stopping [0][p0] error: ...')."""
  import io

  from launch import process_output

  writes = []

  class Fd(io.RawIOBase):
    def writable(self):
      return True

    def write(self, b):
      writes.append(bytes(b))
      return len(b)

  monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(Fd(), write_through=True))  # As under -u.
  process_output.log("process 1 exited with code 2; stopping [0]")
  assert writes == [b"[launch] process 1 exited with code 2; stopping [0]\n"]
