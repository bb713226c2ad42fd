"""Held-out evaluation: in the training loop, and as --mode=eval on a run's newest checkpoint."""

import json
import os

import jax
import numpy as np

from data import pipeline
from errors import UserError
from trainer import checkpointing, components
from trainer import state as state_lib
from trainer.metrics import console, device_label
from trainer.step import make_eval_step


def evaluate(comp: components.Components, eval_step, params, config) -> dict:
  """Held-out loss over `eval_steps` batches: sums and counts added up, divided once."""
  local = components.local_batches(comp, "eval")
  totals = None
  for t in range(config.eval_steps):
    batch = pipeline.to_global(local(t), comp.batch_sharding, comp.plan.global_batch_size)
    with jax.set_mesh(comp.mesh):
      sums = eval_step(params, batch)
    totals = sums if totals is None else jax.tree.map(np.add, totals, sums)
  totals = jax.device_get(totals)
  count = float(totals.pop("count"))
  return {f"eval_{k}": float(v) / count for k, v in totals.items()}


def evaluate_checkpoint(config, workdir: str) -> dict:
  """Restores the newest checkpoint of `workdir` onto this mesh and evaluates it; writes eval.json."""
  comp = components.build(config)
  ckpt = checkpointing.Checkpoints(workdir, config.checkpoint.keep, config.checkpoint.keep_every)
  restored = ckpt.restore_latest(
    state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx), set_aside=False
  )
  ckpt.close()
  if restored is None:
    raise UserError(f"--mode=eval: {workdir}/checkpoints has no checkpoint; train first")
  state, _, step = restored
  row = {
    "step": step,
    **evaluate(comp, make_eval_step(comp), state.params, config),
    "devices": device_label(),
  }
  console(f"checkpoint {step}: eval_loss {row['eval_loss']:.4f} over {config.eval_steps} batches")
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "eval.json"), "w") as f:
      json.dump(row, f, indent=2)
  return row
