"""Compile time of the train step against depth, scanned and unrolled, measured in one run.

  .venv/bin/python benchmarks/compile_time.py [--config=configs/smoke_cpu.py] [--layers=2,8,32]

Each point traces, lowers and compiles the real train step ahead of time (as --mode=inspect does:
nothing is allocated) on 8 logical CPU devices, with the persistent cache off, after one warm-up
compile, and prints seconds per depth and the ratio to the shallowest. Scanned layers compile one
block whatever the depth; unrolled ones compile num_layers copies.
"""

import argparse
import os
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_seconds(config) -> float:
  from trainer.modes.inspect import compile_train_step

  t0 = time.perf_counter()
  compile_train_step(config)
  return time.perf_counter() - t0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/smoke_cpu.py")
  parser.add_argument("--layers", default="2,8,32")
  args = parser.parse_args()
  from trainer.cluster import runtime

  runtime.configure_cpu_devices(8)
  import jax

  jax.config.update("jax_enable_compilation_cache", False)  # Every point compiles from scratch.
  depths = [int(n) for n in args.layers.split(",")]
  warm = runpy.run_path(args.config)["get_config"]()
  warm.model.num_layers = 1
  compile_seconds(warm)  # Pays JAX's one-time tracing and backend start-up outside the figures.
  print(f"{'layers':>6} {'scanned s':>10} {'unrolled s':>11}  (logical CPU devices: {len(jax.devices())})")
  rows = {}
  for n in depths:
    times = []
    for scan in (True, False):
      config = runpy.run_path(args.config)["get_config"]()
      config.model.num_layers, config.model.scan_layers = n, scan
      times.append(compile_seconds(config))
    rows[n] = times
    print(f"{n:>6} {times[0]:>10.2f} {times[1]:>11.2f}")
  lo, hi = depths[0], depths[-1]
  scanned, unrolled = (rows[hi][i] / rows[lo][i] for i in (0, 1))
  print(f"{hi} vs {lo} layers: scanned {scanned:.2f}x, unrolled {unrolled:.2f}x")


if __name__ == "__main__":
  main()
