"""Where numbers go: metrics.jsonl and TensorBoard (process 0), processes/process_I.jsonl (every
process), and the console progress line."""

import json
import os
import re
import sys
import time

import jax
import numpy as np

from trainer import rundir


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


def _is_eval_row(row: dict) -> bool:
  return any(k.startswith("eval_") for k in row)


def truncate_jsonl(path: str, after_step: int, drop_eval_at: int | None = None) -> None:
  """Drops rows past `after_step` (a resumed run trains those steps again), the eval row at
  `drop_eval_at` (an evaluation done again) and a line torn by a kill mid-write. Atomic: a kill during
  the rewrite leaves the old file, never a shorter one."""
  if not os.path.exists(path):
    return
  rows = []
  for row in rundir.read_jsonl(path):
    if row.get("step", 0) <= after_step and not (row.get("step") == drop_eval_at and _is_eval_row(row)):
      rows.append(json.dumps(row) + "\n")
  with open(path + ".tmp", "w") as f:
    f.writelines(rows)
  os.replace(path + ".tmp", path)


class MetricsLog:
  """A resumed run (or a rollback) first forgets what it will do again: rows past its step in every
  file, and in TensorBoard through `purge_step` (TensorBoard hides the orphaned events). Each process
  writes its own processes/process_I.jsonl; every run appends a `start` row saying how many processes
  it has, so a file a bigger earlier run left behind is told apart from this run's."""

  def __init__(
    self, workdir: str, resume_step: int, drop_eval_at: int | None = None, process_start: dict | None = None
  ):
    """`process_start`: fields for this process's `start` row (its start-up seconds, say)."""
    self.is_main = jax.process_index() == 0
    self._workdir = workdir
    proc_dir = rundir.processes(workdir)
    os.makedirs(proc_dir, exist_ok=True)
    self._process_path = rundir.process_log(workdir, jax.process_index())
    truncate_jsonl(self._process_path, resume_step)
    self._process = open(self._process_path, "a")
    self._metrics = self._tb = None
    if self.is_main:
      path = rundir.metrics(workdir)
      truncate_jsonl(path, resume_step, drop_eval_at)
      self._metrics = open(path, "a")
      self._tb = self._tensorboard(resume_step)
      processes = jax.process_count()
      found = [re.fullmatch(r"process_(\d+)\.jsonl", name) for name in os.listdir(proc_dir)]
      stale = sorted(i for m in found if m and (i := int(m.group(1))) >= processes)
      self.write({"step": resume_step, "time": time.time(), "event": "start", "processes": processes})
      if stale:
        console(f"processes/: files of processes {stale} are from an earlier run with more processes")
    self.write_process({"step": resume_step, "time": time.time(), "event": "start", **(process_start or {})})

  def _tensorboard(self, after_step: int):
    SummaryWriter = _summary_writer()
    # Event files are named by the second they open in: a resume or rollback within the same second
    # would write over the earlier file, and the suffix keeps them apart.
    suffix = f".{time.time_ns()}"
    return SummaryWriter(rundir.tensorboard(self._workdir), purge_step=after_step + 1, filename_suffix=suffix)

  def truncate(self, after_step: int) -> None:
    """Forgets rows past `after_step` (a rollback trains those steps again)."""
    self._process = self._reopen(self._process, after_step)
    if self.is_main:
      self._metrics = self._reopen(self._metrics, after_step)
      self._tb.close()
      self._tb = self._tensorboard(after_step)

  def last_train_row(self, step: int) -> dict:
    """The train row logged at `step` (process 0; {} elsewhere or if none)."""
    if not self.is_main:
      return {}
    rows = rundir.read_jsonl(self._metrics.name)
    return next((r for r in reversed(rows) if r.get("step") == step and "loss" in r), {})

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
    for k, v in row.items() if "event" not in row else ():
      if k not in ("step", "time") and isinstance(v, int | float):
        self._tb.add_scalar(k, v, row["step"])

  def write_tensorboard(self, step: int, scalars: dict, texts: dict, images: dict) -> None:
    """What a hook wrote (trainer/hooks.py), beside the trainer's own scalars (process 0)."""
    if not self.is_main:
      return
    for k, v in scalars.items():
      self._tb.add_scalar(k, v, step)
    for k, v in texts.items():
      self._tb.add_text(k, v, step)
    for k, v in images.items():
      self._tb.add_image(k, v, step, dataformats="HW" if v.ndim == 2 else "HWC")
    self._tb.flush()

  def write_process(self, row: dict) -> None:
    self._process.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
    self._process.flush()

  def close(self) -> None:
    self._process.close()
    if self.is_main:
      self._metrics.close()
      self._tb.close()


