"""The training loop: one function, read top to bottom."""

import contextlib
import json
import os
import time

import jax
import numpy as np

import trainer
from data import pipeline
from errors import UserError
from trainer import (
  checkpointing,
  components,
  goodput,
  integrity,
  interrupts,
  model_flops,
  multihost,
  profiling,
  recovery,
  resume_policy,
  rundir,
  runtime,
  straggler,
)
from trainer import state as state_lib
from trainer.evaluate import evaluate
from trainer.metrics import MetricsLog, Window, closing_line, console, device_label, eval_line, progress_line
from trainer.preemption import Preemption
from trainer.step import make_eval_step, make_train_step
from trainer.watchdog import Watchdog

_first_run_in_process = [True]  # Only a process's first run paid for the imports.


def empty_batch_error(t: int) -> UserError:
  return UserError(f"global batch {t} has no valid examples (all weights 0); refusing an empty step")


def train(config, workdir: str, stop_after: int | None = None, devices=None) -> dict:
  """Trains to `config.steps` in `workdir`, resuming from its newest checkpoint; returns the summary.

  `stop_after` ends the run early at that step, as an interruption would (the schedule still
  targets config.steps), after saving a checkpoint there. `devices` defaults to all devices.
  """
  t_start = time.time()
  checkpointing.make_workdir(workdir)
  with contextlib.ExitStack() as cleanup:
    watchdog = Watchdog(config.watchdog, workdir)
    cleanup.callback(watchdog.stop)
    return _train(config, workdir, stop_after, devices, watchdog, t_start, cleanup)


