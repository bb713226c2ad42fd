"""The profile window: a JAX profiler trace of a few steps on every process, read back into where each
device's time went: compute, each collective kind, waiting for peers inside a collective, and idle.

The trace (WORKDIR/profile/process_I/plugins/profile/*/HOST.xplane.pb, and HOST.trace.json.gz beside
it) opens in TensorBoard's profile plugin (`tensorboard --logdir WORKDIR/profile`, with the
tensorboard-plugin-profile package) or, the .json.gz, in ui.perfetto.dev. Reading it back uses
jax.profiler.ProfileData: op events carry their HLO op name, and their device:
- XLA:CPU: on the host plane, every executed op ("thunk") has `hlo_op` and `device_ordinal` stats,
  and a collective's wait for the other devices is a `Rendezvous` event inside it (shown apart as
  wait). All logical devices share the process's cores: a device's compute time includes waiting for
  a core, and collectives are copies in memory, not transfers over a link.
- GPUs and TPUs: one plane per device (/device:GPU:N) whose "XLA Ops" line holds the ops. A
  collective's time includes any wait for peers (no separate wait), and compute and collectives may
  overlap: overlapped time counts as collective.
Per device, time in the window is split by priority (wait, then collective, then compute); idle is
the rest of the window's span: the device ran nothing (the host was fetching data, logging, or
behind).
"""

import contextlib
import glob
import os
import re
import time

import jax

from trainer import rundir
from trainer.cluster import multihost
from trainer.observe.collectives import KINDS
from trainer.observe.metrics import console

CPU_NOTE = (
  "logical CPU devices share this process's cores: compute includes waiting for a core, and "
  "collectives are memory copies between threads (their wait for the other devices is shown apart)"
)
_DEVICE_PLANE = re.compile(r"/device:(?:GPU|TPU):(\d+)$")
_WAIT_EVENTS = ("Rendezvous",)
TOP_OPS = 8  # The ops a profile row lists by time (the console shows the first 3 of process 0).


def collective_kind(op_name: str) -> str | None:
  """'all-reduce' for 'all-reduce.3', 'all-gather-start.1', ...; None for compute ops."""
  return next((k for k in KINDS if op_name.startswith(k)), None)


def _union(intervals):
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return merged


def _length(union) -> float:
  return sum(end - start for start, end in union)


def _overlap(a, b) -> float:
  """Length of the intersection of two unions."""
  i = j = 0
  total = 0.0
  while i < len(a) and j < len(b):
    lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    total += max(hi - lo, 0)
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return total


def op_name(text: str) -> str:
  """An HLO op's name from a trace event: 'fusion.12' for '%fusion.12 = (bf16[...]) fusion(...)' (TPU
  events carry the whole instruction) or 'fusion.12'."""
  return text.split(" = ", 1)[0].strip().lstrip("%")


def _device_events(xspace_path: str) -> dict[int, list[tuple[str, float, float, str]]]:
  """{local device ordinal: [(class, start_s, end_s, op)]}, class 'compute', 'wait' or a collective
  kind, op the HLO op's name (a wait: its collective's)."""
  from jax.profiler import ProfileData

  events: dict[int, list] = {}
  for plane in ProfileData.from_file(xspace_path).planes:
    device = _DEVICE_PLANE.search(plane.name)
    for line in plane.lines:
      if device and line.name != "XLA Ops":
        continue
      current = None  # The op event a Rendezvous event on this CPU thread falls in: (device, end).
      for e in sorted(line.events, key=lambda e: e.start_ns):
        start, end = e.start_ns / 1e9, (e.start_ns + e.duration_ns) / 1e9
        if device:
          kind = collective_kind(op_name(e.name)) or "compute"
          events.setdefault(int(device[1]), []).append((kind, start, end, op_name(e.name)))
          continue
        stats = dict(e.stats)
        if "hlo_op" in stats and "device_ordinal" in stats:
          ordinal, op = int(stats["device_ordinal"]), op_name(str(stats["hlo_op"]))
          events.setdefault(ordinal, []).append((collective_kind(op) or "compute", start, end, op))
          current = (ordinal, end, op)
        elif e.name in _WAIT_EVENTS and current and start < current[1]:
          events[current[0]].append(("wait", start, min(end, current[1]), current[2]))
  return events


def split(xspace_path: str, steps: int) -> dict:
  """Per device (global id) and on average, seconds per step: compute, each collective kind, wait
  and idle, which sum to the window's span; with a note on what this backend's trace can show."""
  by_ordinal = _device_events(xspace_path)
  local = jax.local_devices()
  if not by_ordinal:
    return {"note": "the trace has no per-device op events: this backend records no XLA ops in it"}
  spans = [t for evs in by_ordinal.values() for _, s, e, _ in evs for t in (s, e)]
  span = max(spans) - min(spans)
  devices = {}
  for ordinal, evs in sorted(by_ordinal.items()):
    wait = _union([(s, e) for c, s, e, _ in evs if c == "wait"])
    row = {"wait_s": _length(wait) / steps}
    taken = wait
    for kind in KINDS:
      mine = _union([(s, e) for c, s, e, _ in evs if c == kind])
      if mine:
        row[f"{kind}_s"] = (_length(mine) - _overlap(mine, taken)) / steps
        taken = _union(taken + mine)
    compute = _union([(s, e) for c, s, e, _ in evs if c == "compute"])
    row["compute_s"] = (_length(compute) - _overlap(compute, taken)) / steps
    busy = _union(taken + compute)
    row["idle_s"] = (span - _length(busy)) / steps
    device = local[ordinal].id if ordinal < len(local) else ordinal
    devices[str(device)] = {k: round(v, 6) for k, v in row.items()}
  keys = sorted({k for row in devices.values() for k in row})
  mean = {k: round(sum(r.get(k, 0.0) for r in devices.values()) / len(devices), 6) for k in keys}
  cpu = jax.devices()[0].platform == "cpu"
  return {
    "span_s": round(span / steps, 6),
    "devices": devices,
    "mean": mean,
    "top_ops": top_ops(by_ordinal, steps),
    "note": CPU_NOTE if cpu else "",
  }


