"""How long does an async checkpoint block the training loop, and how fast is the write? Prints, for the
smoke model and a ~100M-parameter model (params + AdamW moments) on logical CPU devices:
  blocking time (the loop waits: device-to-host copy), total write time (with the checksums written
  after the commit, trainer/checkpoint/proof.py), throughput (GB/s),
  and blocking as a fraction of the write (goal: <= 10%).

  .venv/bin/python benchmarks/checkpoint.py [--cpu_devices=8] [--saves=3]

Logical CPU devices on one disk: the figures say nothing about accelerators or a cluster file system.
"""

import argparse
import os
import runpy
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LARGE = {  # ~107M parameters: 10 layers of width 768, vocabulary 8192.
  "model.embed_dim": 768,
  "model.num_layers": 10,
  "model.num_heads": 12,
  "model.mlp_dim": 3072,
  "model.vocab_size": 8192,
}


def smoke_config(overrides: dict):
  """configs/smoke_cpu.py with `{"section.key": value}` overrides (LARGE, a mesh)."""
  config = runpy.run_path("configs/smoke_cpu.py")["get_config"]()
  for key, value in overrides.items():
    section, leaf = key.split(".")
    config[section][leaf] = value
  return config


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--cpu_devices", type=int, default=8)
  parser.add_argument("--saves", type=int, default=3)
  args = parser.parse_args()

  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  from trainer import components
  from trainer import state as state_lib
  from trainer.checkpoint import store
  from trainer.observe.metrics import device_label

  print(f"devices: {device_label()}")
  for name, overrides in (("smoke", {}), ("~100M", LARGE)):
    config = smoke_config(overrides)
    comp = components.build(config)
    state = components.fresh_state(comp, config)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    params = state_lib.param_count(state.params)
    meta = store.run_metadata(comp, config)
    blocking, write = [], []
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as workdir:
      ckpt = store.Checkpoints(workdir, keep=2, keep_every=0)
      for i in range(1, args.saves + 1):
        position = store.data_position(i, 0, comp)
        t0 = time.perf_counter()
        ckpt.save(i, state, position, config, meta)
        t1 = time.perf_counter()
        ckpt.wait()
        t2 = time.perf_counter()
        blocking.append(t1 - t0)
        write.append(t2 - t0)
      ckpt.close()
    b, w = statistics.median(blocking), statistics.median(write)
    print(
      f"{name:>6}: {params / 1e6:7.1f}M params, state {nbytes / 1e9:6.3f} GB | blocking {b:6.3f} s | "
      f"write {w:6.3f} s | {nbytes / 1e9 / w:5.2f} GB/s | blocking / write = {100 * b / w:5.1f}% "
      f"(median of {args.saves})"
    )


if __name__ == "__main__":
  main()
