"""Where numbers go: metrics.jsonl and TensorBoard (process 0), processes/process_I.jsonl (every
process), and the console progress line."""

import json
import os
import time

import jax
import numpy as np


def device_label(devices=None) -> str:
  """'8 x cpu (logical CPU devices ...)' or '8 x NVIDIA H200': every report says which it is."""
  devices = jax.devices() if devices is None else devices
  kind = devices[0].device_kind
  if devices[0].platform == "cpu":
    return f"{len(devices)} x cpu (logical CPU devices: timings say nothing about a real interconnect)"
  return f"{len(devices)} x {kind}"


def _jsonable(v):
  if isinstance(v, np.generic | np.ndarray | jax.Array):
    return np.asarray(v).item()
  return v


def truncate_jsonl(path: str, after_step: int) -> None:
  """Drops rows past `after_step` (a resumed run trains those steps again) and a line torn by a kill
  mid-write. Atomic: a kill during the rewrite leaves the old file, never a shorter one."""
  if not os.path.exists(path):
    return
  rows = []
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if row.get("step", 0) <= after_step:
        rows.append(json.dumps(row) + "\n")
  with open(path + ".tmp", "w") as f:
    f.writelines(rows)
  os.replace(path + ".tmp", path)


class MetricsLog:
  def __init__(self, workdir: str, resume_step: int):
    self.is_main = jax.process_index() == 0
    proc_dir = os.path.join(workdir, "processes")
    os.makedirs(proc_dir, exist_ok=True)
    self._process_path = os.path.join(proc_dir, f"process_{jax.process_index()}.jsonl")
    truncate_jsonl(self._process_path, resume_step)
    self._process = open(self._process_path, "a")
    self._metrics = self._tb = None
    if self.is_main:
      from tensorboardX import SummaryWriter

      path = os.path.join(workdir, "metrics.jsonl")
      truncate_jsonl(path, resume_step)
      self._metrics = open(path, "a")
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def truncate(self, after_step: int) -> None:
    """Forgets rows past `after_step` (a rollback trains those steps again)."""
    self._process = self._reopen(self._process, after_step)
    if self.is_main:
      self._metrics = self._reopen(self._metrics, after_step)

  @staticmethod
  def _reopen(f, after_step: int):
    f.close()  # The rewrite replaces the file: appends must go to the new one.
    truncate_jsonl(f.name, after_step)
    return open(f.name, "a")

  def write(self, row: dict) -> None:
    """One metrics row (process 0 writes; the others ignore it)."""
    if not self.is_main:
      return
    row = {k: _jsonable(v) for k, v in row.items()}
    self._metrics.write(json.dumps(row) + "\n")
    self._metrics.flush()
    for k, v in row.items():
      if k not in ("step", "time") and isinstance(v, int | float):
        self._tb.add_scalar(k, v, row["step"])

  def write_process(self, row: dict) -> None:
    self._process.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
    self._process.flush()

  def close(self) -> None:
    self._process.close()
    if self.is_main:
      self._metrics.close()
      self._tb.close()


class Window:
  """What happened since the last logged step: host timings, and the steps' valid counts in the
  experiment's unit (device scalars, fetched only when the window closes so the loop never waits)."""

  def __init__(self, unit: str):
    self.start = time.time()
    self.unit = unit  # What the loss's count counts: the experiment's UNIT.
    self.steps, self.data_wait, self.fetch, self.dispatch, self.checkpoint = 0, 0.0, 0.0, 0.0, 0.0
    self.count = 0.0
    self._counts, self._unchecked = [], []  # Device scalars: every step's count; (step, finite, count).

  def add_step(self, step: int, data_wait_s: float, fetch_s: float, dispatch_s: float, metrics: dict) -> None:
    """data_wait_s: blocked because the next batch was not ready (an input stall); fetch_s: all the
    time taking it, including waiting for the GIL behind other host threads."""
    self.steps += 1
    self.data_wait += data_wait_s
    self.fetch += fetch_s
    self.dispatch += dispatch_s
    self._counts.append(metrics["count"])
    self._unchecked.append((step, metrics["finite"], metrics["count"]))

  def first_nonfinite_step(self) -> tuple[int, bool] | None:
    """(step, empty) for the first step in this window whose loss or gradient norm was NaN or Inf, or
    whose global count was 0 (empty: its batch had no valid element); fetches the flags."""
    flags = jax.device_get([(finite, count) for _, finite, count in self._unchecked])
    steps = [step for step, _, _ in self._unchecked]
    self._unchecked = []  # Checked; later calls look only at newer steps.
    bad = [(step, float(count) == 0) for step, (ok, count) in zip(steps, flags, strict=True) if not ok]
    return bad[0] if bad else None

  def close(self, step: int, metrics: dict, valid_examples: int, device_wait_s: float) -> tuple[dict, dict]:
    """(metrics.jsonl row, processes/process_I.jsonl row) for the window ending at `step`."""
    now = time.time()
    elapsed = now - self.start
    self.count = float(sum(jax.device_get(self._counts)))
    row = {
      "step": step,
      "time": now,
      **{k: float(v) for k, v in metrics.items() if k not in ("finite", "count")},
      f"valid_{self.unit}": float(metrics["count"]),
      "valid_examples": valid_examples,
      "step_time_s": elapsed / self.steps,
      "data_wait_s": self.data_wait / self.steps,
      f"{self.unit}_per_s": self.count / elapsed,
    }
    process_row = {
      "step": step,
      "time": now,
      "process": jax.process_index(),
      "steps": self.steps,
      "data_wait_s": self.data_wait,
      "batch_fetch_s": self.fetch,
      "dispatch_s": self.dispatch,
      "device_wait_s": device_wait_s,
      "checkpoint_block_s": self.checkpoint,
    }
    return row, process_row


def console(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)


def progress_line(step: int, total: int, loss: float, unit: str, per_s: float, eta_s: float) -> str:
  return (
    f"step {step}/{total}  loss {loss:.4f}  {unit}/s {per_s:,.0f}  "
    f"eta {int(eta_s) // 60}m{int(eta_s) % 60:02d}s"
  )


def closing_line(step: int, last: dict, eval_row: dict, floor: float | None) -> str:
  """The run's last line: final step and loss, eval loss, and the floor with the gap where known."""
  line = f"final step {step}: loss {last['loss']:.4f}"
  if eval_row:
    line += "  " + eval_line(eval_row)
  if floor is not None:
    line += f"  floor {floor:.4f}  gap {last['loss'] - floor:+.4f}"
  return line


def eval_line(eval_row: dict) -> str:
  """'eval_loss 3.0566  eval_accuracy 0.1234': the held-out loss and the experiment's metrics."""
  return "  ".join(
    f"{k} {v:.4f}" for k, v in eval_row.items() if k.startswith("eval_") and isinstance(v, float)
  )
