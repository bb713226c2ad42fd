"""Plots of a run, from what it wrote: loss and eval loss, throughput, each process's step-time
breakdown and the goodput split, as PNGs in WORKDIR/report (or --out):

  .venv/bin/python -m trainer.observe.report --workdir=runs/smoke

- loss.png: train loss per logged step, eval loss, the data's loss floor where known; a dashed line
  where a run resumed (metrics.jsonl's `start` rows), so a run resumed several times reads as one.
- throughput.png: the experiment's unit per second per logged window (and TFLOP/s per device).
- step_time.png: per process (processes/process_I.jsonl), seconds per step by where the host spent
  them: waiting for data, dispatching, waiting for the devices, blocked saving, evaluating.
- goodput.png: summary.json's split of every run's wall time, restarts included (trainer/observe/goodput.py).
Reads only the files; needs no JAX. Every plot's title carries summary.json's device label.
"""

import argparse
import glob
import os
import re
import sys

from errors import UserError
from trainer import rundir

BREAKDOWN = (
  ("data_wait_s", "data wait"),
  ("dispatch_s", "dispatch"),
  ("device_wait_s", "device wait"),
  ("checkpoint_block_s", "checkpoint blocking"),
  ("eval_s", "evaluation"),
)


def _load(workdir: str) -> dict:
  metrics = rundir.read_jsonl(rundir.metrics(workdir), required=("step",))
  if not metrics:
    raise UserError(f"{workdir}/metrics.jsonl is missing or empty: is --workdir a run directory?")
  summary = rundir.read_json_object(rundir.summary(workdir)) or {}
  processes = {}
  for path in glob.glob(rundir.process_log(workdir, "*")):
    processes[int(re.search(r"process_(\d+)", path)[1])] = rundir.read_jsonl(path, required=("step",))
  return {"metrics": metrics, "summary": summary, "processes": processes}


def _step_breakdown(rows: list[dict]) -> dict[str, float]:
  """Seconds per step over a process's logged windows (its latest run's rows: after its last start)."""
  starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
  windows = [r for r in rows[starts[-1] if starts else 0 :] if "steps" in r and "event" not in r]
  steps = sum(r["steps"] for r in windows) or 1
  out = {key: sum(r.get(key, 0.0) for r in windows) / steps for key, _ in BREAKDOWN}
  # The loop's whole wait for its batch (data_wait_s is the part where none was ready), as goodput counts.
  out["data_wait_s"] = sum(r.get("batch_fetch_s", 0.0) for r in windows) / steps
  return out


def plot(workdir: str, out: str) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  run = _load(workdir)
  summary, metrics = run["summary"], run["metrics"]
  label = summary.get("devices", "devices unknown (no summary.json yet)")
  train = [r for r in metrics if "loss" in r and "event" not in r]
  evals = [r for r in metrics if "eval_loss" in r]
  restarts = [r["step"] for r in metrics if r.get("event") == "start" and r["step"] > 0]
  unit = next((k[: -len("_per_s")] for k in (train[0] if train else {}) if k.endswith("_per_s")), "units")
  os.makedirs(out, exist_ok=True)
  written = []

  def save(fig, name):
    fig.suptitle(f"{os.path.basename(os.path.abspath(workdir))}: {label}", fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
  if evals:
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
  if summary.get("loss_floor") is not None:
    ax.axhline(summary["loss_floor"], color="grey", ls=":", label=f"floor {summary['loss_floor']:.4f}")
  for i, s in enumerate(restarts):
    ax.axvline(s, color="red", ls="--", lw=0.8, label="resumed" if i == 0 else None)
  ax.set(xlabel="step", ylabel="loss", title="loss")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  save(fig, "loss.png")

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot([r["step"] for r in train], [r.get(f"{unit}_per_s", 0.0) for r in train], label=f"{unit}/s")
  ax.set(xlabel="step", ylabel=f"{unit}/s", title="throughput per logged window")
  if any("tflops_per_device" in r for r in train):
    twin = ax.twinx()
    twin.plot(
      [r["step"] for r in train], [r.get("tflops_per_device", 0.0) for r in train], "g:", label="TFLOP/s"
    )
    twin.set_ylabel("model TFLOP/s per device")
  for s in restarts:
    ax.axvline(s, color="red", ls="--", lw=0.8)
  ax.grid(alpha=0.3)
  save(fig, "throughput.png")

  fig, ax = plt.subplots(figsize=(7, 4))
  procs = sorted(run["processes"])
  parts = {p: _step_breakdown(run["processes"][p]) for p in procs}
  bottom = [0.0] * len(procs)
  for key, name in BREAKDOWN:
    values = [1e3 * parts[p][key] for p in procs]
    ax.bar([str(p) for p in procs], values, bottom=bottom, label=name)
    bottom = [b + v for b, v in zip(bottom, values, strict=True)]
  ax.set(xlabel="process", ylabel="ms per step", title="where each process's step time went (host view)")
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
  save(fig, "step_time.png")

  split = summary.get("goodput")
  if isinstance(split, dict) and "goodput" in split:
    from trainer.observe.goodput import CATEGORIES

    fig, ax = plt.subplots(figsize=(10, 2.8))
    left = 0.0
    for category in (*CATEGORIES, "unaccounted_s"):
      width = max(split.get(category, 0.0), 0.0)
      if width > 0:
        ax.barh([0], [width], left=left, label=f"{category.replace('_', ' ')} {width:.1f} s")
        left += width
    ax.set(xlabel="seconds", yticks=[], title=f"every run's wall time: goodput {100 * split['goodput']:.0f}%")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    save(fig, "goodput.png")
  return written


def main(argv=None) -> list[str]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a run directory (main.py's --workdir)")
  parser.add_argument("--out", default=None, help="where the PNGs go (default WORKDIR/report)")
  args = parser.parse_args(argv)
  try:
    written = plot(args.workdir, args.out or rundir.report(args.workdir))
  except UserError as e:
    raise SystemExit(f"error: {e}") from None
  for path in written:
    print(f"wrote {path}")
  return written


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
