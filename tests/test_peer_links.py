"""The peer service's framing and probe, the probe schedule, and a lost link named from real probes on
127.0.0.1, without a job (tests/test_network_faults.py cuts a link between three hosts of a real job)."""

import socket
import time
import types

import pytest

from trainer.cluster import links, liveness, peers


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
