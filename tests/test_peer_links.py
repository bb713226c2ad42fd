"""The peer service's framing and probe, the probe schedule, and a lost link named from real probes on
127.0.0.1, without a job (tests/test_network_faults.py cuts a link between three hosts of a real job)."""

import errno
import os
import socket
import threading
import time
import types

import pytest

from trainer.cluster import links, liveness, peers


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
  """A job's secret, as launch/local.py gives its processes; read afresh by each test."""
  monkeypatch.setenv(peers.SECRET_ENV, "0123456789abcdef0123456789abcdef")
  monkeypatch.setattr(peers, "_secret", [])


@pytest.mark.parametrize("processes", [2, 3, 5, 16])
def test_each_process_probes_one_peer_a_round_is_probed_once_and_covers_every_pair(processes):
  rounds = processes - 1
  covered = set()
  for r in range(rounds):
    targets = [links.target(me, processes, r) for me in range(processes)]
    assert all(t != me for me, t in enumerate(targets))  # Never itself.
    assert sorted(targets) == list(range(processes))  # Each process is probed exactly once a round.
    covered |= {(me, t) for me, t in enumerate(targets)}
  # Within P-1 rounds every process has probed every peer: every pair, from both ends.
  assert covered == {(a, b) for a in range(processes) for b in range(processes) if a != b}


def test_the_probe_rate_is_bounded_whatever_the_job_size():
  assert links.interval_s(30, 2) == links.MAX_INTERVAL_S
  assert links.interval_s(30, 10_000) == links.MIN_INTERVAL_S  # At most 10 probes a second.
  assert links.interval_s(4, 3) == 0.5  # Each peer probed from each end 4 times per timeout.


def test_a_frame_reads_back_and_a_stray_one_is_refused():
  a, b = socket.socketpair()
  with a, b:
    a.sendall(peers.encode(peers.PROBE, b'{"x": 1}') + peers.encode(7, b""))
    assert peers.read_frame(b) == (peers.PROBE, b'{"x": 1}')
    assert peers.read_frame(b) == (7, b"")
    a.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(peers.PeerError, match="not a peer-service frame"):
      peers.read_frame(b)


def test_the_service_answers_a_probe_for_itself_and_refuses_others():
  service = peers.PeerService(2, "127.0.0.1", 0)
  try:
    peers.probe(service.address, me=1, peer=2, timeout_s=5)
    assert 1 in service.heard  # The prober's link counts as alive on this side too.
    with pytest.raises(peers.PeerError, match="answered by another process|reached process 2"):
      peers.probe(service.address, me=1, peer=3, timeout_s=5)
    with pytest.raises(peers.PeerError, match="unknown message type 9"):
      peers.request(service.address, 9, b"", timeout_s=5)
  finally:
    service.close()


def test_a_connection_without_the_jobs_secret_is_refused_once_per_address_and_reaches_no_handler(capfd):
  """A stranger on the network: a crafted pickle sent as a frame, an HMAC under another secret, a caller
  that meets a listener without the secret; no handler runs, one line per address, the service goes on."""
  import pickle

  reached = []
  service = peers.PeerService(2, "127.0.0.1", 0)
  service.handlers[7] = reached.append
  host, port = service.address.rsplit(":", 1)
  crafted = pickle.dumps(types.SimpleNamespace)  # Any pickle: none is ever read from the network.
  try:
    for attempt in range(3):
      with socket.create_connection((host, int(port)), timeout=5) as s:
        nonce = bytes(peers.read_exactly(s, len(peers.MAGIC) + 32)[4:])
        if attempt == 0:  # A frame straight away, as before the handshake.
          s.sendall(peers.encode(7, crafted))
          s.shutdown(socket.SHUT_WR)
        else:  # The handshake under another secret.
          s.sendall(os.urandom(32) + peers._proof(b"another job's secret", b"caller", nonce, b"x" * 32))
        assert s.recv(1) == b"", "a caller without the secret got an answer"
    impostor = peers.PeerService(3, "127.0.0.1", 0, secret=b"another job's secret")
    try:
      with pytest.raises(peers.PeerError, match="refused at the handshake"):
        peers.request(impostor.address, 7, crafted, timeout_s=5)
      with socket.socket() as fake:  # A listener that answers any caller, with a proof under no secret.
        fake.bind(("127.0.0.1", 0))
        fake.listen()
        answer = threading.Thread(target=lambda: _answer_blindly(fake), daemon=True)
        answer.start()
        with pytest.raises(peers.PeerError, match="the listener does not hold this job's secret"):
          peers.request(f"127.0.0.1:{fake.getsockname()[1]}", 7, b"", timeout_s=5)
        answer.join(5)
    finally:
      impostor.close()
    peers.probe(service.address, me=1, peer=2, timeout_s=5)  # The job's own callers still get through.
  finally:
    service.close()
  assert reached == []
  refusals = [line for line in capfd.readouterr().err.splitlines() if "process 2: refused" in line]
  assert refusals == [
    "warning: peer service of process 2: refused a connection from 127.0.0.1: it does not hold this job's "
    "secret (said once per address)"
  ], refusals