# The clock's phases a window books: where each goes in the window's figures.
_PHASE_FIELDS = {
  "data": "fetch",
  "checkpoint": "checkpoint",
  "eval": "evaluation",
  "hooks": "hooks",
  "profiling": "profiling",
}


class Window:
  """What happened since the last logged step: host timings, and the steps' valid counts in the
  experiment's unit (device scalars, fetched only when the window closes so the loop never waits)."""

  def __init__(self, unit: str):
    self.start = time.time()
    self.unit = unit  # What the loss's count counts: the experiment's UNIT.
    self.steps, self.data_wait, self.fetch, self.dispatch = 0, 0.0, 0.0, 0.0
    # Seconds the loop spent saving, evaluating, in the experiment's hooks and on a profile.
    self.checkpoint = self.evaluation = self.hooks = self.profiling = 0.0
    self.valid_examples = 0
    self.step_counts: list[tuple[int, float]] = []  # fetch_counts(), once the window closes.
    self._counts, self._unchecked = [], []  # Device scalars: (step, count); (step, finite, count).

  def add_step(
    self, step: int, data_wait_s: float, dispatch_s: float, metrics: dict, valid_examples: int
  ) -> None:
    """data_wait_s: blocked because the next batch was not ready (an input stall); dispatch_s: handing
    the step to the devices."""
    self.steps += 1
    self.data_wait += data_wait_s
    self.dispatch += dispatch_s
    self.valid_examples += valid_examples
    self._counts.append((step, metrics["count"]))
    self._unchecked.append((step, metrics["finite"], metrics["count"]))

  def add_phase(self, phase: str, seconds: float) -> None:
    """Seconds the clock booked in a phase inside this window (trainer/observe/clock.py): taking a batch
    (all of it, waiting for the GIL behind other host threads included), and the loop's saving,
    evaluating and profiling, which its rates leave out."""
    if field := _PHASE_FIELDS.get(phase):
      setattr(self, field, getattr(self, field) + seconds)

  def first_nonfinite_step(self) -> tuple[int, bool] | None:
    """(step, empty) for the first step in this window whose loss or gradient norm was NaN or Inf, or
    whose global count was 0 (empty: its batch had no valid element); fetches the flags."""
    flags = jax.device_get(self.unchecked_flags())
    steps = [step for step, _, _ in self._unchecked]
    self._unchecked = []  # Checked; later calls look only at newer steps.
    bad = [(step, float(count) == 0) for step, (ok, count) in zip(steps, flags, strict=True) if not ok]
    return bad[0] if bad else None

  def unchecked_flags(self) -> list:
    """The (finite, count) device scalars of the steps first_nonfinite_step has not checked yet, left
    unchecked: a local-tier copy checks them on its own thread instead of waiting here."""
    return [(finite, count) for _, finite, count in self._unchecked]

  def fetch_counts(self) -> list[tuple[int, float]]:
    """(step, valid count) of every step so far in this window (waits for them to run)."""
    counts = jax.device_get([count for _, count in self._counts])
    return [(s, float(n)) for (s, _), n in zip(self._counts, counts, strict=True)]

  def close(self, step: int, metrics: dict, device_wait_s: float) -> tuple[dict, dict]:
    """(metrics.jsonl row, processes/process_I.jsonl row) for the window ending at `step`: counts
    over all its steps, and rates over its training time (saving and evaluating excluded; the
    process row has both)."""
    now = time.time()
    training = now - self.start - self.checkpoint - self.evaluation - self.hooks - self.profiling
    training = max(training, 1e-9)
    self.step_counts = self.fetch_counts()
    total = sum(n for _, n in self.step_counts)
    row = {
      "step": step,
      "time": now,
      **{k: float(v) for k, v in metrics.items() if k not in ("finite", "count")},
      f"valid_{self.unit}": total,
      "valid_examples": self.valid_examples,
      "step_time_s": training / self.steps,
      "data_wait_s": self.data_wait / self.steps,
      f"{self.unit}_per_s": total / training,
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
      "eval_s": self.evaluation,
      "hooks_s": self.hooks,
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


def _summary_writer():
  """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch wherever it is
  installed, only to accept its tensors (we write numpy), and that took 1.9 s of every start-up in a
  virtual environment that holds torch (python -X importtime main.py ..., 2 cores)."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # `import torch` raises ImportError, as where torch is not installed.
  try:
    from tensorboardX import SummaryWriter
  finally:
    if blocked:
      del sys.modules["torch"]
  return SummaryWriter
