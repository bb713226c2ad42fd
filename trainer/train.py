"""The training loop: one function, read top to bottom."""

import json
import os
import time

import jax

from data import pipeline
from errors import UserError
from trainer import checkpointing, components, multihost
from trainer import state as state_lib
from trainer.evaluate import evaluate
from trainer.metrics import MetricsLog, Window, closing_line, console, device_label, eval_line, progress_line
from trainer.preemption import Preemption
from trainer.step import make_eval_step, make_train_step
from trainer.watchdog import Watchdog


def empty_batch_error(t: int) -> UserError:
  return UserError(f"global batch {t} has no valid examples (all weights 0); refusing an empty step")


def train(config, workdir: str, stop_after: int | None = None, devices=None) -> dict:
  """Trains to `config.steps` in `workdir`, resuming from its newest checkpoint; returns the summary.

  `stop_after` ends the run early at that step, as an interruption would (the schedule still
  targets config.steps), after saving a checkpoint there. `devices` defaults to all devices.
  """
  t_start = time.time()
  os.makedirs(workdir, exist_ok=True)
  watchdog = Watchdog(config.watchdog.startup_timeout_s, config.watchdog.step_timeout_s)
  try:
    return _train(config, workdir, stop_after, devices, watchdog, t_start)
  finally:
    watchdog.stop()


