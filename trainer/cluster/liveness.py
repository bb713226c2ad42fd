"""Peers that stop answering, named by us before JAX's heartbeat aborts the job without naming them.

Every second a thread of each process publishes a counter in the coordination service
(`liveness/I`) and reads every peer's in one directory read. A peer whose counter has not moved for
`watchdog.peer_timeout_s` is lost: stopped (SIGSTOP), wedged outside Python, dead, or behind a
network partition. A process that has not reached the service at all for as long, or whose last
reading of process 0's counter is that old while its own trips have stopped too, has lost process 0,
whose process runs the service. The process then prints one line naming what it lost and where it
was, writes every thread's stack to WORKDIR/crashes/process_I.txt, and exits 3 (restartable).

It needs no phase budget: a 20-minute compile or restore still answers every second, since the
counter lives in its own thread. Bounds: a lost peer is named between peer_timeout_s and
peer_timeout_s + 2 s after its last answer. JAX's own heartbeat (--distributed_heartbeat_timeout_s,
JAX's default 100 s) must be longer, or JAX aborts first: the timeout used is at most half of it.
A peer that has not answered yet (still importing or building on a loaded host) is judged against
watchdog.startup_timeout_s instead. watchdog.peer_timeout_s=0 judges nobody (the counters still carry
the reports). Two processes that lose each other but not process 0 are trainer/cluster/links.py's.
"""

import json
import statistics
import threading
import time

import jax

from trainer.cluster import multihost

PERIOD_S = 1.0


class Liveness:
  """The only thread that talks to the coordination service about liveness: a call that hangs in a
  partition holds this thread alone, never the watchdog's (which judges from what this one saw)."""

  def __init__(self, peer_timeout_s: float, startup_timeout_s: float):
    self.timeout_s, self.startup_timeout_s = peer_timeout_s, startup_timeout_s
    self.me, self.started = jax.process_index(), time.time()
    self._client = multihost.client()
    self._lock = threading.Lock()
    self._report: dict = {}  # What this process publishes with its counter (the watchdog's progress).
    self._contact = self.started  # When a round trip to the service last succeeded.
    self._seen: dict[int, tuple[int, float]] = {}  # peer -> (its counter, when we saw it change)
    self._reports: dict[int, dict] = {}  # peer -> its latest report
    self._round_trips: list[float] = []  # Seconds of each round trip since round_trip_s() last ran.
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    if self._client is None:
      return
    from trainer.cluster import runtime

    # Below JAX's heartbeat, which would abort first without naming anyone; 0 stays 0 (off).
    self.timeout_s = min(peer_timeout_s, runtime.heartbeat_timeout_s() / 2)
    self._thread = threading.Thread(target=self._talk, daemon=True, name="liveness")
    self._thread.start()

  def stop(self, timeout_s: float = 2.0) -> None:
    """Ends the thread and waits for it (at most `timeout_s`: a call that hangs in a partition is left).
    A daemon thread still inside a coordination-service call when the interpreter exits is ended
    there by Python, and the C++ below it aborts the process (`FATAL: exception not rethrown`, exit
    -6) after a run that finished."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout_s)

  def publish(self, report: dict) -> None:
    """Sent with the next counter (within a second)."""
    with self._lock:
      self._report = dict(report)

  def reports(self) -> dict[int, dict | None]:
    """{peer: its latest report, None if it never sent one}, as of the last round trip."""
    with self._lock:
      return {p: self._reports.get(p) for p in range(jax.process_count()) if p != self.me}

  def _talk(self) -> None:
    count = 0
    while not self._stop.is_set():
      count += 1
      with self._lock:
        mine = json.dumps({"count": count, "report": self._report})
      sent = time.time()
      try:
        self._client.key_value_set(f"liveness/{self.me}", mine, allow_overwrite=True)
        rows = self._client.key_value_dir_get("liveness/")
      except Exception:  # noqa: BLE001 - the service unreachable: judged by the contact's age.
        self._stop.wait(PERIOD_S)
        continue
      now = time.time()
      with self._lock:
        self._contact = now
        self._round_trips.append((now - sent) / 2)  # Two calls: one round trip each.
        for key, value in rows:
          try:
            peer, row = int(key.rsplit("/", 1)[1]), json.loads(value)
          except ValueError:  # Not ours: nothing else writes here, but a bad row must not end the thread.
            continue
          if peer == self.me:
            continue
          self._reports[peer] = row["report"] or None
          if self._seen.get(peer, (None,))[0] != row["count"]:
            self._seen[peer] = (row["count"], now)
      self._stop.wait(PERIOD_S)

  def round_trip_s(self) -> float:
    """The mean round trip to the coordination service (on process 0's host) since the last call: a
    slow or congested link of this host shows here, as the trips that queue behind its collectives
    (trainer/observe/straggler.py compares them)."""
    with self._lock:
      trips, self._round_trips = self._round_trips, []
    return statistics.fmean(trips) if trips else 0.0

  def answering(self, peer: int, now: float, since: float) -> bool:
    """Whether this process and `peer` both reached the coordination service within the last few
    rounds (the peer's counter moved), the peer well after `since` (when the link to it last carried
    a probe). A counter sent just before a full partition is read up to two rounds later: a move that
    late after the link went quiet cannot be it, so a partition from everyone stays `lost()`'s."""
    with self._lock:
      contact, seen = self._contact, self._seen.get(peer)
    recent = 3 * PERIOD_S
    if seen is None or now - contact > recent or now - seen[1] > recent:
      return False
    return seen[1] - since > max(recent, self.timeout_s / 2)

  def lost(self, now: float) -> str | None:
    """What this process has lost contact with (a phrase), or None."""
    if self._client is None or self.timeout_s <= 0:
      return None
    with self._lock:
      contact, seen = self._contact, dict(self._seen)
    if self.me != 0:
      # Process 0's counter was last read up to a round or two before our last round trip: when the
      # service goes, it passes the timeout first, while our own trips (one a PERIOD_S when healthy) have
      # already stopped.
      zero_silent = 0 in seen and now - seen[0][1] > self.timeout_s and now - contact > 1.5 * PERIOD_S
      if now - contact > self.timeout_s or zero_silent:
        quiet_s = max(now - contact, now - seen[0][1] if zero_silent else 0.0)
        return f"process 0, which runs the coordination service (no answer for {quiet_s:.0f} s)"
    silent = []
    for peer in range(jax.process_count()):
      if peer == self.me:
        continue
      if peer in seen and now - seen[peer][1] > self.timeout_s:
        silent.append(f"process {peer} (silent for {now - seen[peer][1]:.0f} s)")
      elif peer not in seen and now - self.started > max(self.timeout_s, self.startup_timeout_s):
        silent.append(f"process {peer} (never answered in {now - self.started:.0f} s)")
    return ", ".join(silent) or None
