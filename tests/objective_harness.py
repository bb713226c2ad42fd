"""Runs the trainer's real jitted step for a few steps on chosen devices, outside the full loop."""

import jax

from data import pipeline
from trainer import components
from trainer.step import make_train_step


def run_steps(config, devices, steps: int, init_params=None):
  """Returns (theta_0, [per-step metrics incl. grads], final state) on a mesh over `devices`."""
  comp = components.build(config, devices)
  state = components.fresh_state(comp, config)
  theta0 = jax.device_get(state.params)
  step = make_train_step(comp, config.microbatches, with_grads=True)
  b = config.global_batch_size
  local = components.local_batches(comp)
  metrics = []
  for t in range(steps):
    with jax.set_mesh(comp.mesh):
      state, m = step(state, pipeline.to_global(local(t), comp.batch_sharding, b))
    metrics.append(jax.device_get(m))
  return theta0, metrics, state, comp
