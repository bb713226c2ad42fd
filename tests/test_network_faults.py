"""Network faults between two real interfaces: a 2-process job whose processes sit in network
namespaces of their own (tests/netns.py, as separate hosts would), joined through a veth link that
the tests cut. A partition ends every process within the peer timeout with one line naming the
process it lost and its phase, exit 3 and no stack on the console; the launcher's restart then
continues bit for bit. A flap shorter than the peer timeout is survived, bit for bit, and so is a
job beside CPU hogs; where the host name does not resolve to the host's own address, Gloo is told the
interface. Among three hosts on one bridge, a link lost between two processes that both still reach
process 0 ends the job within the peer timeout, naming both ends (trainer/cluster/links.py)."""

import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests import netns
from tests.conftest import REPO, TINY_FLAGS, train_losses
from tests.netns import bridged_hosts, two_hosts
from trainer.cluster import liveness

pytestmark = [pytest.mark.slow, pytest.mark.needs_root]  # Network namespaces (tests/netns.py).

PEER_TIMEOUT_S = 4
STEPS = 14
READS = "read=0.3"  # tests/main_with_pauses.py: each batch takes 0.3 s to read, so faults land mid-run.
FLAGS = [
  *TINY_FLAGS,
  f"--config.steps={STEPS}",
  "--config.checkpoint.every=2",
  f"--config.watchdog.peer_timeout_s={PEER_TIMEOUT_S}",
]


