"""Throughput and scaling efficiency of the train step on 1, 2, 4 and 8 devices (fixed global batch),
and MFU when you give the devices' peak FLOP/s. Prints, measured in one run:
  devices, mesh, step time, tokens/s, speed-up and efficiency vs 1 device, model TFLOP/s, MFU.

  .venv/bin/python benchmarks/scaling.py [--strategy=dp] [--steps=20] [--peak_tflops=PER_DEVICE]

Model FLOPs per step are 6 x parameters x tokens (forward and backward of the matmuls; attention
scores are left out, as in the usual MFU convention). On logical CPU devices every "device" shares the
same cores: efficiency there measures overhead, not a real interconnect, and MFU is not meaningful.
"""

import argparse
import os
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--strategy", default="dp", choices=["dp", "zero1", "fsdp", "fsdp_tp"])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--peak_tflops", type=float, default=None, help="peak TFLOP/s of one device")
  parser.add_argument("--cpu_devices", type=int, default=8)
  args = parser.parse_args()

  from trainer import runtime

  runtime.configure_cpu_devices(args.cpu_devices)  # Before anything touches jax.devices().
  import jax
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  from data import pipeline
  from trainer import components
  from trainer import state as state_lib
  from trainer.metrics import device_label
  from trainer.step import make_train_step

  print(f"devices: {device_label()}; strategy {args.strategy}; {args.steps} timed steps after one warm-up")
  header = ("devices", 7), ("mesh", 10), ("step ms", 8), ("tokens/s", 10), ("speed-up", 8), ("effic.", 7)
  print(" ".join(f"{name:>{width}}" for name, width in header) + f" {'TFLOP/s':>8} {'MFU':>6}")
  base_time = None
  for n in (1, 2, 4, 8):
    if n > len(jax.devices()):
      break
    config = runpy.run_path("configs/smoke_cpu.py")["get_config"]()
    config.sharding.strategy = args.strategy
    tensor = 2 if args.strategy == "fsdp_tp" and n > 1 else 1
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = (
      (1, n // tensor, tensor) if "fsdp" in args.strategy else (n, 1, 1)
    )
    comp = components.build(config, jax.devices()[:n])
    state = components.init_state(comp, config)
    local = components.local_batches(comp)
    batch = pipeline.to_global(local(0), comp.batch_sharding, config.global_batch_size)
    with jax.set_mesh(comp.mesh):
      step = make_train_step(comp, config.microbatches).lower(state, batch).compile()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(args.steps):
      state, m = step(state, batch)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / args.steps
    tokens = float(m["count"])
    flops = 6 * state_lib.param_count(state.params) * tokens / dt
    base_time = base_time or dt
    mfu = f"{100 * flops / (n * args.peak_tflops * 1e12):5.1f}%" if args.peak_tflops else "   n/a"
    mesh = "x".join(str(s) for s in comp.mesh.shape.values())
    print(
      f"{n:>7} {mesh:>10} {1e3 * dt:>8.1f} {tokens / dt:>10,.0f} {base_time / dt:>7.2f}x "
      f"{100 * base_time / dt / n:>6.1f}% {flops / 1e12:>8.4f} {mfu:>6}"
    )


if __name__ == "__main__":
  main()
