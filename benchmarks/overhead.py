"""The template's training loop against a bare hand-written JAX loop on the same model, mesh, shardings,
optimizer and batches, interleaved A B A B in one run. Prints both median step times and the ratio
bare / template (1.0: no overhead; the goal is >= 0.97).

  .venv/bin/python benchmarks/overhead.py [--config=configs/smoke_cpu.py] [--steps=60] [--rounds=2]

The bare loop is jit(loss and grad, optax update) with donated state over batches already on the
devices: nothing else. The template's figure is the median `step_time_s` of its metrics rows over the
same number of steps (log_every=10; saving and evaluating are excluded from those rows, and switched
off here: eval_steps=0, one checkpoint at the end). A gap is host work per step: syncs, copies, Python.
On logical CPU devices both share the same cores; the ratio, not the absolute time, is the figure.
"""

import argparse
import json
import os
import runpy
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(path: str, steps: int):
  config = runpy.run_path(path)["get_config"]()
  config.steps = steps
  config.log_every = 10
  config.eval_steps = 0
  config.eval_every = 0
  config.checkpoint.every = steps
  return config


def bare_step_time(config, steps: int) -> float:
  """Median seconds per step of the plain loop, over windows of 10 steps after a warm-up."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from data import pipeline
  from trainer import components

  comp = components.build(config)
  state = components.fresh_state(comp, config)
  params, opt_state = state.params, state.opt_state
  loss_sums = comp.experiment.loss_sums
  b = config.global_batch_size
  local = components.local_batches(comp)
  batches = [pipeline.to_global(local(t), comp.batch_sharding, b) for t in range(steps)]

  def loss(params, batch):
    with nnx.logical_axis_rules(comp.rules):  # The model's own activation constraints, as in training.
      total, count, _ = loss_sums(comp.mdef.merge(params, {}), batch, None)  # LM: no variables or dropout.
    return total / jnp.maximum(count, 1.0)

  def step(params, opt_state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = comp.tx.update(grads, opt_state, params, steps=comp.steps)
    return optax.apply_updates(params, updates), opt_state

  shardings = (comp.shardings.params, comp.shardings.opt_state)
  step = jax.jit(
    step, in_shardings=(*shardings, comp.batch_sharding), out_shardings=shardings, donate_argnums=(0, 1)
  )
  with jax.set_mesh(comp.mesh):
    params, opt_state = step(params, opt_state, batches[0])  # Compile and warm up.
    jax.block_until_ready(params)
    times = []
    for start in range(1, steps - 9, 10):
      t0 = time.perf_counter()
      for t in range(start, start + 10):
        params, opt_state = step(params, opt_state, batches[t])
      jax.block_until_ready(params)
      times.append((time.perf_counter() - t0) / 10)
  return statistics.median(times)


def template_step_time(config) -> float:
  from trainer.train import train

  with tempfile.TemporaryDirectory() as workdir:
    train(config, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [r for r in map(json.loads, f) if "loss" in r]
  return statistics.median(r["step_time_s"] for r in rows[1:])  # The first window includes warm-up.


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="configs/smoke_cpu.py")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--cpu_devices", type=int, default=8)
  args = parser.parse_args()

  from trainer.cluster import runtime

  runtime.configure_cpu_devices(args.cpu_devices)  # Before anything touches jax.devices().
  from absl import logging

  from trainer.observe.metrics import device_label

  logging.set_verbosity(logging.WARNING)
  config = _config(args.config, args.steps)
  print(f"devices: {device_label()}; {args.config}; {args.steps} steps per run, {args.rounds} rounds A B")
  bare, template = [], []
  for _ in range(args.rounds):
    bare.append(bare_step_time(config, args.steps))
    template.append(template_step_time(config))
    print(f"  bare {1e3 * bare[-1]:7.2f} ms/step   template {1e3 * template[-1]:7.2f} ms/step")
  b, t = statistics.median(bare), statistics.median(template)
  print(
    f"median: bare {1e3 * b:.2f} ms/step, template {1e3 * t:.2f} ms/step; ratio bare/template {b / t:.3f}"
  )


if __name__ == "__main__":
  main()
