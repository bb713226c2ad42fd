"""The training loop, read top to bottom: set up, restore or init, compile, train the steps
(trainer/loop.py), finish. Every second from process start is in a phase of one clock
(trainer/observe/clock.py), which goodput, the metrics window and the watchdog read."""

import contextlib
import dataclasses
import functools
import json
import time

import jax

from trainer import components, rundir
from trainer import state as state_lib
from trainer import summary as summary_lib
from trainer.checkpoint import local as local_tiers
from trainer.checkpoint import restore, store, tree
from trainer.checks import checked_programs, first_step, integrity
from trainer.cluster import interrupts, multihost, runtime
from trainer.cluster.preemption import Preemption
from trainer.cluster.watchdog import Watchdog
from trainer.loop import Loop
from trainer.observe import flops, goodput, recovery_time
from trainer.observe.clock import Clock
from trainer.observe.metrics import MetricsLog, console, device_label
from trainer.step import make_eval_step, make_train_step


@dataclasses.dataclass
class Run:
  """What the steps need from the set-up: fixed once the loop starts."""

  config: object
  workdir: str
  clock: Clock  # Its watchdog is the run's.
  comp: components.Components
  meta: dict
  ckpt: store.Checkpoints
  target: object  # The abstract train state: what a restore fills in.
  init: object  # () -> a fresh sharded train state.
  last_step: int
  startup: dict  # Start-up's seconds by part, for summary.json: imports, build, init or restore, compile.
  log: MetricsLog | None = None
  input: components.TrainInput | None = None
  train_step: object = None
  first_train_step: object = None  # checks.first_step's: the loop's first step, when it is checked.
  batch_spec: object = None  # The global batch's shapes, as compiled.
  eval_step: object = None
  devices: list = dataclasses.field(default_factory=list)
  device_label: str = ""
  flops_per_step: float | None = None  # MFU's numerator: the experiment's analytic count, else XLA's.
  compiled_flops: float | None = None
  local: local_tiers.LocalTier | None = None  # The local and peer checkpoint tiers (None: off).


def train(
  config, workdir: str, stop_after: int | None = None, devices=None, started: float | None = None
) -> dict:
  """Trains to `config.steps` in `workdir`, resuming from its newest checkpoint; returns the summary.

  `stop_after` ends the run early at that step, as an interruption would (the schedule still targets
  config.steps), after saving a checkpoint there. `devices` defaults to all devices. `started`: when
  the process started (main.py's, so start-up counts the imports); default now.
  """
  t_start = time.time()
  store.make_workdir(workdir)
  with contextlib.ExitStack() as cleanup:
    watchdog = Watchdog(config.watchdog, workdir)
    cleanup.callback(watchdog.stop)
    clock = Clock(watchdog, goodput.Ledger(started or t_start), config.watchdog)
    return _train(config, workdir, stop_after, devices, clock, cleanup, t_start)


def _train(config, workdir, stop_after, devices, clock, cleanup, t_start) -> dict:
  started = clock.ledger.started
  with clock.phase("startup", 0, since=started):
    # --- Setup: mesh, experiment, data order, optimizer, shardings (config errors surface here).
    comp = components.build(config, devices)
    meta = store.run_metadata(comp, config)
    _agree(comp, config, meta, workdir)

    # --- State: the newest checkpoint that restores (onto this mesh), else a fresh sharded init.
    c = config.checkpoint
    run = Run(
      config,
      workdir,
      clock,
      comp,
      meta,
      ckpt=store.Checkpoints(workdir, c.keep, c.keep_every, c.replica_parallel),
      target=state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx),
      init=functools.partial(components.fresh_state, comp, config),
      last_step=config.steps if stop_after is None else min(stop_after, config.steps),
      startup={"imports": t_start - started, "build": time.time() - t_start},
      input=components.train_input(comp, config),
    )
    fingerprint = {
      "layout": meta["layout"],
      "processes": jax.process_count(),
      "tree": tree.paths_and_shapes(run.target),
    }
    run.local = local_tiers.make(config, workdir, fingerprint, run.target)
    with clock.phase("restore", 0) as phase:
      start = restore.restore_or_init(run.ckpt, run.target, comp, config, run.init, True, run.local)
      first = int(start.state.step)
      phase.category = "restore" if first else "startup"
    run.startup["restore" if first else "init"] = phase.seconds
    summary_path = rundir.summary(workdir)
    if first >= run.last_step:
      if (done := _already_done(run, first, summary_path)) is not None:
        return done
    elif first and not start.from_local_tier:
      console(f"resumed from checkpoint {first}")
    console(f"params: {state_lib.param_count(start.state.params):,}; steps {first} -> {config.steps}")

    # --- Compile ahead of time, so compile time is measured apart from step time.
    with clock.phase("compile", first) as phase:
      from_cache = _compile(run, start)
    run.startup["compile"] = phase.seconds
    if run.local is not None and first < run.last_step:
      run.local.place(config.checkpoint.local_copy_in, run.train_step, run.target)
    # Any process that sees another layout (its own XLA_FLAGS, say) makes every process check.
    same_layout = first > 0 and not start.layout_changed
    timeout_s = config.watchdog.startup_timeout_s
    if (
      config.checks.first_step
      and first < run.last_step
      and not multihost.all_agree("first_step_layout", same_layout, timeout_s)
    ):
      with clock.phase("compile", first) as phase:  # The first step's two programs (the loop runs them).
        _check_first_step(run, first, meta)
      run.startup["first_step_check"] = phase.seconds
    run.devices = list(comp.mesh.devices.flat)
    run.device_label = device_label(run.devices)
    per_device = flops.compiled_per_device(run.train_step) if first < run.last_step else None
    run.compiled_flops = per_device * len(run.devices) if per_device else None
    run.flops_per_step = flops.per_step(comp.experiment, config, state_lib.param_count(start.state.params))
    run.flops_per_step = run.flops_per_step or run.compiled_flops

    # --- The loop's outputs, its integrity checks, and from here a signal means "save and stop"
    # (trainer/cluster/preemption.py), up to the end of the summary.
    process_start = {"startup_s": run.startup, "compiled_from_cache": from_cache}
    run.log = MetricsLog(workdir, first, first if first >= run.last_step else None, process_start)
    clock.ledger.resume(start.clock)  # Every earlier run's time, from the checkpoint, on every process.
    restarted = recovery_time.from_env() if first < run.last_step else None  # Relaunched by a launcher.
    checks = integrity.Checks(comp, config, make_train_step)
    preemption = Preemption()
    cleanup.callback(preemption.restore_handlers)
    interrupts.during("the end of training")  # Once train() returns and the handlers are restored.
    loop = Loop(run, start, checks, preemption, restarted)  # Batches are prepared ahead.

  loop.run_steps()

  # --- The end: final evaluation, the last write, summary. A signal here is noted, and the run
  # finishes: the checkpoint is saved, and the evaluation and summary take seconds.
  with clock.phase("finish", loop.step):
    if config.eval_steps and loop.step == config.steps:
      loop.eval_row = loop.evaluate(loop.step)
    run.ckpt.close()
    if run.local is not None:
      run.local.close(finished=loop.step == config.steps)  # The final step is persistent: copies go.
    for record in run.ckpt.drain():
      run.log.write_process(record)
    run.log.close()
  split = clock.ledger.split()
  summary = summary_lib.summary(run, loop, split, clock.ledger.split(whole=False), time.time() - t_start)
  summary_lib.write(summary_path, summary)
  multihost.barrier("end_of_training", timeout_s=config.watchdog.step_timeout_s)
  summary_lib.closing_lines(loop, split, config.steps, comp.sources.loss_floor)
  return summary