def top_ops(by_ordinal: dict, steps: int, n: int = TOP_OPS) -> list[dict]:
  """The `n` HLO ops that took the most time, seconds per step averaged over the devices (a
  collective's time includes its wait for the other devices)."""
  seconds: dict[str, float] = {}
  for evs in by_ordinal.values():
    for kind, start, end, op in evs:
      if kind != "wait":
        seconds[op] = seconds.get(op, 0.0) + end - start
  scale = 1 / (steps * len(by_ordinal))
  ranked = sorted(seconds.items(), key=lambda item: -item[1])[:n]
  return [{"op": op, "s": round(t * scale, 6)} for op, t in ranked]


class ProfileWindow:
  """Traces global steps start_step+1 .. start_step+steps (profile.* keys), once: a run resumed past
  start_step takes none. The window waits for the devices at both ends, so no step outside it is in
  it; what the loop does between its steps (saving, evaluating, checks) is."""

  def __init__(self, profile_config, workdir: str, first_step: int):
    self.first, self.steps = profile_config.start_step, profile_config.steps
    self.on = self.steps > 0 and self.first >= first_step
    self.directory = rundir.profile(workdir, jax.process_index())
    self.active = False

  def starts_after(self, step: int) -> bool:
    return self.on and not self.active and step == self.first

  def start(self, state) -> None:
    """Starts the trace once the devices have run everything before it."""
    jax.block_until_ready(state)
    # No Python tracer: the split reads device ops only, and tracing every Python thread (Grain's,
    # Orbax's) slows the host side the window measures; it also crashed a long-lived test process.
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(self.directory, profiler_options=options)
    self.active = True

  def annotation(self, step: int):
    return (
      jax.profiler.StepTraceAnnotation("train", step_num=step) if self.active else contextlib.nullcontext()
    )

  def ends_after(self, step: int) -> bool:
    return self.active and step == self.first + self.steps

  def stop(self, state) -> dict:
    """Stops the trace at the window's end and reads it back into a processes/process_I.jsonl row."""
    jax.block_until_ready(state)
    self.abort()
    step = self.first + self.steps
    row = {"step": step, "time": time.time(), "event": "profile", "steps": [self.first + 1, step]}
    traces = glob.glob(os.path.join(self.directory, "**", "*.xplane.pb"), recursive=True)
    if traces:  # Every process returns a row, trace or not: each then makes the same gather call.
      newest = max(traces, key=os.path.getmtime)
      row.update(trace=newest, **split(newest, self.steps))
    else:
      row["note"] = f"the profiler wrote no trace under {self.directory}"
    return row

  def abort(self) -> None:
    """Stops the trace, if one runs, for good: the run ended, or a rollback left the window."""
    if self.active:
      jax.profiler.stop_trace()
    self.active, self.on = False, False


def table(rows: dict[int, dict], label: str) -> list[str]:
  """The console table: one line per process, seconds per step averaged over its devices."""
  kinds = [
    k
    for k in ("compute_s", *(f"{k}_s" for k in KINDS), "wait_s", "idle_s")
    if any(k in r.get("mean", {}) for r in rows.values())
  ]
  first = next(iter(rows.values()))
  lines = [
    f"profile of steps {first['steps'][0]}..{first['steps'][1]}, ms per step, mean over each process's "
    f"devices ({label}):",
    "process " + " ".join(f"{k[:-2]:>18}" for k in kinds),
  ]
  for p, r in sorted(rows.items()):
    if "mean" not in r:
      lines.append(f"{p:>7} {r.get('note', '')}")
      continue
    lines.append(f"{p:>7} " + " ".join(f"{1e3 * r['mean'].get(k, 0.0):>18.2f}" for k in kinds))
  ops = rows[min(rows)].get("top_ops", [])[:3]
  if ops:
    lines.append("largest ops, process 0: " + ", ".join(f"{o['op']} {1e3 * o['s']:.2f}" for o in ops))
  if first.get("note"):
    lines.append(f"note: {first['note']}")
  return lines


def print_table(row: dict, timeout_s: float, label: str) -> None:
  """Every process's split of the profile window, as one table on process 0's console."""
  rows = multihost.gather("profile", {k: v for k, v in row.items() if k != "devices"}, timeout_s)
  for line in table(rows, label):
    console(line)
