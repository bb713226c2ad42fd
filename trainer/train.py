"""The training loop: one function, read top to bottom."""

import json
import os
import time

import jax
import numpy as np

from data import pipeline
from trainer import checkpointing, components
from trainer import state as state_lib
from trainer.errors import UserError
from trainer.metrics import MetricsLog, Window, console, device_label, progress_line
from trainer.step import make_eval_step, make_train_step


def evaluate(comp: components.Components, eval_step, params, config) -> dict:
  """Held-out loss over `eval_steps` batches: sums and counts added up, divided once."""
  local = components.local_batches(comp, config, "eval")
  totals = None
  for t in range(config.eval_steps):
    batch = pipeline.to_global(local(t), comp.batch_sharding, comp.plan.global_batch_size)
    with jax.set_mesh(comp.mesh):
      sums = eval_step(params, batch)
    totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
  totals = jax.device_get(totals)
  count = float(totals.pop("count"))
  return {f"eval_{k}": float(v) / count for k, v in totals.items()}


def train(config, workdir: str, stop_after: int | None = None) -> dict:
  """Trains to `config.steps` in `workdir`, resuming from its newest checkpoint; returns the summary.

  `stop_after` ends the run early at that step, as an interruption would (the schedule still
  targets config.steps), after saving a checkpoint there.
  """
  t_start = time.time()
  os.makedirs(workdir, exist_ok=True)

  # --- Setup: mesh, experiment, data order, optimizer, shardings (config errors surface here).
  comp = components.build(config)
  b = config.global_batch_size
  console(f"devices: {device_label()}; mesh {dict(comp.mesh.shape)}")
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=2))

  # --- State: the newest complete checkpoint, else a fresh sharded init.
  manager = checkpointing.make_manager(workdir, config.checkpoint.keep)
  latest = manager.latest_step()
  if latest is None:
    state = state_lib.init_state(
      lambda rngs: comp.experiment.build_model(config, rngs),
      comp.mdef,
      comp.tx,
      comp.shardings,
      config.seed,
    )
  else:
    target = state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx)
    state, position = checkpointing.restore(manager, latest, target)
    checkpointing.check_data_position(position, latest, comp, config.data.allow_changed_data)
    console(f"resumed from checkpoint {latest}")
  start = int(state.step)
  console(f"params: {state_lib.param_count(state.params):,}; steps {start} -> {config.steps}")

  # --- Compile ahead of time, so compile time is measured apart from step time.
  t0 = time.time()
  local_batches = components.local_batches(comp, config)
  batch_spec = pipeline.global_spec(local_batches(start), comp.batch_sharding, b)
  train_step = make_train_step(comp, config.microbatches)
  eval_step = make_eval_step(comp)
  with jax.set_mesh(comp.mesh):
    train_step = train_step.lower(state, batch_spec).compile()
  compile_s = time.time() - t0

  # --- The loop. Batches for steps [start, steps) are prepared ahead by Grain reader threads.
  log = MetricsLog(workdir, resume_step=start)
  last_step = config.steps if stop_after is None else min(stop_after, config.steps)
  batches = pipeline.local_batch_iterator(
    local_batches,
    start,
    last_step,
    config.data.read_threads,
    config.data.prefetch,
    config.data.worker_processes,
  )
  batches = pipeline.DevicePrefetch(batches, comp.batch_sharding, b, depth=config.data.prefetch)
  window, last, eval_row, tokens_seen = Window(), {}, {}, 0.0
  for step in range(start + 1, last_step + 1):
    t0 = time.time()
    t, _, batch = next(batches)
    assert t == step - 1, (t, step)  # Batch t trains step t + 1: the data position is the step.
    if comp.plan.valid_rows(t) == 0:
      raise UserError(f"global batch {t} has no valid examples; refusing an empty step")
    t1 = time.time()
    state, metrics = train_step(state, batch)
    t2 = time.time()
    window.add_step(data_wait_s=t1 - t0, dispatch_s=t2 - t1, valid_tokens=metrics["valid_tokens"])

    if step % config.log_every == 0 or step == last_step:
      metrics = jax.device_get(metrics)  # Blocks until this step has run on the device.
      row, process_row = window.close(step, metrics, comp.plan.valid_rows(t), time.time() - t2)
      log.write(row)
      log.write_process(process_row)
      eta = (config.steps - step) * row["step_time_s"]
      console(progress_line(step, config.steps, row["loss"], row["tokens_per_s"], eta))
      last, tokens_seen, window = row, tokens_seen + window.tokens, Window()

    if config.eval_every and step % config.eval_every == 0 and step != config.steps:
      eval_row = evaluate(comp, eval_step, state.params, config)
      log.write({"step": step, "time": time.time(), **eval_row})
      console(f"step {step}/{config.steps}  eval_loss {eval_row['eval_loss']:.4f}")

    if step % config.checkpoint.every == 0 or step == last_step:
      t3 = time.time()
      checkpointing.save(manager, step, state, comp, config)  # Async: the write goes on.
      window.checkpoint += time.time() - t3

  # --- The end: final evaluation, wait for the last write, summary.
  batches.close()
  if config.eval_steps and int(state.step) == config.steps:
    eval_row = evaluate(comp, eval_step, state.params, config)
    log.write({"step": int(state.step), "time": time.time(), **eval_row})
  manager.wait_until_finished()
  manager.close()
  log.close()
  summary = {
    "final_step": int(state.step),
    "final_loss": last.get("loss"),
    **eval_row,
    "loss_floor": comp.sources.loss_floor,
    "examples_seen": comp.plan.examples_before(int(state.step)),
    "tokens_trained_this_run": tokens_seen,
    "wall_s": time.time() - t_start,
    "compile_s": compile_s,
    "devices": device_label(),
  }
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  floor = comp.sources.loss_floor
  if last and floor is not None:
    console(f"final loss {last['loss']:.4f}  entropy floor {floor:.4f}  gap {last['loss'] - floor:+.4f} nats")
  return summary
