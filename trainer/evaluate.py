"""Held-out evaluation: in the training loop, and as --mode=eval on a run's newest checkpoint."""

import json
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from data import pipeline
from errors import UserError
from trainer import components, rundir
from trainer import state as state_lib
from trainer.checkpoint import store
from trainer.cluster.watchdog import Watchdog
from trainer.hooks import HookContext, call, load_evaluators
from trainer.observe.metrics import console, device_label, eval_line
from trainer.step import make_eval_step


def weight_sets(experiment, state) -> dict[str, tuple]:
  """{name: (params, variables)} that evaluation scores: the experiment's eval_weights, else the params
  and, with ema.decay > 0, their average ("ema"), each with the variables training left."""
  choose = experiment.eval_weights
  if choose is not None:
    return choose(state.params, state.variables, state.ema)
  sets = {"": (state.params, state.variables)}
  return sets | ({"ema": (state.ema, state.variables)} if state.ema else {})


def evaluate(
  comp: components.Components, eval_step, state, config, step: int = 0, evaluators=(), watch=None
) -> dict:
  """Held-out loss over up to `eval_steps` batches of each held-out set, for each weight set: sums and
  counts added up, divided once (eval_loss, eval_ema_loss for the set "ema", eval_NAME_loss for the
  experiment's held-out set NAME); then the evaluators (trainer/hooks.Evaluator), eval_NAME_METRIC,
  given `step` (the state's), each run on each weight set after calling `watch` (the watchdog's new
  budget: a task's length is the fork's, not a step's). Never wraps around: when a held-out set is
  smaller, each of its examples counts once."""
  sets = weight_sets(comp.experiment, state)
  row = {}
  for heldout, (local, plan) in components.held_out_batches(comp).items():
    batches = min(config.eval_steps, plan.batches_per_epoch)
    prefix = f"eval_{heldout}_" if heldout else "eval_"
    for name, sums in _loss_sums(comp, eval_step, sets, local, batches).items():
      count = float(sums.pop("count"))
      if count == 0:
        where = f"held-out set {heldout!r}" if heldout else "held-out data"
        raise UserError(f"the {where} has no valid elements in its first {batches} batches (all weights 0)")
      row.update({f"{prefix}{name + '_' if name else ''}{k}": float(v) / count for k, v in sums.items()})
    row[f"{prefix}examples"] = plan.examples_before(batches)
  for e in evaluators:
    row.update(_run_evaluator(comp, e, sets, config, step, watch))
  return row


def _loss_sums(comp, eval_step, sets: dict, local, batches: int) -> dict:
  """{weight set: summed loss, count and metrics} over held-out batches 0..batches-1, the next batch
  read while the devices work on this one."""
  totals = dict.fromkeys(sets)
  with ThreadPoolExecutor(1) as reader:
    ahead = reader.submit(local, 0)
    for t in range(batches):
      rows = ahead.result()
      if t + 1 < batches:
        ahead = reader.submit(local, t + 1)
      batch = pipeline.to_global(rows, comp.batch_sharding, comp.plan.global_batch_size)
      for name, (params, variables) in sets.items():
        with jax.set_mesh(comp.mesh):
          sums = eval_step(params, variables, batch)
        totals[name] = sums if totals[name] is None else jax.tree.map(np.add, totals[name], sums)
  return jax.device_get(totals)


def _run_evaluator(comp, evaluator, sets: dict, config, step: int, watch) -> dict:
  """One evaluator on each weight set: {eval_[SET_]NAME_METRIC: value} where it ran."""
  row = {}
  for name, (params, variables) in sets.items():

    def body(params, variables, ema):
      ctx = HookContext(step, params, variables, ema, config, None, comp.mdef)
      metrics = evaluator.fn(ctx)
      if not isinstance(metrics, dict):
        raise TypeError(f"returned {type(metrics).__name__}, not {{metric: number}}")
      return {str(k): float(v) for k, v in metrics.items()}

    what = f"evaluator {evaluator.name!r}"
    if watch is not None:
      watch()
    metrics = call(what, evaluator.on, step, (params, variables, {}), config.watchdog.step_timeout_s, body)
    prefix = f"eval_{name + '_' if name else ''}{evaluator.name}_"
    row.update({prefix + k: v for k, v in (metrics or {}).items()})
  return row


def evaluators(comp: components.Components, config) -> list:
  """The experiment's evaluators, their names apart from its held-out sets' and the EMA's metrics'."""
  held_out = set(comp.sources.eval_sets) if comp.sources else set()
  return load_evaluators(comp.experiment, config, taken=held_out | {"ema"})


def evaluate_checkpoint(config, workdir: str) -> dict:
  """Restores the newest checkpoint of `workdir` onto this mesh and evaluates it; writes eval.json."""
  # Before any Orbax manager exists: nothing is created in a workdir that was never trained.
  if not store.has_checkpoints(workdir):
    raise UserError(f"--mode=eval: {workdir}/checkpoints has no checkpoint; train first")
  w = config.watchdog
  watchdog = Watchdog(w, workdir)  # A wedged or lost peer must not hang a collective.
  try:
    comp = components.build(config)
    watchdog.beat("restore", 0, w.restore_timeout_s)
    ckpt = store.Checkpoints(workdir, config.checkpoint.keep, config.checkpoint.keep_every)
    restored = ckpt.restore_latest(
      state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx), set_aside=False
    )
    ckpt.close()
    if restored is None:
      raise UserError(f"--mode=eval: no checkpoint in {workdir}/checkpoints could be restored")
    watchdog.beat("eval", restored.step, w.compile_timeout_s + w.step_timeout_s)  # Compiles, then runs.
    row = {
      "step": restored.step,
      **evaluate(
        comp,
        make_eval_step(comp),
        restored.state,
        config,
        restored.step,
        evaluators(comp, config),
        watch=lambda: watchdog.beat("eval", restored.step, w.compile_timeout_s),
      ),
      "devices": device_label(),
    }
  finally:
    watchdog.stop()
  step = restored.step
  console(f"checkpoint {step}: {eval_line(row)} over {row['eval_examples']} held-out examples")
  if jax.process_index() == 0:
    with open(rundir.mode_output(workdir, "eval"), "w") as f:
      json.dump(row, f, indent=2)
  return row