def _answer_blindly(listener: socket.socket) -> None:
  conn, _ = listener.accept()
  with conn:
    conn.sendall(peers.MAGIC + os.urandom(32))
    peers.read_exactly(conn, 64)
    conn.sendall(os.urandom(32))


def test_a_lost_link_is_named_with_both_ends_only_while_the_peer_still_answers_process_0(monkeypatch):
  """Process 0 of 3: process 1 answers its probes, process 2's port refuses them."""
  me, one = peers.PeerService(0, "127.0.0.1", 0), peers.PeerService(1, "127.0.0.1", 0)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    closed = f"127.0.0.1:{s.getsockname()[1]}"  # Nobody listens there once the socket closes.
  monkeypatch.setattr(links, "jax", types.SimpleNamespace(process_index=lambda: 0, process_count=lambda: 3))
  monkeypatch.setattr(peers, "service", lambda: me)
  monkeypatch.setattr(peers, "addresses", lambda: {0: me.address, 1: one.address, 2: closed})
  watched = links.Links(timeout_s=0.4)
  try:
    assert watched.cut(time.time(), answering=lambda peer, since: True) is None  # Nothing older than 0.4 s.
    time.sleep(1.0)
    now = time.time()
    assert watched.cut(now, answering=lambda peer, since: peer != 2) is None  # Silent everywhere: liveness's.
    cut = watched.cut(now, answering=lambda peer, since: True)
    assert cut and cut.startswith(f"process 0 ({me.address}) cannot reach process 2 ({closed})"), cut
    assert "process 1" not in cut
  finally:
    watched.stop()
    me.close()
    one.close()


def test_a_peer_timeout_of_0_starts_no_service_and_names_nothing(monkeypatch):
  def no_service():
    raise AssertionError("the peer service started with watchdog.peer_timeout_s=0")

  monkeypatch.setattr(peers, "service", no_service)
  assert links.Links(timeout_s=0).cut(time.time() + 1e6, answering=lambda peer, since: True) is None


def test_a_counter_sent_just_before_a_full_partition_does_not_make_the_peer_answering():
  """CI once saw process 0 blame the link to process 1 when both hosts were cut from each other: the
  peer's last counter, read a round after the cut, still looked fresh when the link's silence passed
  the timeout. The peer answers only if its counter moved well after the link went quiet."""
  watched = liveness.Liveness(peer_timeout_s=4, startup_timeout_s=60)
  link_quiet_since = 1000.0
  watched._contact = link_quiet_since + 4.5
  watched._seen[1] = (7, link_quiet_since + 2.0)  # Sent before the cut, read after it.
  assert not watched.answering(1, now=link_quiet_since + 4.5, since=link_quiet_since)
  watched._seen[1] = (9, link_quiet_since + 4.0)  # Still moving, long after the link went quiet.
  assert watched.answering(1, now=link_quiet_since + 4.5, since=link_quiet_since)
  assert not watched.answering(1, now=link_quiet_since + 8, since=link_quiet_since)  # Silent since.


def test_stopping_the_watchdog_ends_the_threads_that_call_the_coordination_service(monkeypatch):
  """A daemon thread still inside a coordination-service call at interpreter exit aborts the process
  after a finished run (CI: 'FATAL: exception not rethrown', exit -6): stop() must join them."""
  from trainer.cluster import watchdog

  inside = {"liveness": threading.Event(), "links": threading.Event()}

  def call(thread: str):  # A call to the coordination service that takes a while: stop() comes mid-call.
    inside[thread].set()
    time.sleep(0.5)

  class Client:
    def key_value_set(self, key, value, allow_overwrite=False):
      pass

    def key_value_dir_get(self, prefix):
      call("liveness")
      return []

  service = peers.PeerService(0, "127.0.0.1", 0)
  monkeypatch.setattr(liveness.multihost, "client", lambda: Client())
  monkeypatch.setattr(links, "jax", types.SimpleNamespace(process_index=lambda: 0, process_count=lambda: 2))
  monkeypatch.setattr(peers, "service", lambda: service)
  monkeypatch.setattr(peers, "addresses", lambda: call("links") or {})  # Process 1 not there yet.
  config = types.SimpleNamespace(step_timeout_s=60, startup_timeout_s=60, peer_timeout_s=10)
  dog = watchdog.Watchdog(config)
  try:
    assert all(event.wait(5) for event in inside.values()), "a thread never called the service"
    dog.stop()  # Both threads are inside a call.
    alive = [t.name for t in threading.enumerate() if t.name in ("liveness", "links", "watchdog")]
    assert not alive, alive
  finally:
    service.close()