def _train(config, workdir, stop_after, devices, watchdog, t_start, cleanup) -> dict:
  # Start-up's seconds by phase, for summary.json: imports (process start to train()), then ours.
  started = trainer.STARTED if _first_run_in_process[0] else t_start
  _first_run_in_process[0] = False
  startup = {"imports": t_start - started}
  ledger = goodput.Ledger(started)
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

  def restore_or_init(resuming: bool):
    """(state, batch offset, rollbacks so far): the offset counts batches skipped by NaN rollbacks.
    `resuming`: judge what changed in the config since the checkpoint (a rollback changes nothing)."""
    restored = ckpt.restore_latest(target, check_memory=resuming)
    if restored is None:
      return init(), 0, 0
    state, position, step = restored.state, restored.data, restored.step
    if resuming:
      saved = ckpt.saved_config(step)
      for line in resume_policy.check(saved, agreed["config"], step, config.checkpoint.allow_changed_keys):
        console(line)
    checkpointing.check_data_position(position, step, comp, config.data.allow_changed_data)
    return state, position["batch_offset"], position.get("rollbacks", 0)

  startup["build"] = time.time() - t_start
  watchdog.beat("restore", 0, config.watchdog.restore_timeout_s)
  t0 = time.time()
  state, batch_offset, rollbacks = restore_or_init(resuming=True)
  start = int(state.step)
  startup["restore" if start else "init"] = time.time() - t0
  ledger.add("startup", t0 - started)
  ledger.add("restore" if start else "startup", time.time() - t0)
  last_step = config.steps if stop_after is None else min(stop_after, config.steps)
  summary_path = os.path.join(workdir, "summary.json")
  if start >= last_step:
    summary = rundir.read_json_object(summary_path)
    # A kill after the final checkpoint but before the summary: the rerun finishes evaluation and summary.
    complete = summary is not None and summary.get("final_step") == start
    timeout_s = config.watchdog.step_timeout_s
    if start < config.steps or multihost.all_agree("summary_complete", complete, timeout_s):
      ckpt.close()
      console(f"already trained to step {start} (config.steps={config.steps}); nothing to do")
      return summary or {"final_step": start}
    console(f"checkpoint {start} is the last; finishing its evaluation and summary")
  elif start:
    console(f"resumed from checkpoint {start}")
  console(f"params: {state_lib.param_count(state.params):,}; steps {start} -> {config.steps}")

  # --- Compile ahead of time, so compile time is measured apart from step time.
  watchdog.beat("compile", start, config.watchdog.compile_timeout_s)
  t0, hits = time.time(), runtime.compilation_cache_hits()
  local_batches = components.local_batches(comp)
  train_step, eval_step = make_train_step(comp, config.microbatches), make_eval_step(comp)
  if start < last_step:
    batch_spec = pipeline.global_spec(local_batches(start + batch_offset), comp.batch_sharding, b)
    with jax.set_mesh(comp.mesh):
      train_step = train_step.lower(state, batch_spec).compile()
  compile_s = startup["compile"] = time.time() - t0
  from_cache = runtime.compilation_cache_hits() > hits
  ledger.add("compile", compile_s)
  t0 = time.time()
  devices = list(comp.mesh.devices.flat)
  # MFU's numerator: the experiment's analytic count, else the compiled step's (all devices).
  flops_per_step = model_flops.per_step(comp.experiment, config, state_lib.param_count(state.params))
  per_device = model_flops.compiled_per_device(train_step) if start < last_step else None
  compiled_flops = per_device * len(devices) if per_device else None
  flops_per_step = flops_per_step or compiled_flops

  # --- The loop. Batches are prepared ahead by Grain threads and copied to the devices ahead.
  log = MetricsLog(
    workdir,
    resume_step=start,
    drop_eval_at=start if start >= last_step else None,
    process_start={"startup_s": startup, "compiled_from_cache": from_cache},
  )
  if log.trained_before is not None:
    ledger.trained_before = log.trained_before
  profile = profiling.Window(config.profile, workdir, start)
  restarted = recovery.from_env() if start < last_step else None  # Relaunched by a launcher.
  stragglers_seen, checks = set(), integrity.Checks(comp, config, make_train_step, last_step)

  def open_batches(step):
    first = step + batch_offset  # Global batch t trains step t - batch_offset + 1.
    d = config.data
    it = pipeline.local_batch_iterator(
      local_batches, first, last_step + batch_offset, d.read_threads, d.prefetch, d.worker_processes
    )
    return pipeline.DevicePrefetch(it, comp.batch_sharding, b, depth=d.prefetch)

  # From here a signal means "save and stop" (trainer/preemption.py), up to the end of the summary.
  batches, preemption = open_batches(start), Preemption()
  cleanup.callback(preemption.restore_handlers)
  interrupts.during("the end of training")  # Once train() returns and the handlers are restored.
  unit = comp.experiment.UNIT
  # A rerun that only finishes the evaluation and summary reports the loss the run ended with.
  last = log.last_train_row(start) if start >= last_step else {}
  window, eval_row = Window(unit), {}
  eval_compiled = False

  def evaluate_and_log(at: int) -> dict:
    nonlocal eval_compiled
    t = config.watchdog.step_timeout_s if eval_compiled else config.watchdog.compile_timeout_s
    watchdog.beat("eval", at, t)  # The first evaluation compiles the evaluation step.
    row = evaluate(comp, eval_step, state.params, config)
    eval_compiled = True
    log.write({"step": at, "time": time.time(), **row})
    return row

  trained = np.zeros(max(last_step - start, 0))  # Valid units per step of this run, kept steps only.

  def count_trained(step_counts, up_to: int) -> None:
    for at, n in step_counts:
      if start < at <= up_to:  # (A rollback to before this run's start retrains earlier steps.)
        trained[at - start - 1] = n

  step = start
  ledger.add("startup", time.time() - t0)
  try:
    while step < last_step:
      t_iter = time.time()
      profiled_s = profile.maybe_start(step, state)
      ledger.add("profiling", profiled_s)
      window.profiling += profiled_s
      # Every step's own work never waits for the devices: a device-to-host copy here (a hidden sync)
      # is an error. Only logging, saving and evaluating below fetch values, on their steps.
      with jax.transfer_guard_device_to_host("disallow_explicit"):
        # The run's first step waits in its collectives for peers still compiling: compile's budget.
        first = config.watchdog.compile_timeout_s if step == start else None
        watchdog.beat("data", step + 1, first)
        t0 = time.time()
        t, local, batch = next(batches)
        fetch_s = time.time() - t0
        ledger.add("data_wait", fetch_s)
        watchdog.beat("step", step + 1, first)
        assert t == step + batch_offset, (t, step, batch_offset)  # The data position is the step.
        # A globally empty batch never reaches the devices. Rows are known globally from the plan;
        # weights are known here only for this process's rows (with several processes, a count of 0
        # shows as a non-finite step below).
        if comp.plan.valid_rows(t) == 0 or (jax.process_count() == 1 and not local["weights"].any()):
          raise empty_batch_error(t)
        t1 = time.time()
        copied = checks.copy_if_due(step + 1, state, batch)  # Before the step donates the state.
        with profile.annotation(step + 1):
          state, metrics = train_step(state, batch)
        step += 1
        window.add_step(
          step,
          batches.last_starved_s,
          fetch_s=t1 - t0,
          dispatch_s=time.time() - t1,
          metrics=metrics,
          valid_examples=comp.plan.valid_rows(t),
        )
        ckpt.poll()  # A background save's error surfaces here, at the next step.
        if restarted and step == start + 1:  # Time to recover: up to this first step's completion.
          jax.block_until_ready(metrics)
          row = recovery.row(restarted, started, startup, time.time(), start)  # Kept by later resumes.
          log.write(row)
          console(recovery.line(row))

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
        rollbacks += 1  # Saved with the next checkpoint: a restarted job does not start counting afresh.
        t_rollback = time.time()
        ledger.step(step, t, t_rollback - t_iter - fetch_s - profiled_s)
        profile.abort()  # The window would count the steps it trains again.
        batches.close()
        ckpt.wait()
        old_offset = batch_offset
        watchdog.beat("restore", step, config.watchdog.restore_timeout_s)
        state, _, _ = restore_or_init(resuming=False)
        good = int(state.step)
        ledger.discard_after(good)
        count_trained(window.fetch_counts(), good)  # Steps up to the checkpoint stay trained.
        trained[max(good - start, 0) :] = 0  # Later steps' work is thrown away.
        # Steps good+1..bad trained batches good+old_offset..bad-1+old_offset: skip them. The offset
        # builds on the current one, not the checkpoint's, so earlier skips since that save stay skipped.
        batch_offset = old_offset + bad - good
        log.truncate(good)
        event = {"step": good, "time": time.time(), "event": "nonfinite_rollback", "nonfinite_step": bad}
        log.write({**event, "skipped_batches": [good + old_offset, bad - 1 + old_offset]})
        console(f"step {bad}: NaN/Inf; rolled back to step {good}, skipping {bad - good} batches")
        step, window = good, Window(unit)
        batches = open_batches(step)
        ledger.add("restore", time.time() - t_rollback)
        continue

      # A logged step's window closes after its save, so its checkpoint blocking is in its own row,
      # and a new window opens after the evaluation: no window's throughput includes either.
      if log_now:
        metrics = jax.device_get(metrics)  # Blocks until this step has run on the device.
        device_wait_s = time.time() - t1
      saving_s = eval_s = 0.0
      if checks.due(step, save_now, copied):  # Before saving: never save a state that differs.
        t2 = time.time()
        checks.run(state, metrics, step, copied)
        saving_s = time.time() - t2  # Counted with checkpoint blocking: it guards the save.
        ledger.add("checkpoint_blocking", saving_s)
        window.checkpoint += saving_s
      if save_now:
        watchdog.beat("checkpoint", step)
        t3 = time.time()
        position = checkpointing.data_position(step, batch_offset, comp, rollbacks)
        ckpt.save(step, state, position, config, meta)  # Async: the write goes on in the background.
        window.checkpoint += time.time() - t3
        ledger.add("checkpoint_blocking", time.time() - t3)
        ledger.saved(step)
        saving_s += time.time() - t3
      if log_now:
        row, process_row = window.close(step, metrics, device_wait_s)
        row["batch"] = t  # The data position this step trained on: checkable after any restart.
        row.update(model_flops.fields(flops_per_step, row["step_time_s"], devices))
        row.update(straggler.report(watchdog, window, step, config.straggler, stragglers_seen))
        log.write(row)
        for record in [process_row, *ckpt.drain()]:
          log.write_process(record)
        count_trained(window.step_counts, step)
        eta = (config.steps - step) * row["step_time_s"]
        console(progress_line(step, config.steps, row["loss"], unit, row[f"{unit}_per_s"], eta))
        last = row

      if config.eval_every and step % config.eval_every == 0 and step != config.steps:
        t4 = time.time()
        eval_row = evaluate_and_log(step)
        console(f"step {step}/{config.steps}  {eval_line(eval_row)}")
        eval_s = time.time() - t4
        window.evaluation += eval_s
        ledger.add("evaluation", eval_s)
      if log_now:
        window = Window(unit)
      # Reading a long trace back takes a while: under compile's budget, not a step's.
      watchdog.beat("step", step, config.watchdog.compile_timeout_s)
      profile_row, profile_s = profile.maybe_stop(step, state)
      if profile_row is not None:
        t5 = time.time()
        log.write_process(profile_row)
        profiling.print_table(profile_row, config.watchdog.step_timeout_s, device_label(devices))
        profile_s += time.time() - t5
      ledger.add("profiling", profile_s)
      window.profiling += profile_s
      ledger.step(step, t, time.time() - t_iter - fetch_s - saving_s - eval_s - profiled_s - profile_s)

      if stop:
        break
  finally:
    profile.abort()
    batches.close()
    watchdog.beat("checkpoint", step)
    t0 = time.time()
    ckpt.wait()  # Even on an error: a good checkpoint in flight is finished, not left half-written.
    ledger.add("checkpoint_blocking", time.time() - t0)

  # --- The end: final evaluation, wait for the last write, summary. A signal here is noted, and the
  # run finishes: the checkpoint is saved, and the evaluation and summary take seconds.
  watchdog.beat("finish", step)
  if config.eval_steps and step == config.steps:
    t0 = time.time()
    eval_row = evaluate_and_log(step)
    ledger.add("evaluation", time.time() - t0)
    watchdog.beat("finish", step)
  t0 = time.time()
  ckpt.close()
  for record in ckpt.drain():
    log.write_process(record)
  log.close()
  ledger.add("checkpoint_blocking", time.time() - t0)
  split = ledger.split()
  step_s = split["productive_steps"] + split["lost_to_restarts"] + split["lost_to_rollbacks"]
  run_steps = step - start
  speed = model_flops.fields(flops_per_step, step_s / run_steps, devices) if run_steps and step_s else {}
  summary = {
    "final_step": step,
    "final_loss": last.get("loss"),
    **eval_row,
    "loss_floor": comp.sources.loss_floor,
    "examples_seen": comp.plan.examples_before(step + batch_offset),
    f"{unit}_trained_this_run": float(trained.sum()),
    "nonfinite_rollbacks": rollbacks,  # Over the whole run, restarts included.
    "preempted_by": preemption.received,
    "wall_s": time.time() - t_start,
    "compile_s": compile_s,
    "startup_s": startup,  # imports, build, init or restore, compile.
    "goodput": split,  # Where the wall time went, from process start (trainer/goodput.py).
    "recoveries": recovery.history(workdir) if jax.process_index() == 0 else [],
    "model_flops_per_step": flops_per_step,
    "compiled_flops_per_step": compiled_flops,  # XLA's count: remat included, a loop's body once.
    "tflops_per_device": speed.get("tflops_per_device"),  # Over this run's steps, all their time.
    "mfu": speed.get("mfu", model_flops.mfu_label(devices, flops_per_step)),
    "devices": device_label(comp.mesh.devices.flatten()),
    "processes": jax.process_count(),
  }
  if jax.process_index() == 0:
    with open(summary_path + ".tmp", "w") as f:
      json.dump(summary, f, indent=2)
    os.replace(summary_path + ".tmp", summary_path)  # A kill mid-write leaves no torn summary.
  multihost.barrier("end_of_training", timeout_s=config.watchdog.step_timeout_s)
  if preemption.received and step < config.steps:
    console(f"preempted ({preemption.received}): saved checkpoint {step}; run the same command to resume")
  elif preemption.received:
    console(f"{preemption.received} received at the end of training: the run finished anyway")
  if run_steps:
    console(goodput.line(split))
  if last and step == config.steps:
    console(closing_line(step, last, eval_row, comp.sources.loss_floor))
  return summary
