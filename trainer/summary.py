"""The end of a run: summary.json, and the lines that close the console."""

import json
import os

import jax

from trainer.observe import flops, goodput, recovery_time
from trainer.observe.metrics import closing_line, console


def summary(run, loop, split: dict, this_run: dict, wall_s: float) -> dict:
  """summary.json's fields, from the run's set-up (`run`), what its steps did (`loop`) and where the
  time went (goodput's `split` of the whole training, and of `this_run`)."""
  step, unit, devices = loop.step, loop.unit, run.devices
  step_s = this_run["productive_steps"] + this_run["lost_to_rollbacks"]
  run_steps = step - loop.start
  speed = flops.fields(run.flops_per_step, step_s / run_steps, devices) if run_steps and step_s else {}
  return {
    "final_step": step,
    "final_loss": loop.last.get("loss"),
    **loop.eval_row,
    "loss_floor": run.comp.sources.loss_floor,
    "examples_seen": run.comp.plan.examples_before(step + loop.batch_offset),
    f"{unit}_trained_this_run": float(loop.trained.sum()),
    "nonfinite_rollbacks": loop.rollbacks,  # Over the whole run, restarts included.
    "preempted_by": loop.preemption.received,
    "wall_s": wall_s,
    "compile_s": run.startup.get("compile", 0.0),
    "startup_s": run.startup,  # imports, build, init or restore, compile.
    "goodput": split,  # Where every run's wall time went, restarts included (trainer/observe/goodput.py).
    "goodput_this_run": this_run,  # ... and this run's, from process start.
    "recoveries": recovery_time.history(run.workdir) if jax.process_index() == 0 else [],
    "model_flops_per_step": run.flops_per_step,
    "compiled_flops_per_step": run.compiled_flops,  # XLA's count: remat included, a loop's body once.
    "tflops_per_device": speed.get("tflops_per_device"),  # Over this run's steps, all their time.
    "mfu": speed.get("mfu", flops.mfu_label(devices, run.flops_per_step)),
    "devices": run.device_label,
    "processes": jax.process_count(),
  }


def write(path: str, summary: dict) -> None:
  """Process 0 writes it; a kill mid-write leaves no torn summary."""
  if jax.process_index() == 0:
    with open(path + ".tmp", "w") as f:
      json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)


def closing_lines(loop, split: dict, steps: int, floor: float | None) -> None:
  step, received = loop.step, loop.preemption.received
  if received and step < steps:
    console(f"preempted ({received}): saved checkpoint {step}; run the same command to resume")
  elif received:
    console(f"{received} received at the end of training: the run finished anyway")
  if step > loop.start:
    console(goodput.line(split))
  if loop.last and step == steps:
    console(closing_line(step, loop.last, loop.eval_row, floor))
