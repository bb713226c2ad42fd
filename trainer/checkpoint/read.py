"""Open a run's checkpoint anywhere: its params, variables, EMA (and optimizer state) as numpy arrays,
with its config.

In a notebook, on whatever devices are present (one CPU is enough):

  from trainer.checkpoint.read import load
  run = load("runs/smoke")            # The newest checkpoint; step=N for another.
  run.params["layers"]["attn"]["wq"]  # Plain numpy arrays, nested as the model names them.
  run.config.model.embed_dim          # The config the run was trained with.
  run.variables, run.ema              # The model's other variables; the params' average ({}: none).

A checkpoint saved on any mesh or device count restores here onto this process's first device (Orbax
needs a target for that: it is built from the saved config, so nothing about the run's topology is
needed). trainer/modes/export.py writes what it reads as safetensors.
"""

import functools
from typing import Any, NamedTuple

import jax
import ml_collections
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from errors import UserError
from trainer import components
from trainer import state as state_lib
from trainer.checkpoint import store, tree
from trainer.config import assemble
from trainer.optimizer import make_optimizer


class Loaded(NamedTuple):
  params: dict  # Nested dict of numpy arrays.
  variables: dict  # The model's other variables (trainer/state.py), {} for none.
  ema: dict  # The params' moving average, {} when ema.decay was 0.
  opt_state: Any  # The optax state as numpy arrays (with_optimizer=True), else None.
  config: ml_collections.ConfigDict  # The config the checkpoint was trained with.
  step: int

  def weights(self, ema: bool = False) -> dict:
    """The params, or (`ema`) their moving average: what export and sampling take."""
    if ema and not self.ema:
      raise UserError(f"checkpoint {self.step} has no average of the params: it was trained with ema.decay=0")
    return self.ema if ema else self.params


def _config_from_json(saved: dict) -> ml_collections.ConfigDict:
  """The locked config of the saved experiment with the saved values (JSON lists back to tuples)."""
  config = assemble.config(saved["experiment"])
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
  if not store.has_checkpoints(workdir):
    raise UserError(f"{workdir} has no checkpoints/STEP directory: train there first")
  with store.read_only(workdir) as manager:
    state, config, step = _restore(manager, workdir, step)
  opt_state = state.opt_state if with_optimizer else None
  return Loaded(state.params, state.variables, state.ema, opt_state, config, step)


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
  tx = make_optimizer(config.optimizer, mdef.logical_specs)
  here = SingleDeviceSharding(jax.local_devices()[0])
  shapes = state_lib.abstract_shapes(mdef, tx, config.ema.decay > 0)
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=here), shapes)
  target, complete = tree.restore_target(step, manager.item_metadata(step)["state"], target)
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  return jax.device_get(complete(restored["state"])), config, step
