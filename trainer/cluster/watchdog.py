"""Ends a process that is stuck, with a report, instead of letting the job hang.

The loop says where it is (`beat(phase, step)`); a thread checks the deadline. Past it, the thread
prints what every process was doing and the likely straggler, writes every Python thread's stack
(faulthandler) to WORKDIR/crashes/process_I.txt, prints which process is stuck at which step and
phase, and exits 3; the launcher or scheduler then ends the rest. The same thread ends the process
when a peer stops answering (trainer/cluster/liveness.py), or the link to one is lost while both still
reach process 0 (trainer/cluster/links.py), whatever the phase's budget.

Each process publishes its main thread's progress (phase, step, and when it entered them), not only
that its watchdog thread is alive: a main thread blocked in a read that releases the GIL leaves the
thread reporting happily, and only its progress shows it is behind. The suspect is the process that
stopped reporting (stopped, wedged or dead), else the one furthest behind (lowest step, then the
earliest phase).
"""

import faulthandler
import os
import sys
import threading
import time

import jax

import exit_codes
from trainer import rundir
from trainer.cluster import links, liveness

EXIT_CODE = exit_codes.TRANSIENT_EXIT  # Restarted: the next attempt may not get stuck.
_REPORT_EVERY_S = 1.0


class Watchdog:
  def __init__(self, watchdog_config, workdir: str | None = None):
    w = watchdog_config
    self.step_timeout_s = w.step_timeout_s
    self._workdir = workdir
    self._lock = threading.Lock()
    self._window = None  # The last logging window's per-step figures (trainer/observe/straggler.py).
    # {phase: rank}: at the same step, a lower rank is behind. Handed over by the clock that beats this
    # watchdog (trainer/observe/clock.py); without one every phase ranks alike.
    self.phase_order: dict[str, int] = {}
    self._set("startup", 0, w.startup_timeout_s)
    self._peers = liveness.Liveness(w.peer_timeout_s, w.startup_timeout_s)
    self._links = links.Links(self._peers.timeout_s)  # The same timeout: below JAX's heartbeat.
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True, name="watchdog")
    self._thread.start()

  def _set(self, phase: str, step: int, timeout_s: float) -> None:
    with self._lock:
      self.phase, self.step, self.timeout_s = phase, step, timeout_s
      self.since = time.time()

  def beat(self, phase: str, step: int, timeout_s: float | None = None) -> None:
    """Entering `phase` at `step`: it must end, or the next beat come, within the timeout."""
    self._set(phase, step, self.step_timeout_s if timeout_s is None else timeout_s)

  def note_window(self, window: dict) -> None:
    """This process's latest logging window ({step, data_s, dispatch_s}), published with every
    report from now on."""
    with self._lock:
      self._window = window
    self._publish()

  def link_round_trip_s(self) -> float:
    return self._peers.round_trip_s()

  def peer_windows(self) -> dict[int, dict]:
    """{process: its latest window} of every process that published one (this one included)."""
    windows = {p: r["window"] for p, r in self._peers.reports().items() if r and r.get("window")}
    with self._lock:
      if self._window:
        windows[jax.process_index()] = self._window
    return windows

  def _publish(self) -> None:
    """Our main thread's progress, sent by the liveness thread, for a peer's watchdog to read."""
    with self._lock:
      report = {"phase": self.phase, "step": self.step, "since": self.since, "time": time.time()}
      report["window"] = self._window
    self._peers.publish(report)

  def stop(self) -> None:
    """Ends and joins every thread of ours that talks to peers, before the interpreter exits."""
    self._stop.set()
    self._links.stop()
    self._thread.join(timeout=5)
    self._peers.stop()

  def _watch(self) -> None:
    while not self._stop.wait(_REPORT_EVERY_S):
      with self._lock:
        phase, step, timeout_s, since = self.phase, self.step, self.timeout_s, self.since
      self._publish()
      if time.time() - since > timeout_s:
        self._fire(phase, step, timeout_s, time.time() - since)
      if lost := self._peers.lost(time.time()):
        self._exit(
          f"error: process {jax.process_index()} lost contact with {lost} while in {phase} at step {step} "
          f"(watchdog.peer_timeout_s={self._peers.timeout_s:g}): a network partition, or a stopped, "
          "wedged or dead host; exiting so that the job restarts from its newest checkpoint"
        )
      answering = lambda peer, since: self._peers.answering(peer, time.time(), since)  # noqa: E731
      if cut := self._links.cut(time.time(), answering):
        self._exit(
          f"error: {cut}, while both reach the coordination service on process 0; in {phase} at step "
          f"{step} (watchdog.peer_timeout_s={self._links.timeout_s:g}): a network fault between these two "
          "hosts (a route, a firewall, a switch port, or the peer service's port blocked); exiting so "
          "that the job restarts from its newest checkpoint"
        )

  def _fire(self, phase, step, timeout_s, waited) -> None:
    me = jax.process_index()
    lines = [
      f"watchdog: process {me} stuck in {phase} at step {step} for {waited:.0f} s "
      f"(timeout {timeout_s:.0f} s); dumping stacks and exiting"
    ]
    if jax.process_count() > 1:
      mine = {"phase": phase, "step": step, "since": time.time() - waited, "time": time.time()}
      lines += peer_lines(self._peers.reports(), me, mine, time.time(), self.phase_order)
    print("\n".join(lines), file=sys.stderr, flush=True)
    self._exit(lines[0])  # Again, last: the line people look for.

  def _exit(self, line: str) -> None:
    """Every thread's stack to WORKDIR/crashes/process_I.txt (the console if there is none), the
    line last, and exit EXIT_CODE at once (peers blocked on this process must not hold it)."""
    where = self._dump_stacks()
    print(f"{line} (stacks: {where})" if where else line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_CODE)

  def _dump_stacks(self) -> str | None:
    try:
      path = rundir.crash_stacks(self._workdir, jax.process_index())
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
      return path
    except (OSError, TypeError):  # No workdir, or a full or failing disk: the console instead.
      faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
      return None


def peer_lines(
  reports: dict[int, dict | None], me: int, mine: dict, now: float, phase_order: dict[str, int]
) -> list[str]:
  """What every peer was doing, and the suspect: see the module docstring."""
  lines, silent = [], {}
  for peer, r in sorted(reports.items()):
    if r is None:
      lines.append(f"watchdog: process {peer} never reported progress")
      silent[peer] = float("inf")
      continue
    lines.append(
      f"watchdog: process {peer} in {r['phase']} at step {r['step']} for {now - r['since']:.0f} s "
      f"(last report {now - r['time']:.0f} s ago)"
    )
    if now - r["time"] > 3 * _REPORT_EVERY_S:
      silent[peer] = now - r["time"]
  if silent:
    suspect = max(silent, key=silent.get)
    return [*lines, f"watchdog: suspect process {suspect}: it stopped reporting (stopped, wedged or dead)"]
  everyone = {me: mine, **{p: r for p, r in reports.items() if r is not None}}
  progress = {p: (r["step"], phase_order.get(r["phase"], 0)) for p, r in everyone.items()}
  behind = min(progress, key=progress.get)
  ahead = [p for p in everyone if progress[p] > progress[behind]]
  if len(ahead) == len(everyone) - 1 and ahead:  # One process behind all the others.
    r = everyone[behind]
    who = "this process" if behind == me else f"process {behind}"
    lines.append(
      f"watchdog: suspect process {behind}: furthest behind ({who} is in {r['phase']} at step "
      f"{r['step']} for {now - r['since']:.0f} s; every other process is past it)"
    )
  return lines
