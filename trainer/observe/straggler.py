"""Names a process that is slower than the others: its data wait or dispatch time per step, or its
link's round trip to the coordination service (trainer/cluster/liveness.py), over a logging window, against
the median of the other processes'. A slow link at process 0's host, where the service runs, slows
every other process's round trip alike, so none stands out there; one elsewhere is named.

Every process publishes its window's figures in the same progress report its watchdog publishes
(trainer/cluster/watchdog.py), and process 0 compares the latest of each. Device time is the same on every
process of a synchronous job (each waits in its collectives for the slowest), so a slow device shows
in the profile window's per-process compute time, not here; what shows here is a host that is late
with its batches or its dispatch.
"""

import statistics

import jax

from trainer.observe.metrics import console

MEASURES = {"data_s": "data wait", "dispatch_s": "step dispatch", "link_s": "link round trip"}
PER = {"data_s": "s/step", "dispatch_s": "s/step", "link_s": "s"}


def find(windows: dict[int, dict], factor: float, min_s: float) -> list[tuple[int, str, float, float, int]]:
  """[(process, measure, its seconds per step, the others' median, window's last step)] for each
  process whose measure exceeds factor x the median of the others' and the median by min_s."""
  if factor <= 0 or len(windows) < 2:
    return []
  found = []
  for measure in MEASURES:
    for p, w in sorted(windows.items()):
      if measure not in w:
        continue
      median = statistics.median(o.get(measure, 0.0) for q, o in windows.items() if q != p)
      if w[measure] > factor * median and w[measure] - median > min_s:
        found.append((p, measure, w[measure], median, w["step"]))
  return found


def line(process: int, measure: str, seconds: float, median: float, step: int, factor: float) -> str:
  return (
    f"straggler: process {process}'s {MEASURES[measure]} is {seconds:.3f} {PER[measure]} against a median "
    f"of {median:.3f} {PER[measure]} on the other processes (window ending at step {step}; "
    f"straggler.factor={factor:g})"
  )


def report(watchdog, window, step: int, config, seen: set) -> dict:
  """Publishes this process's window; on process 0, names a process slower than the others (one line
  when it starts being one) and returns {"stragglers": [process, ...]} for the metrics row."""
  n = max(window.steps, 1)
  watchdog.note_window(
    {
      "step": step,
      "data_s": window.fetch / n,
      "dispatch_s": window.dispatch / n,
      "link_s": watchdog.link_round_trip_s(),
    }
  )
  if jax.process_index() != 0 or jax.process_count() == 1:
    return {}
  found = find(watchdog.peer_windows(), config.factor, config.min_s)
  for process, measure, seconds, median, at in found:
    if (process, measure) not in seen:
      console(line(process, measure, seconds, median, at, config.factor))
  seen.clear()
  seen.update((p, m) for p, m, *_ in found)
  return {"stragglers": sorted({p for p, *_ in found})} if found else {}
