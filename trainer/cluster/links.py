"""Liveness between every pair of processes, not only between each process and process 0.

The liveness counters (trainer/cluster/liveness.py) travel through the coordination service on process 0:
two processes cut off from each other but both reaching process 0 look alive, while their collectives
wait on each other until the step watchdog's budget (300 s and more) says "stuck". Here every process
probes its peers directly through their peer services (trainer/cluster/peers.py), over the host network
the collectives share on CPUs (Gloo), not NCCL or InfiniBand.

Schedule: in round r process I probes process (I + 1 + r mod (P-1)) mod P, one probe a round, so in every
P-1 consecutive rounds it probes every peer once, and is probed exactly once a round (by I - 1 - r mod
(P-1)): a process's rate does not grow with the job. A round lasts interval_s: timeout / (4 (P-1)) within
[0.1 s, 1 s], so up to 1 + timeout / 0.4 processes (76 at the default 30 s) each pair is probed from both
ends at least four times per timeout; in larger jobs a cut link is found within (P-1) x 0.1 s instead.

A link is lost when nothing crossed it (our probe answered, or the peer's probe reached us) for
`watchdog.peer_timeout_s`, our latest probe failed, and the peer still answers the coordination service,
well after the link went quiet: a peer that is silent everywhere is liveness.py's to name (stopped,
dead, partitioned from all), even while its last counter, sent before the partition, is still fresh.
"""

import threading
import time

import jax

from trainer.cluster import peers

MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 1.0


def target(me: int, processes: int, round_: int) -> int:
  """The peer that process `me` probes in round `round_`."""
  return (me + 1 + round_ % (processes - 1)) % processes


def interval_s(timeout_s: float, processes: int) -> float:
  return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, timeout_s / (4 * max(processes - 1, 1))))


class Links:
  """Probes one peer per round on its own thread; `cut()` names a lost link, judged on the caller's."""

  def __init__(self, timeout_s: float):
    self.timeout_s = timeout_s
    self._service = peers.service() if timeout_s > 0 else None
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._addresses: dict[int, str] = {}
    self._ok: dict[int, float] = {}  # peer -> when a probe of ours last came back (or its address came).
    self._failed: dict[int, tuple[float, str]] = {}  # peer -> (when our latest probe failed, why)
    if self._service is None:
      return
    self.me, self.processes = jax.process_index(), jax.process_count()
    self.interval_s = interval_s(timeout_s, self.processes)
    self._probe_timeout_s = min(5.0, timeout_s / 4)
    self._thread = threading.Thread(target=self._probe, daemon=True, name="links")
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._service is not None:
      self._thread.join(2.0)  # A probe takes milliseconds; one that hangs in a partition is left.

  def _learn_addresses(self) -> None:
    try:
      found = peers.addresses()
    except Exception:  # noqa: BLE001 - the service unreachable: liveness.py names that; try next round.
      return
    now = time.time()
    with self._lock:
      for peer, address in found.items():
        if peer != self.me and peer not in self._addresses:
          self._addresses[peer] = address
          self._ok[peer] = now  # Judged from when it could first be probed.

  def _probe(self) -> None:
    round_, learned = 0, 0.0
    while not self._stop.is_set():
      began = time.time()
      # Once a second at most until every peer has published: a directory read on process 0 each.
      if len(self._addresses) < self.processes - 1 and began - learned >= 1.0:
        self._learn_addresses()
        learned = began
      peer, round_ = target(self.me, self.processes, round_), round_ + 1
      if (address := self._addresses.get(peer)) is not None:
        try:
          peers.probe(address, self.me, peer, self._probe_timeout_s)
          with self._lock:
            self._ok[peer] = time.time()
        except Exception as e:  # noqa: BLE001 - PeerError, or a reply that does not parse: the link failed.
          with self._lock:
            self._failed[peer] = (time.time(), str(e) if isinstance(e, peers.PeerError) else repr(e))
      self._stop.wait(max(0.0, self.interval_s - (time.time() - began)))

  def cut(self, now: float, answering) -> str | None:
    """'process 1 (HOST:PORT) cannot reach process 2 (HOST:PORT) ...' for the first lost link, or None.
    `answering(peer, since)`: whether the peer still answers the coordination service, well after
    `since`."""
    if self._service is None:
      return None
    with self._lock:
      ok, failed, addresses = dict(self._ok), dict(self._failed), dict(self._addresses)
    for peer in sorted(failed):
      last = max(ok[peer], self._service.heard.get(peer, 0.0))
      if failed[peer][0] > last and now - last > self.timeout_s and answering(peer, last):
        return (
          f"process {self.me} ({self._service.address}) cannot reach process {peer} ({addresses[peer]}): "
          f"no probe between them answered for {now - last:.0f} s (last: {failed[peer][1]})"
        )
    return None