def _check_first_step(run: Run, first: int, meta: dict) -> None:
  """Compiles checks.first_step's two programs for the loop's first step, unless every process has a
  record of this very program passing on these devices (trainer/checks/checked_programs.py)."""
  config, timeout_s = run.config, run.config.watchdog.startup_timeout_s
  name = checked_programs.key(first_step.fingerprint(run.train_step), meta, config)
  verdict = None if config.checks.first_step_every_run else checked_programs.passed(name)
  if multihost.all_agree("first_step_checked", verdict is not None, timeout_s):
    console(checked_programs.line(verdict))
    return
  record = lambda other, worst: checked_programs.record(name, run.workdir, other, worst)
  check = first_step.FirstStepCheck(
    run.comp, config, make_train_step, run.target, run.batch_spec, resumed=first > 0, on_pass=record
  )
  run.first_train_step = check if check.other else None  # Its programs live until the first step ran.


def _agree(comp, config, meta: dict, workdir: str) -> None:
  """Every process runs the same config, data, code and libraries; process 0 writes config.json."""
  agreed = {
    "config": json.loads(config.to_json()),
    "data": comp.sources.fingerprint,  # The same data.path may hold other files on another host.
    "code": meta["git_revision"],
    "versions": meta["versions"],
  }
  multihost.check_agreement(agreed, timeout_s=config.watchdog.startup_timeout_s)
  console(f"devices: {device_label(comp.mesh.devices.flatten())}; mesh {dict(comp.mesh.shape)}")
  if jax.process_index() == 0:
    with open(rundir.config(workdir), "w") as f:
      f.write(config.to_json(indent=2))


def _already_done(run: Run, step: int, summary_path: str) -> dict | None:
  """The summary when the run has nothing left to do; None when a kill came after the final
  checkpoint but before the summary: the rerun then finishes the evaluation and summary."""
  summary = rundir.read_json_object(summary_path)
  complete = summary is not None and summary.get("final_step") == step
  timeout_s = run.config.watchdog.step_timeout_s
  if step < run.config.steps or multihost.all_agree("summary_complete", complete, timeout_s):
    run.ckpt.close()
    console(f"already trained to step {step} (config.steps={run.config.steps}); nothing to do")
    return summary or {"final_step": step}
  console(f"checkpoint {step} is the last; finishing its evaluation and summary")
  return None


def _compile(run: Run, start: restore.Start) -> bool:
  """Compiles the train step for the first batch's shapes (unless no step is left); whether the
  compilation cache served it."""
  hits, comp = runtime.compilation_cache_hits(), run.comp
  run.train_step, run.eval_step = make_train_step(comp, run.config.microbatches), make_eval_step(comp)
  first = int(start.state.step)
  if first < run.last_step:
    spec = run.batch_spec = run.input.spec(first + start.batch_offset)
    with jax.set_mesh(comp.mesh):
      run.train_step = run.train_step.lower(start.state, spec).compile()
  return runtime.compilation_cache_hits() > hits
