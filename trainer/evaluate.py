"""Held-out evaluation: in the training loop, and as --mode=eval on a run's newest checkpoint."""

import json

import jax
import numpy as np

from data import pipeline
from errors import UserError
from trainer import components, rundir
from trainer import state as state_lib
from trainer.checkpoint import store
from trainer.cluster.watchdog import Watchdog
from trainer.observe.metrics import console, device_label, eval_line
from trainer.step import make_eval_step


def weight_sets(experiment, state) -> dict[str, tuple]:
  """{name: (params, variables)} that evaluation scores: the experiment's eval_weights, else the params
  and, with ema.decay > 0, their average ("ema"), each with the variables training left."""
  choose = getattr(experiment, "eval_weights", None)
  if choose is not None:
    return choose(state.params, state.variables, state.ema)
  sets = {"": (state.params, state.variables)}
  return sets | ({"ema": (state.ema, state.variables)} if state.ema else {})


def evaluate(comp: components.Components, eval_step, state, config) -> dict:
  """Held-out loss over up to `eval_steps` batches, for each weight set: sums and counts added up,
  divided once (eval_loss, and eval_ema_loss for the set "ema"). Never wraps around: when the
  held-out set is smaller, each of its examples counts once."""
  local = components.local_batches(comp, "eval")
  batches = min(config.eval_steps, comp.eval_plan.batches_per_epoch)
  sets = weight_sets(comp.experiment, state)
  totals = dict.fromkeys(sets)
  for t in range(batches):
    batch = pipeline.to_global(local(t), comp.batch_sharding, comp.plan.global_batch_size)
    for name, (params, variables) in sets.items():
      with jax.set_mesh(comp.mesh):
        sums = eval_step(params, variables, batch)
      totals[name] = sums if totals[name] is None else jax.tree.map(np.add, totals[name], sums)
  row = {}
  for name, sums in jax.device_get(totals).items():
    count = float(sums.pop("count"))
    if count == 0:
      raise UserError(
        f"the held-out data has no valid elements in its first {batches} batches (all weights 0)"
      )
    row.update({f"eval_{name + '_' if name else ''}{k}": float(v) / count for k, v in sums.items()})
  return row | {"eval_examples": comp.eval_plan.examples_before(batches)}


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
      **evaluate(comp, make_eval_step(comp), restored.state, config),
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