class Launch:
  """launch/local.py over the two namespaces, its output read as it comes."""

  def __init__(self, hosts, workdir, *launcher_flags, pauses=READS, main_flags=(), cpu_devices=4):
    argv = [sys.executable, os.path.join(REPO, "launch", "local.py"), f"--processes={len(hosts.namespaces)}"]
    argv += [f"--cpu_devices={cpu_devices}"]
    argv += [f"--netns={','.join(hosts.namespaces)}", "--main=tests/main_with_pauses.py", *launcher_flags]
    argv += ["--", pauses, *FLAGS, *main_flags, f"--workdir={workdir}"]
    env = {**os.environ, "JAX_HEARTBEAT_TIMEOUT_S": "40"}
    self.proc = subprocess.Popen(
      argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    self.lines: list[tuple[float, str]] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append((time.time(), line.rstrip("\n")))

  def wait_for(self, pattern: str, timeout: float) -> float:
    """When a line matching `pattern` came."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      for at, line in list(self.lines):
        if re.search(pattern, line):
          return at
      assert self.proc.poll() is None or self._reader.is_alive(), self.output()
      time.sleep(0.05)
    raise AssertionError(f"no line {pattern!r} in {timeout} s:\n{self.output()}")

  def finish(self, timeout: float) -> int:
    try:
      self.proc.wait(timeout=timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
        self.proc.wait()
      self._reader.join(timeout=10)
    return self.proc.returncode

  def output(self) -> str:
    return "\n".join(line for _, line in self.lines)


@pytest.fixture(scope="module")
def hosts():
  with two_hosts() as h:
    yield h


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted run, on another pair of namespaces whose host name resolves to 127.0.0.1 (as a
  real host's may, to 127.0.1.1): Gloo would advertise loopback to its peer and the job would fail,
  so --cpu_collectives_interface names the interface whose address it advertises."""
  workdir = tmp_path_factory.mktemp("straight")
  with two_hosts(resolve_hostname=False, subnet=1) as other:
    run = Launch(other, workdir, main_flags=[f"--cpu_collectives_interface={netns.LINK}"])
    assert run.finish(timeout=180) == 0, run.output()
  return train_losses(str(workdir))


def test_a_link_flap_shorter_than_the_peer_timeout_is_survived_bit_for_bit(hosts, straight, tmp_path):
  # A 2 s flap under a 10 s timeout: after the heal, TCP's retransmission backoff and a loaded machine's
  # scheduling add seconds of silence (a flap of half a 4 s timeout was once counted as 5 s under xdist).
  run = Launch(hosts, tmp_path, main_flags=["--config.watchdog.peer_timeout_s=10"])
  try:
    run.wait_for(r"\[p0\] step 3/", timeout=120)
    hosts.cut()
    time.sleep(2)
  finally:
    hosts.heal()
  assert run.finish(timeout=180) == 0, run.output()
  assert "lost contact" not in run.output()
  assert train_losses(str(tmp_path)) == straight


def test_a_partition_mid_step_is_named_by_each_process_and_a_restart_continues_bit_for_bit(
  hosts, straight, tmp_path
):
  run = Launch(hosts, tmp_path, "--max_restarts=1", "--restart_backoff_s=2")
  try:
    run.wait_for(r"\[p0\] step 3/", timeout=120)
    hosts.cut()
    cut_at = time.time()
    lost_at = run.wait_for(r"lost contact with", timeout=PEER_TIMEOUT_S + 30)
    run.wait_for(r"\[launch\] restart 1/1: process \d exited with code 3", timeout=30)
  finally:
    hosts.heal()
  assert run.finish(timeout=180) == 0, run.output()
  out = run.output()
  # The peer's counter last moved up to one liveness period before the cut: silence is counted from
  # then (seen at 3.995 s after the cut in one clean-clone run).
  earliest = PEER_TIMEOUT_S - liveness.PERIOD_S
  assert earliest <= lost_at - cut_at <= PEER_TIMEOUT_S + 10, (lost_at - cut_at, out)
  named = re.findall(r"\[p(\d)\] error: process \d lost contact with (process \d)[^)]*\) while in (\w+)", out)
  assert named and all(peer != f"process {me}" for me, peer, _ in named), out
  assert {peer for _, peer, _ in named} <= {"process 0", "process 1"}
  assert "Thread 0x" not in out and "Check failure" not in out and "Traceback" not in out, out
  assert train_losses(str(tmp_path)) == straight


@pytest.mark.parametrize(
  "pause, landed, phase, kept",
  [
    # Orbax's write of checkpoint 6 hangs in process 0: the link goes mid-save. Orbax runs that write
    # on the loop's thread or on its own, run by run: the loop is then saving at step 6, or has gone on
    # to step 7 and waits there for process 1 (2 runs in 13 failed on "checkpoint" alone, before and
    # after issue 23). Either way checkpoint 6 is never committed.
    ("save=20@6/p0", r"\[p0\] pause: save", r"(checkpoint at step 6|(data|step) at step 7)", ["2", "4"]),
    # Process 1 is slow to build: process 0 waits for it at the start-up agreement (a barrier).
    ("startup=20/p1", r"\[p1\] pause: startup", "startup", []),
  ],
  ids=["mid_save", "at_the_startup_barrier"],
)
def test_a_partition_ends_both_processes_in_one_line_each_naming_the_other(
  hosts, tmp_path, pause, landed, phase, kept
):
  """No restarts: both processes notice on their own (the launcher gives them --grace_s), each names
  the other and its phase; a checkpoint being written when the link went is not committed, the
  earlier ones are whole and nothing is set aside."""
  run = Launch(hosts, tmp_path, "--grace_s=30", pauses=f"{READS},{pause}")
  try:
    run.wait_for(landed, timeout=120)
    hosts.cut()
    cut_at = time.time()
    code = run.finish(timeout=PEER_TIMEOUT_S + 40)
  finally:
    hosts.heal()
  out = run.output()
  assert code == 3, out
  assert time.time() - cut_at <= PEER_TIMEOUT_S + 20, out
  assert re.search(
    rf"\[p0\] error: process 0 lost contact with process 1 \(silent for \d+ s\) while in {phase}", out
  ), out
  assert re.search(
    r"\[p1\] error: process 1 lost contact with process 0, which runs the coordination", out
  ), out
  assert "Thread 0x" not in out and "Check failure" not in out, out
  names = os.listdir(tmp_path / "checkpoints") if (tmp_path / "checkpoints").exists() else []
  assert sorted(n for n in names if n.isdigit()) == kept and not any("damaged" in n for n in names), names


def test_a_job_beside_cpu_hogs_on_the_same_cores_finishes_bit_for_bit(hosts, straight, tmp_path):
  """Two busy processes per core, as another job on the same machine: the run slows down, and no
  bound of XLA:CPU's collectives, Gloo, our barriers or the liveness check ends it."""
  hogs = [
    subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 2))
  ]
  try:
    run = Launch(hosts, tmp_path)
    code = run.finish(timeout=600)
  finally:
    for hog in hogs:
      hog.kill()
      hog.wait()
  assert code == 0, run.output()
  assert train_losses(str(tmp_path)) == straight


