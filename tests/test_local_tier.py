"""The local and peer checkpoint tiers (trainer/checkpoint/local.py): a host lost after its copy landed
costs at most a step (tests/test_lost_host_bound.py kills anywhere against the worst case).

One 2-process job under launch/local.py's restarts, persistent checkpoints every 6 steps, local copies
every step; process 1 is killed four times where a pause holds it (the steps drawn from a seed and
printed): after its own copy landed, after its local storage is wiped (a replacement host), while its
copy is being made whole (torn), and with both copies of its shards gone. The losses equal an
uninterrupted run's bit for bit, and each restart says which tier and copy it resumed from.
"""

import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from tests.conftest import REPO, TINY_FLAGS, run_main, train_losses
from trainer.checkpoint import local, local_copies

pytestmark = pytest.mark.slow

SEED = 20261205
STEPS = 20
FLAGS = [
  *(f for f in TINY_FLAGS if not f.startswith("--config.checkpoint.every=")),
  f"--config.steps={STEPS}",
  "--config.checkpoint.every=6",
  "--config.checkpoint.local_every=1",
]


class _Job:
  def __init__(self, workdir, local_dir, pauses_file, *launcher_flags, env=None, flags=FLAGS):
    main = ["--main=tests/main_with_pauses.py", "--", f"@{pauses_file}"] if pauses_file else ["--"]
    self.proc = subprocess.Popen(
      [sys.executable, "launch/local.py", "--processes=2", "--cpu_devices=4", *launcher_flags, *main]
      + [*flags, f"--config.checkpoint.local_dir={local_dir}", f"--workdir={workdir}"],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    self.lines: list[str] = []
    threading.Thread(
      target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True
    ).start()

  def wait_for(self, text: str, since: int = 0, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
      for i, line in enumerate(self.lines[since:], since):
        if text in line:
          return i
      assert self.proc.poll() is None, "the job ended early:\n" + "".join(self.lines[-40:])
      time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {timeout} s:\n" + "".join(self.lines[-40:]))

  def finish(self, timeout: float = 180) -> int | None:
    """The launcher's exit code, or None if it had to be killed."""
    try:
      return self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
      return None

  def output(self) -> str:
    return "".join(self.lines)


def _process_pid(launcher_pid: int, process: int) -> int:
  for child in psutil.Process(launcher_pid).children():
    if f"--process_id={process}" in child.cmdline():
      return child.pid
  raise AssertionError(f"no process {process} under the launcher")


def _two_free_ports() -> int:
  """A port P with P + 1 free too (now): a job's two peer services, PEER_PORT_BASE = P."""
  for _ in range(50):
    with socket.socket() as a, socket.socket() as b:
      a.bind(("127.0.0.1", 0))
      try:
        b.bind(("127.0.0.1", a.getsockname()[1] + 1))
      except OSError:
        continue
      return a.getsockname()[1]
  raise AssertionError("no two free ports in a row")


class _Evil:
  """A pickle that runs code where it is loaded: it creates `sentinel`."""

  def __init__(self, sentinel):
    self.sentinel = str(sentinel)

  def __reduce__(self):
    return (open, (self.sentinel, "w"))


def _attack(address: str, sentinel) -> None:
  """What a stranger who reaches a peer port can send: a copy whose shards are a crafted pickle, as a
  frame straight away (the service before it had a handshake) and after a handshake under a guessed
  secret."""
  from trainer.cluster import peers

  manifest = json.dumps({"step": 1, "process": 0, "fingerprint": "x", "xxh3_128": "0"}).encode()
  payload = len(manifest).to_bytes(8, "big") + manifest + pickle.dumps(_Evil(sentinel))
  host, port = address.rsplit(":", 1)
  for guess in (None, b"guessed"):
    with socket.create_connection((host, int(port)), timeout=10) as s:
      nonce = bytes(peers.read_exactly(s, len(peers.MAGIC) + 32)[len(peers.MAGIC) :])
      try:  # The service may close the connection while this side still sends.
        if guess is not None:
          s.sendall(b"n" * 32 + peers._proof(guess, b"caller", nonce, b"n" * 32))
        s.sendall(peers.encode(local.PUT, payload))
        s.shutdown(socket.SHUT_WR)
        answer = s.recv(1)
      except (ConnectionResetError, BrokenPipeError, OSError):
        answer = b""
      assert answer == b"", "the peer service answered a stranger"


def _wait_for_file(path, timeout=60) -> None:
  deadline = time.time() + timeout
  while not os.path.exists(path):
    assert time.time() < deadline, f"{path} never appeared"
    time.sleep(0.05)


def test_a_killed_process_loses_at_most_a_step_from_every_tier_and_the_losses_stay_bit_for_bit(tmp_path):
  rng = np.random.default_rng(SEED)
  # Each kill holds process 1 where it waits for global batch k (step k done, step k+1 next), or, for
  # k3, in the rename that makes its copy of step k3 whole.
  k1 = int(rng.integers(3, 6))
  k2 = k1 + int(rng.integers(2, 4))
  k3 = k2 + int(rng.integers(2, 4))
  k4 = int(rng.integers(max(k3 + 2, 14), 18))  # After persistent checkpoint 12, before 18.
  print(f"seed {SEED}: kills at steps {k1}, {k2} (storage wiped), {k3} (torn copy), {k4} (both copies lost)")
  local_dir, pauses = tmp_path / "local", tmp_path / "pauses"
  own = lambda p, step: local_dir / f"process_{p}" / "own" / str(step)  # noqa: E731
  held = lambda p, src, step: local_dir / f"process_{p}" / "held" / str(src) / str(step)  # noqa: E731
  phases = [(k1, "read"), (k2, "read"), (k3, "local"), (k4, "read")]
  pauses.write_text(f"read=60@{k1}/p1")
  # The undisturbed run, against which the losses are compared, gets a stranger's crafted copies.
  port, sentinel = _two_free_ports(), tmp_path / "code-ran"
  env = {**os.environ, "PEER_PORT_BASE": str(port)}
  straight = _Job(tmp_path / "straight", tmp_path / "straight_local", None, env=env)
  straight.wait_for("[p0] step 1/")
  _attack(f"127.0.0.1:{port + 1}", sentinel)
  job = _Job(tmp_path / "run", local_dir, pauses, "--max_restarts=4", "--restart_backoff_s=0.5")
  try:
    seen = 0
    for i, (k, where) in enumerate(phases):
      seen = job.wait_for(f"[p1] pause: {where} {k}", seen)
      if where == "read":  # Its copy of step k whole here and at its partner's before the kill.
        _wait_for_file(own(1, k) / "manifest.json")
        _wait_for_file(held(0, 1, k) / "manifest.json")
      pauses.write_text(f"{phases[i + 1][1]}=60@{phases[i + 1][0]}/p1" if i + 1 < len(phases) else "")
      os.kill(_process_pid(job.proc.pid, 1), 9)
      if k in (k2, k4):  # A replacement host: its local storage is gone.
        shutil.rmtree(local_dir / "process_1")
      if k == k4:  # ... and so is its partner's copy of its shards.
        shutil.rmtree(local_dir / "process_0" / "held" / "1")
      seen = job.wait_for("[launch] restart", seen)
    assert job.finish() == 0, job.output()
    assert straight.finish() == 0, straight.output()
    refused = [line for line in straight.lines if "refused a connection" in line]
    assert len(refused) == 1 and refused[0].startswith("[p1] warning: peer service of process 1"), refused
    assert not sentinel.exists()
  finally:
    job.finish(timeout=1)
    straight.finish(timeout=1)
  out = job.output()
  both_own = "process 0 from its own copy; process 1 from its own copy"
  assert f"restored step {k1} from the local tier: {both_own}" in out, out
  from_partner = "process 0 from its own copy; process 1 from process 0's copy"
  assert f"restored step {k2} from the local tier: {from_partner}" in out, out
  assert f"restored step {k3 - 1} from the local tier: {both_own}" in out, out  # Step k3's copy was torn.
  assert (
    "local tier: nothing to resume from (process 1 has no whole copy, own or held by a partner)" in out
  ), out
  assert "resumed from checkpoint 12" in out, out
  # Process 0's copies of the steps after 12, a future abandoned: kept, they would outrank its new ones.
  removed = re.search(r"removed the copies of steps ([\d, ]+): the run goes on from step 12\n", out)
  assert removed and k4 - 1 in (steps := {int(s) for s in removed.group(1).split(", ")}), out
  assert steps <= set(range(13, k4 + 1)), steps
  # Steps trained again: the last step process 0 finished before each kill, less the step resumed from.
  last, again = 0, []
  for line in job.lines:
    if m := re.match(r"\[p0\] step (\d+)/", line):
      last = int(m.group(1))
    elif m := re.match(r"\[p0\] (?:resumed from checkpoint|restored step) (\d+)", line):
      again.append(last - int(m.group(1)))
  print(f"steps trained again after each kill: {again}")
  assert len(again) == 4 and max(again[:3]) <= 1, again
  assert train_losses(str(tmp_path / "run")) == train_losses(str(tmp_path / "straight"))
  assert not local_dir.exists() and not (tmp_path / "straight_local").exists()  # A finished run frees them.


def test_resuming_onto_another_process_count_falls_back_to_persistent_and_says_why(tmp_path):
  """Copies written by 2 processes do not restore onto 1: the persistent tier's newest is used."""
  local_dir, pauses = tmp_path / "local", tmp_path / "pauses"
  pauses.write_text("read=60@8/p1")
  job = _Job(tmp_path / "run", local_dir, pauses)
  try:
    job.wait_for("[p1] pause: read 8")
    _wait_for_file(local_dir / "process_1" / "own" / "8" / "manifest.json")
    os.kill(_process_pid(job.proc.pid, 1), 9)
    job.finish(timeout=60)
  finally:
    job.finish(timeout=1)
  flags = [
    *FLAGS,
    f"--config.checkpoint.local_dir={local_dir}",
    f"--workdir={tmp_path / 'run'}",
    "--cpu_devices=8",
  ]
  result = run_main(*flags, "--config.steps=8")
  assert result.returncode == 0, result.stdout + result.stderr
  assert "copies were written under another layout or process count" in result.stdout, result.stdout
  assert "resumed from checkpoint 6" in result.stdout, result.stdout
  removed = r"local tier: removed the copies of steps 7(, 8)?: the run goes on from step 6\n"
  assert re.search(removed, result.stdout), result.stdout


@pytest.mark.needs_root  # Mounts a tmpfs.
def test_a_local_dir_without_room_is_one_line_unless_the_tier_is_automatic(tmp_path):
  small = tmp_path / "small"
  small.mkdir()
  if (
    os.geteuid() != 0
    or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)]).returncode
  ):
    pytest.skip("a 256 KiB tmpfs needs root and mount")
  try:
    flags = [*FLAGS, "--config.steps=2", f"--config.checkpoint.local_dir={small}", "--cpu_devices=8"]
    result = run_main(*flags, f"--workdir={tmp_path / 'a'}")
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "of room and the local and peer tiers need" in line and "local_every=0" in line, line
    assert "shards, no partner's: one process)" in line, line  # Half the room of a process with a partner.
    result = run_main(
      *flags[:-2],
      f"--config.checkpoint.local_dir={small}",
      "--cpu_devices=8",
      f"--workdir={tmp_path / 'b'}",
      "--config.checkpoint.local_every=-1",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning: the local checkpoint tier is off" in result.stdout, result.stdout
  finally:
    subprocess.run(["umount", str(small)])


def test_a_send_to_the_partner_is_tried_again_while_the_link_fails_up_to_the_peer_timeout(
  tmp_path, monkeypatch
):
  """A link flap shorter than watchdog.peer_timeout_s costs nothing (the send goes through once the
  link is back); one that lasts longer ends the run with the link's error, as liveness would."""
  from trainer.cluster import peers

  tier = local.LocalTier(str(tmp_path), "key", {}, link_timeout_s=2.0)
  tier.partner = 1
  monkeypatch.setattr(tier, "_addresses", lambda: {1: "10.0.0.2:1"})
  local_copies.write_copy(tier.own, 7, b"shards", {"step": 7})
  sent, failures = [], [3]

  def flaky(address, kind, prefix, timeout_s, file=None):
    if failures[0]:
      failures[0] -= 1
      raise peers.PeerError(f"{address}: [Errno 101] Network is unreachable")
    sent.append(file.read())

  monkeypatch.setattr(peers, "request", flaky)
  tier._send_to_partner(7, {"step": 7})
  assert sent == [b"shards"] and failures == [0]  # Three failures, then the whole file from its start.

  failures[0] = 100
  started = time.time()
  with pytest.raises(peers.PeerError, match="Network is unreachable"):
    tier._send_to_partner(7, {"step": 7})
  assert 2.0 <= time.time() - started < 4.0


def test_one_writer_thread_makes_every_copy_and_an_error_reaches_the_next_wait(tmp_path, monkeypatch):
  """A thread per copy left each copy's host memory in a new malloc arena: on a TPU host, 1.1 GiB more
  resident memory per copy of a 1.2 GiB state. One writer makes every copy; a copy's error is raised by
  the loop's next wait, and the writer goes on with the copy after it."""
  import jax.numpy as jnp

  tier = local.LocalTier(str(tmp_path), "key", {}, link_timeout_s=1.0)
  writers, stage = [], local_copies.stage

  def host_copy(state, *pacing):
    writers.append(threading.current_thread())
    return {"x": {(): np.asarray(state["x"])}}

  def stage_failing_once(folder, step, fill, hashed=True):
    if step == 2:
      raise OSError(28, "No space left on device")
    return stage(folder, step, fill, hashed)

  monkeypatch.setattr(local, "host_copy", host_copy)
  monkeypatch.setattr(local_copies, "stage", stage_failing_once)
  for step in (1, 2, 3):
    tier.save(step, {"x": jnp.full(4, step)}, {"step": step}, checked=True, finite_flags=[])
    tier.release()
    if step == 2:
      with pytest.raises(OSError, match="No space left"):
        tier.wait()
  tier.wait()
  assert sorted(local_copies.whole_copies(tier.own)) == [1, 3]
  assert len(set(writers)) == 1 and writers[0] is not threading.current_thread()
  tier.close(finished=False)
  writers[0].join(timeout=5)
  assert not writers[0].is_alive()


def test_a_paced_copy_starts_a_part_per_dispatched_step_and_never_waits_long_for_one(tmp_path, monkeypatch):
  """checkpoint.local_pace_mib: a copy's transfers start a part at a time, one per step the loop
  dispatches, steps dispatched together too (on a TPU a step dispatched behind a whole copy's transfers
  waited for them); the loop's wait for the copy starts the rest at once, and a loop that stops stepping
  (a batch not ready, an evaluation) holds a copy back for PACE_WAIT_S at most: a kill there still
  loses no more than the bound."""
  import jax.numpy as jnp

  monkeypatch.setattr(local, "PACE_WAIT_S", 60.0)
  tier = local.LocalTier(str(tmp_path), "key", {}, link_timeout_s=1.0, pace_mib=1e-6)  # A part per leaf.
  parts, next_part = [], tier._next_part
  tier._next_part = lambda: (next_part(), parts.append(1))
  state = {k: jnp.full(4, i) for i, k in enumerate("abcd")}
  tier.save(1, state, {"step": 1}, checked=True, finite_flags=[])
  tier.release()

  def parts_after(steps: int) -> int:
    expected, deadline = len(parts) + steps, time.time() + 30
    for _ in range(steps):
      tier.stepped()
    while len(parts) < expected and time.time() < deadline:
      time.sleep(0.01)
    time.sleep(0.5)
    return len(parts)

  assert parts_after(0) == 0  # No step dispatched since the copy's: no transfer yet.
  assert parts_after(1) == 1  # One part per dispatched step,
  assert parts_after(2) == 3  # also for steps dispatched together (a logging window's).
  assert not local_copies.whole_copies(tier.own)
  tier.wait()
  assert len(parts) == 4 and sorted(local_copies.whole_copies(tier.own)) == [1]
  saved = tier.load(1, {0: {"own": [1], "held": {}, "other": 0}})[0]["shards"]
  assert {k: v[((0, 4),)].tolist() for k, v in saved.items()} == {k: [i] * 4 for i, k in enumerate("abcd")}
  monkeypatch.setattr(local, "PACE_WAIT_S", 0.2)
  tier.save(2, state, {"step": 2}, checked=True, finite_flags=[])
  tier.release()
  deadline = time.time() + 30
  while 2 not in local_copies.whole_copies(tier.own) and time.time() < deadline:
    time.sleep(0.05)
  assert len(parts) == 8 and sorted(local_copies.whole_copies(tier.own)) == [1, 2]  # No step, no wait().
  tier.close(finished=True)
