"""Open a run's checkpoint anywhere, and write its weights as safetensors.

In a notebook, on whatever devices are present (one CPU is enough):

  from trainer.modes.export import load
  run = load("runs/smoke")            # The newest checkpoint; step=N for another.
  run.params["layers"]["attn"]["wq"]  # Plain numpy arrays, nested as the model names them.
  run.config.model.embed_dim          # The config the run was trained with.

From the shell:

  python -m trainer.modes.export --workdir=runs/smoke [--step=N] --out=smoke.safetensors

writes every parameter under its tree path ('blocks/0/attn/wq') with the config and step as the file's
metadata; `safetensors.numpy.load_file` reads it back. A checkpoint saved on any mesh or device count
restores here onto this process's first device (Orbax needs a target for that: it is built from the
saved config, so nothing about the run's topology is needed).
"""

import functools
import os
import sys
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.sharding import SingleDeviceSharding

from errors import UserError
from trainer import components, rundir
from trainer import state as state_lib
from trainer.checkpoint import store
from trainer.config import assemble
from trainer.optimizer import make_optimizer


class Loaded(NamedTuple):
  params: dict  # Nested dict of numpy arrays.
  opt_state: Any  # The optax state as numpy arrays (with_optimizer=True), else None.
  config: ml_collections.ConfigDict  # The config the checkpoint was trained with.
  step: int


def _config_from_json(saved: dict) -> ml_collections.ConfigDict:
  """The locked config of the saved experiment with the saved values (JSON lists back to tuples)."""
  from configs import base

  config = base.get_config(saved["experiment"])
  config.unlock()

  def put(prefix: str, tree: dict) -> None:
    for key, value in tree.items():
      if isinstance(value, dict):
        put(f"{prefix}{key}.", value)
      else:
        assemble.set_key(config, prefix + key, tuple(value) if isinstance(value, list) else value)

  put("", saved)
  config.lock()
  return config


def load(workdir: str, step: int | None = None, with_optimizer: bool = False) -> Loaded:
  """The params (and optionally the optimizer state) of checkpoint `step` (None: the newest) of the
  run in `workdir`, as numpy arrays, with its config."""
  directory = rundir.checkpoints(os.path.abspath(workdir))
  if not store.has_checkpoints(workdir):
    raise UserError(f"{workdir} has no checkpoints/STEP directory: train there first")
  handlers = store.Checkpoints.item_handlers()
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)  # Orbax warns that a read-only manager will not save.
  try:
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(directory, options=options, item_handlers=handlers) as manager:
      state, config, step = _restore(manager, workdir, step)
  finally:
    logging.set_verbosity(verbosity)
  return Loaded(state.params, state.opt_state if with_optimizer else None, config, step)


def _restore(manager, workdir: str, step: int | None):
  """(state as numpy arrays, config, step) of checkpoint `step` (None: the newest)."""
  steps = manager.all_steps()
  step = max(steps) if step is None else step
  if step not in steps:
    raise UserError(f"{workdir} has no checkpoint {step}; it has {sorted(steps)}")
  saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
  config = _config_from_json(saved)
  experiment = components.load_experiment(config)
  mdef = state_lib.model_def(functools.partial(experiment.build_model, config))
  tx, _ = make_optimizer(config.optimizer, config.steps, mdef.logical_specs)
  here = SingleDeviceSharding(jax.local_devices()[0])
  target = state_lib.abstract_state(jax.tree.map(lambda _: here, _shapes(mdef, tx)), mdef, tx)
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  return jax.device_get(restored["state"]), config, step


def _shapes(mdef, tx) -> state_lib.TrainState:
  """A TrainState of placeholders, one per leaf: the tree abstract_state maps shardings over."""
  params = nnx.to_pure_dict(mdef.abstract_state)
  return state_lib.TrainState(step=0, params=params, opt_state=jax.eval_shape(tx.init, params), rng=0)


def named_tensors(params) -> dict[str, np.ndarray]:
  """{'blocks/0/attn/wq': array, ...}: every parameter under its tree path."""
  return {
    "/".join(state_lib.path_keys(path)): np.ascontiguousarray(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
  }


def export(workdir: str, out: str, step: int | None = None) -> Loaded:
  """Writes checkpoint `step`'s params to `out` (safetensors), the config and step as metadata."""
  from safetensors.numpy import save_file

  run = load(workdir, step)
  metadata = {"config": run.config.to_json(), "step": str(run.step), "format": "np"}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  save_file(named_tensors(run.params), out, metadata=metadata)
  return run


def main(argv=None) -> None:
  import argparse

  parser = argparse.ArgumentParser(description="Write a run's params as a safetensors file.")
  parser.add_argument("--workdir", required=True, help="the run's --workdir")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  parser.add_argument("--out", required=True, help="FILE.safetensors to write")
  args = parser.parse_args(argv)
  try:
    run = export(args.workdir, args.out, args.step)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  count = sum(x.size for x in jax.tree.leaves(run.params))
  print(f"wrote {count:,} parameters of checkpoint {run.step} ({run.config.experiment}) to {args.out}")


if __name__ == "__main__":
  main()