def test_where_the_host_name_resolves_elsewhere_gloo_is_told_the_interface(straight):
  assert sorted(straight) == list(range(1, STEPS + 1))  # The fixture's run, through the interface flag.


def test_a_slow_link_on_one_host_is_named_by_the_straggler_report(hosts, tmp_path):
  """Process 1's host sends through a 300 kbit/s token bucket: its round trips to the coordination
  service queue behind its share of the collectives, and process 0 names its link, not a host. (The
  local tier's copies, 2.7 s of this link per step, are off: under load they queued the liveness
  round trips past the 4 s peer timeout.)"""
  flags = ["--config.steps=6", "--config.log_every=2", "--config.checkpoint.local_every=0"]
  with hosts.slow_link(1, "300kbit"):
    run = Launch(hosts, tmp_path, pauses="read=0", main_flags=flags)
    assert run.finish(timeout=240) == 0, run.output()
  named = [line for _, line in run.lines if "straggler:" in line]
  assert named and all(line.startswith("[p0] straggler: process 1's link round trip is") for line in named), (
    run.output()
  )


def test_a_link_lost_between_two_processes_that_both_reach_process_0_is_named_by_both_ends(tmp_path):
  """Three hosts on one switch; blackhole routes between hosts 1 and 2 only. Their liveness counters,
  which travel through process 0, keep moving, and their collectives wait on each other: without the
  direct probes only the 300 s step budget would end the job. Here it ends within the peer timeout,
  exit 3, with a line naming both ends and their addresses, and no process is left behind."""
  mesh = ["--config.mesh.data=3", "--config.mesh.fsdp=2", "--config.mesh.tensor=1"]
  flags = [*mesh, "--config.global_batch_size=12", "--config.steps=1000", "--config.checkpoint.every=1000"]
  with bridged_hosts(3) as hosts:
    run = Launch(hosts, tmp_path, "--grace_s=2", main_flags=flags, cpu_devices=2)
    try:
      run.wait_for(r"\[p0\] step 2/", timeout=120)
      hosts.cut_between(1, 2)
      cut_at = time.time()
      named_at = run.wait_for(r"cannot reach process", timeout=PEER_TIMEOUT_S + 20)
      code = run.finish(timeout=30)
    finally:
      run.finish(timeout=10)
  out = run.output()
  assert code == 3, out
  # Silence counts from the last probe that crossed, up to one probe interval (0.5 s here) before the cut.
  assert PEER_TIMEOUT_S - 1 <= named_at - cut_at <= PEER_TIMEOUT_S + 10, (named_at - cut_at, out)
  address = r"\((10\.[\d.]+):\d+\)"
  named = re.findall(rf"\[p(\d)\] error: process (\d) {address} cannot reach process (\d) {address}", out)
  assert named, out
  for prefix, me, my_address, peer, peer_address in named:
    assert prefix == me and {me, peer} == {"1", "2"}, out
    assert (my_address, peer_address) == (hosts.addresses[int(me)], hosts.addresses[int(peer)]), out
  assert "while both reach the coordination service on process 0" in out, out
  assert "Thread 0x" not in out and "Traceback" not in out, out
  left = [p for p in psutil.process_iter(["cmdline"]) if f"--workdir={tmp_path}" in (p.info["cmdline"] or [])]
  assert not left, left