def _train(config, workdir, stop_after, devices, watchdog, t_start) -> dict:
  # --- Setup: mesh, experiment, data order, optimizer, shardings (config errors surface here).
  comp = components.build(config, devices)
  meta = checkpointing.run_metadata(comp, config)
  agreed = {
    "config": json.loads(config.to_json()),
    "data": comp.sources.fingerprint,  # The same data.path may hold other files on another host.
    "code": meta["git_revision"],
    "versions": meta["versions"],
  }
  multihost.check_agreement(agreed, timeout_s=config.watchdog.startup_timeout_s)
  b = config.global_batch_size
  console(f"devices: {device_label(comp.mesh.devices.flatten())}; mesh {dict(comp.mesh.shape)}")
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=2))
  init = lambda: components.init_state(comp, config)

  # --- State: the newest checkpoint that restores (onto this mesh), else a fresh sharded init.
  c = config.checkpoint
  ckpt = checkpointing.Checkpoints(workdir, c.keep, c.keep_every, c.replica_parallel)
  target = state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx)

  def restore_or_init():
    """(state, batch_offset): the offset counts batches skipped by NaN rollbacks."""
    restored = ckpt.restore_latest(target)
    if restored is None:
      return init(), 0
    state, position, step = restored
    checkpointing.check_data_position(position, step, comp, config.data.allow_changed_data)
    return state, position["batch_offset"]

  state, batch_offset = restore_or_init()
  start = int(state.step)
  last_step = config.steps if stop_after is None else min(stop_after, config.steps)
  if start >= last_step:  # Nothing to train: leave the run's outputs as they are.
    ckpt.close()
    console(f"already trained to step {start} (config.steps={config.steps}); nothing to do")
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
      return {"final_step": start}
    with open(path) as f:
      return json.load(f)
  if start:
    console(f"resumed from checkpoint {start}")
  console(f"params: {state_lib.param_count(state.params):,}; steps {start} -> {config.steps}")

  # --- Compile ahead of time, so compile time is measured apart from step time.
  t0 = time.time()
  local_batches = components.local_batches(comp)
  batch_spec = pipeline.global_spec(local_batches(start + batch_offset), comp.batch_sharding, b)
  train_step = make_train_step(comp, config.microbatches)
  eval_step = make_eval_step(comp)
  with jax.set_mesh(comp.mesh):
    train_step = train_step.lower(state, batch_spec).compile()
  compile_s = time.time() - t0

  # --- The loop. Batches are prepared ahead by Grain threads and copied to the devices ahead.
  log = MetricsLog(workdir, resume_step=start)

  def open_batches(step):
    first = step + batch_offset  # Global batch t trains step t - batch_offset + 1.
    d = config.data
    it = pipeline.local_batch_iterator(
      local_batches, first, last_step + batch_offset, d.read_threads, d.prefetch, d.worker_processes
    )
    return pipeline.DevicePrefetch(it, comp.batch_sharding, b, depth=d.prefetch)

  batches, preemption = open_batches(start), Preemption()
  unit = comp.experiment.UNIT
  window, last, eval_row, counted, rollbacks = Window(unit), {}, {}, 0.0, 0
  step = start
  try:
    while step < last_step:
      # The run's first step waits in its collectives for peers still compiling: start-up's budget.
      first = config.watchdog.startup_timeout_s if step == start else None
      watchdog.beat("step", step + 1, first)
      t0 = time.time()
      t, local, batch = next(batches)
      assert t == step + batch_offset, (t, step, batch_offset)  # The data position is the step.
      # A globally empty batch never reaches the devices. Rows are known globally from the plan; weights
      # are known here only for this process's rows (with several processes, a count of 0 shows as a
      # non-finite step below).
      if comp.plan.valid_rows(t) == 0 or (jax.process_count() == 1 and not local["weights"].any()):
        raise empty_batch_error(t)
      t1 = time.time()
      state, metrics = train_step(state, batch)
      step += 1
      window.add_step(
        step, batches.last_starved_s, fetch_s=t1 - t0, dispatch_s=time.time() - t1, metrics=metrics
      )
      ckpt.poll()  # A background save's error surfaces here, at the next step.

      # Same decisions on every process: the step count and the agreed preemption step.
      stop = preemption.should_stop(step)
      log_now = step % config.log_every == 0 or step == last_step or stop
      save_now = step % config.checkpoint.every == 0 or step == last_step or stop
      if (log_now or save_now) and (found := window.first_nonfinite_step()) is not None:
        # Never log past, or save, a non-finite state.
        bad, empty = found
        if empty:  # With several processes no one process knows it before the step: the same error.
          raise empty_batch_error(bad - 1 + batch_offset)
        lo = step - window.steps + 1
        if config.checkpoint.on_nonfinite != "rollback" or rollbacks >= config.checkpoint.max_rollbacks:
          raise UserError(
            f"loss or gradient norm is NaN/Inf at step {bad} (window {lo}..{step}); lower "
            f"optimizer.learning_rate, or set checkpoint.on_nonfinite=rollback"
          )
        rollbacks += 1
        batches.close()
        ckpt.wait()
        old_offset = batch_offset
        state, _ = restore_or_init()
        good = int(state.step)
        # Steps good+1..bad trained batches good+old_offset..bad-1+old_offset: skip them. The offset
        # builds on the current one, not the checkpoint's, so earlier skips since that save stay skipped.
        batch_offset = old_offset + bad - good
        log.truncate(good)
        event = {"step": good, "time": time.time(), "event": "nonfinite_rollback", "nonfinite_step": bad}
        log.write({**event, "skipped_batches": [good + old_offset, bad - 1 + old_offset]})
        console(f"step {bad}: NaN/Inf; rolled back to step {good}, skipping {bad - good} batches")
        step, window = good, Window(unit)
        batches = open_batches(step)
        continue

      if log_now:
        metrics = jax.device_get(metrics)  # Blocks until this step has run on the device.
        row, process_row = window.close(step, metrics, comp.plan.valid_rows(t), time.time() - t1)
        row["batch"] = t  # The data position this step trained on: checkable after any restart.
        log.write(row)
        for record in [process_row, *ckpt.drain()]:
          log.write_process(record)
        eta = (config.steps - step) * row["step_time_s"]
        console(progress_line(step, config.steps, row["loss"], unit, row[f"{unit}_per_s"], eta))
        last, counted, window = row, counted + window.count, Window(unit)

      if save_now:
        watchdog.beat("checkpoint", step)
        t3 = time.time()
        position = checkpointing.data_position(step, batch_offset, comp)
        ckpt.save(step, state, position, config, meta)  # Async: the write goes on in the background.
        window.checkpoint += time.time() - t3

      if config.eval_every and step % config.eval_every == 0 and step != config.steps:
        watchdog.beat("eval", step)
        eval_row = evaluate(comp, eval_step, state.params, config)
        log.write({"step": step, "time": time.time(), **eval_row})
        console(f"step {step}/{config.steps}  {eval_line(eval_row)}")

      if stop:
        break
  finally:
    batches.close()
    preemption.restore_handlers()
    watchdog.beat("checkpoint", step)
    ckpt.wait()  # Even on an error: a good checkpoint in flight is finished, not left half-written.

  # --- The end: final evaluation, wait for the last write, summary.
  watchdog.beat("finish", step)
  if config.eval_steps and step == config.steps:
    eval_row = evaluate(comp, eval_step, state.params, config)
    log.write({"step": step, "time": time.time(), **eval_row})
  ckpt.close()
  for record in ckpt.drain():
    log.write_process(record)
  log.close()
  summary = {
    "final_step": step,
    "final_loss": last.get("loss"),
    **eval_row,
    "loss_floor": comp.sources.loss_floor,
    "examples_seen": comp.plan.examples_before(step + batch_offset),
    f"{unit}_trained_this_run": counted,
    "nonfinite_rollbacks": rollbacks,
    "preempted_by": preemption.received,
    "wall_s": time.time() - t_start,
    "compile_s": compile_s,
    "devices": device_label(comp.mesh.devices.flatten()),
  }
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  multihost.barrier("end_of_training", timeout_s=config.watchdog.step_timeout_s)
  if preemption.received:
    console(f"preempted ({preemption.received}): saved checkpoint {step}; run the same command to resume")
  if last and step == config.steps:
    console(closing_line(step, last, eval_row, comp.sources.loss_floor))
  return summary
