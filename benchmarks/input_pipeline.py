"""Does the input pipeline keep up with the train step? Prints, measured in one run:
  - the pipeline's batches/s (host: records -> this process's numpy rows -> global jax.Array),
  - the train step's batches/s on a fixed batch (compiled, blocking every step),
  - the fraction of step time the real training loop waited for data at steady state.

  .venv/bin/python benchmarks/input_pipeline.py [--cpu_devices=8] [--steps=120]

Logical CPU devices: the step figures say nothing about real accelerators or interconnects.
"""

import argparse
import json
import os
import runpy
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--cpu_devices", type=int, default=8)
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--config", default="configs/smoke_cpu.py")
  args = parser.parse_args()

  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  from absl import flags, logging

  logging.set_verbosity(logging.WARNING)
  from data import pipeline
  from trainer import components
  from trainer.observe.metrics import device_label
  from trainer.step import make_train_step
  from trainer.train import train

  flags.FLAGS.mark_as_parsed()
  config = runpy.run_path(args.config)["get_config"]()
  comp = components.build(config)
  b = config.global_batch_size
  local = components.local_batches(comp)
  n = 40

  # 1. The pipeline alone, as the loop uses it (reader threads, prefetch).
  it = pipeline.local_batch_iterator(local, 0, n, config.data.read_threads, config.data.prefetch)
  t0 = time.perf_counter()
  for _, batch in it:
    jax.block_until_ready(pipeline.to_global(batch, comp.batch_sharding, b))
  pipeline_bps = n / (time.perf_counter() - t0)

  # 2. The train step alone on one fixed batch.
  state = components.fresh_state(comp, config)
  batch = pipeline.to_global(local(0), comp.batch_sharding, b)
  step = make_train_step(comp, config.microbatches)
  with jax.set_mesh(comp.mesh):
    step = step.lower(state, batch).compile()
  state, m = step(state, batch)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(n):
    state, m = step(state, batch)
    jax.block_until_ready(m)
  step_bps = n / (time.perf_counter() - t0)

  # 3. The real loop: data wait over step time, leaving out the first window (compile, warm-up).
  with tempfile.TemporaryDirectory() as workdir:
    config.steps, config.log_every, config.eval_steps, config.eval_every = args.steps, 20, 0, 0
    config.checkpoint.every = 10 * args.steps
    train(config, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f][1:]
    with open(os.path.join(workdir, "processes", "process_0.jsonl")) as f:
      windows = [r for r in map(json.loads, f) if "batch_fetch_s" in r][1:]
  step_time = sum(r["step_time_s"] for r in rows)
  wait = sum(r["data_wait_s"] for r in rows) / step_time
  fetch = sum(w["batch_fetch_s"] / w["steps"] for w in windows) / step_time

  print(f"devices: {device_label()}; config {args.config}; global batch {b} x {config.data.seq_len}")
  print(f"input pipeline: {pipeline_bps:8.1f} batches/s")
  print(f"train step:     {step_bps:8.1f} batches/s   (pipeline / step = {pipeline_bps / step_bps:.1f}x)")
  print(f"training loop:  data wait = {100 * wait:.2f}% of step time over steps 21..{args.steps} (goal < 1%)")
  print(f"                taking the batch, GIL contention included = {100 * fetch:.2f}% of step time")


if __name__ == "__main__":
  main()