def test_process_0_silent_while_its_service_no_longer_answers_is_named_as_the_service(monkeypatch):
  """Process 1's view. CI once saw it name 'process 0 (silent for 5 s)' in a partition: process 0's
  counter, read a round before our last trip to its service, passed the timeout first."""
  process_1_of_2 = types.SimpleNamespace(process_index=lambda: 1, process_count=lambda: 2)
  monkeypatch.setattr(liveness, "jax", process_1_of_2)
  watched = liveness.Liveness(peer_timeout_s=5, startup_timeout_s=60)
  watched._client = object()  # As if joined; no thread runs.
  now = 1000.0
  watched._seen[0] = (7, now - 5.5)
  watched._contact = now - 4.0  # Our round trips stopped too: the service is gone.
  assert watched.lost(now) == "process 0, which runs the coordination service (no answer for 6 s)"
  watched._contact = now - 0.5  # The service answers; process 0's own thread has stopped counting.
  assert watched.lost(now) == "process 0 (silent for 6 s)"
  watched._seen[0] = (8, now - 1.0)
  assert watched.lost(now) is None


def _splice_refused_by_files(monkeypatch):
  """os.splice as on a file system without splice support: EINVAL into a file, sockets as they are."""
  real = os.splice

  def splice(src, dst, count, offset_src=None, offset_dst=None, flags=0):
    if offset_dst is not None:
      raise OSError(errno.EINVAL, "Invalid argument")
    return real(src, dst, count)

  monkeypatch.setattr(os, "splice", splice)


@pytest.mark.parametrize("way", ["splice", "no splice", "a file system without splice"])
def test_a_streamed_payload_lands_whole_at_the_files_position_and_leaves_what_follows(
  tmp_path, way, monkeypatch
):
  """The local tier's partner copies arrive this way (trainer/checkpoint/local.py): by splice on Linux,
  through a buffer elsewhere; the bytes sent slowly, so that a socket with a timeout must wait."""
  if way != "no splice" and not hasattr(os, "splice"):
    pytest.skip("os.splice is Linux-only")
  if way == "no splice":
    monkeypatch.delattr(os, "splice", raising=False)
  if way == "a file system without splice":
    _splice_refused_by_files(monkeypatch)
  payload = os.urandom(3 << 20) + b"tail"
  with socket.create_server(("127.0.0.1", 0)) as server:
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
  receiver.settimeout(10)  # Non-blocking underneath, as the peer service's sockets are.

  def send():
    for i in range(0, len(payload), 1 << 20):
      sender.sendall(payload[i : i + (1 << 20)])
      time.sleep(0.05)
    sender.sendall(b"next")

  thread = threading.Thread(target=send)
  thread.start()
  with sender, receiver, open(tmp_path / "copy", "w+b") as f:
    f.write(b"head")
    peers.read_to_file(receiver, len(payload), f)
    f.write(b"end")
    thread.join()
    assert receiver.recv(4) == b"next"  # Not one byte past the payload was taken.
  assert (tmp_path / "copy").read_bytes() == b"head" + payload + b"end"


@pytest.mark.parametrize("way", ["splice", "no splice"])
def test_a_stream_that_stalls_or_closes_midway_is_a_peer_error(tmp_path, way, monkeypatch):
  if way == "splice" and not hasattr(os, "splice"):
    pytest.skip("os.splice is Linux-only")
  if way == "no splice":
    monkeypatch.delattr(os, "splice", raising=False)
  for ending, error in (
    ("stall", "timed out|unread"),
    ("close", "connection closed with 96 of 100 bytes unread"),
  ):
    a, b = socket.socketpair()
    b.settimeout(0.3)
    a.sendall(b"four")
    if ending == "close":
      a.close()
    with open(tmp_path / "copy", "wb") as f, pytest.raises((peers.PeerError, TimeoutError), match=error):
      peers.read_to_file(b, 100, f)
    a.close()
    b.close()


def test_a_request_that_fails_in_the_peer_service_is_one_line_and_nothing_at_shutdown(capfd, monkeypatch):
  """A handler's unexpected error is one warning, not socketserver's traceback; while the interpreter
  shuts down (a partner's copy or probe arriving as the process exits: "can't create new thread at
  interpreter shutdown"), nothing: the run's last line stays its last."""

  def fail(payload: bytes) -> bytes:
    raise RuntimeError("boom")

  service = peers.PeerService(0, "127.0.0.1", 0)
  try:
    service.handlers[9] = fail
    with pytest.raises(peers.PeerError):
      peers.request(service.address, 9, b"", 5)
    err = capfd.readouterr().err
    assert err.strip() == "warning: peer service: a request from 127.0.0.1 failed (RuntimeError: boom)", err
    monkeypatch.setattr(peers.sys, "is_finalizing", lambda: True)
    with pytest.raises(peers.PeerError):
      peers.request(service.address, 9, b"", 5)
    assert capfd.readouterr().err == ""
  finally:
    service.close()
