"""Ends a process that is stuck, with a report, instead of letting the job hang.

The loop says where it is (`beat(phase, step)`); a thread checks the deadline. Past it, the thread
dumps every Python thread's stack (faulthandler), prints which process is stuck at which step and
phase, names the peer whose progress report is oldest (the likely straggler: a stopped or wedged
process cannot report), and exits non-zero; the launcher or scheduler then ends the rest. Heartbeats
of JAX's distributed service only catch dead processes; this also catches live, stuck ones.
"""

import faulthandler
import json
import os
import sys
import threading
import time

import jax

from trainer import multihost

EXIT_CODE = 3
_REPORT_EVERY_S = 1.0


class Watchdog:
  def __init__(self, startup_timeout_s: float, step_timeout_s: float):
    self.step_timeout_s = step_timeout_s
    self._lock = threading.Lock()
    self._set("startup", 0, startup_timeout_s)
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

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=5)

  def _watch(self) -> None:
    client = multihost.client()
    while not self._stop.wait(_REPORT_EVERY_S):
      with self._lock:
        phase, step, timeout_s, since = self.phase, self.step, self.timeout_s, self.since
      if client is not None:  # Our progress, for a peer's watchdog to read if we stall.
        report = json.dumps({"phase": phase, "step": step, "time": time.time()})
        try:
          client.key_value_set(f"watchdog/{jax.process_index()}", report, allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service may be gone; our own deadline still holds.
          pass
      if time.time() - since > timeout_s:
        self._fire(phase, step, timeout_s, time.time() - since, client)

  def _fire(self, phase, step, timeout_s, waited, client) -> None:
    me = jax.process_index()
    lines = [
      f"watchdog: process {me} stuck in {phase} at step {step} for {waited:.0f} s "
      f"(timeout {timeout_s:.0f} s); dumping stacks and exiting"
    ]
    lines += _peer_reports(client, me) if client is not None else []
    print("\n".join(lines), file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    print(lines[0], file=sys.stderr, flush=True)  # Again after the stacks: the line people look for.
    sys.stdout.flush()
    os._exit(EXIT_CODE)


def _peer_reports(client, me: int) -> list[str]:
  now, reports = time.time(), {}
  for peer in range(jax.process_count()):
    if peer == me:
      continue
    try:
      reports[peer] = json.loads(client.key_value_try_get(f"watchdog/{peer}"))
    except Exception:  # noqa: BLE001 - never reported.
      reports[peer] = None
  lines = []
  for peer, r in reports.items():
    if r is None:
      lines.append(f"watchdog: process {peer} never reported progress")
    else:
      ago = now - r["time"]
      lines.append(
        f"watchdog: process {peer} last reported {r['phase']} at step {r['step']}, {ago:.0f} s ago"
      )
  stale = {p: (now - r["time"] if r else float("inf")) for p, r in reports.items()}
  if stale:
    suspect = max(stale, key=stale.get)
    if stale[suspect] > 3 * _REPORT_EVERY_S:
      lines.append(f"watchdog: suspect process {suspect}: it stopped reporting (stopped, wedged or dead)")
  return lines
