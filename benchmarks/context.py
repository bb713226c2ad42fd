"""Context parallelism measured: memory per device as the sequence is split, and tokens/s of its two
attention strategies and of a split sequence against batch-only splitting.

  .venv/bin/python benchmarks/context.py memory [--lengths=32768,131072] [--contexts=1,4,8]
  .venv/bin/python benchmarks/context.py speed [--seconds=3] [--rounds=3]

memory  `--mode=inspect` of configs/lm_8b.py on 64 logical CPU devices (an ahead-of-time compile,
        nothing allocated) at each length and context size, with model.attention=flash and as many
        sequences as the batch axes need (64 / context: one sequence's worth of tokens per device at
        every context size). Prints the compiled step's memory per device (arguments, temporaries)
        and the parameters' and optimizer's share: activations fall about 1/context, the parameters'
        and optimizer's bytes grow with it (FSDP splits them over fsdp = 64 / context only).
speed   configs/long_smoke_cpu.py's model (2 layers, d_model 128, 2,048 tokens, 8 sequences) on 8
        logical CPU devices: ring against all-gather on data 2 x context 4, and context 4 against
        data 8 without a context axis (flash attention both), interleaved A B C A B C in one run.
        CPU collectives are synchronous: the ring's overlap is a GPU matter (model/context.py).

Measured (jax 0.12.0.1, 2 shared cores, 2026-12-05; the tables in docs/guides/long-context.md):
  memory at 131,072 tokens: compiled step 1005.4 / 313.3 / 186.2 GB per device at context 1 / 4 / 8
  (temporaries 1002.4 / 301.3 / 162.1 GB), params + optimizer 1.51 / 6.03 / 12.05 GB;
  speed: ring 2620.1 ms/step, all_gather 2583.9, batch only 2637.4: ring / all_gather 0.99x,
  context 4 / batch only 1.01x.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def memory(lengths, contexts) -> None:
  print(f"{'tokens':>8} {'context':>7} {'seqs':>5} {'step GB':>8} {'temp GB':>8} {'params+opt GB':>14}")
  for n in lengths:
    for c in contexts:
      with tempfile.TemporaryDirectory() as workdir:
        flags = [
          f"--config.data.seq_len={n}",
          f"--config.mesh.context={c}",
          f"--config.global_batch_size={64 // c}",
          "--config.model.attention=flash",
          "--config.model.loss_chunk=1024",
        ]
        cmd = [sys.executable, "main.py", "--config=configs/lm_8b.py", "--mode=inspect", "--cpu_devices=64"]
        r = subprocess.run([*cmd, *flags, f"--workdir={workdir}"], cwd=REPO, capture_output=True, text=True)
        if r.returncode:
          print(f"{n:>8} {c:>7} failed: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}")
          continue
        with open(os.path.join(workdir, "inspect.json")) as f:
          out = json.load(f)
      mem, tot = out["compiled"]["memory_per_device"], out["totals"]
      state = tot["param_bytes_per_device_max"] + tot["opt_state_bytes_per_device_max"]
      step = mem.get("total", mem["argument"] + mem["temp"])
      print(
        f"{n:>8} {c:>7} {64 // c:>5} {step / 1e9:>8.1f} {mem['temp'] / 1e9:>8.1f} {state / 1e9:>14.2f}",
        flush=True,
      )


def _point(overrides: dict) -> dict:
  import jax

  from configs import long_smoke_cpu
  from data import pipeline
  from trainer import components
  from trainer.config import assemble
  from trainer.step import make_train_step

  config = long_smoke_cpu.get_config()
  for key, value in overrides.items():
    assemble.set_key(config, key, value)
  comp = components.build(config)
  state = components.fresh_state(comp, config)
  batch = pipeline.to_global(components.local_batches(comp)(0), comp.batch_sharding, config.global_batch_size)
  with jax.set_mesh(comp.mesh):
    step = make_train_step(comp, config.microbatches).lower(state, batch).compile()
  return {
    "step": step,
    "state": state,
    "batch": batch,
    "tokens": config.global_batch_size * config.data.seq_len,
  }


def speed(seconds: float, rounds: int) -> None:
  from benchmarks import moe_routing  # Its timing: the same points, state donated, steps fixed once.
  from trainer.cluster import runtime

  runtime.configure_cpu_devices(8)
  split = {"mesh.data": 2, "mesh.context": 4}
  points = {
    "ring, data 2 x context 4": _point(split | {"model.context_attention": "ring"}),
    "all_gather, data 2 x context 4": _point(split | {"model.context_attention": "all_gather"}),
    "batch only, data 8": _point({"mesh.data": 8, "mesh.context": 1}),
  }
  times = {name: [] for name in points}
  for _ in range(rounds):
    for name, point in points.items():
      times[name].append(moe_routing.time_steps(point, seconds))
  ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
  for name, point in points.items():
    print(f"{name:<32} {ms[name]:>8.1f} ms/step {point['tokens'] / ms[name] * 1e3:>9,.0f} tokens/s")
  ring, gather, batch = ms.values()
  print(
    f"ring / all_gather tokens/s: {gather / ring:.2f}x; context 4 (ring) / batch only: {batch / ring:.2f}x"
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("part", choices=("memory", "speed"))
  parser.add_argument("--lengths", default="32768,131072")
  parser.add_argument("--contexts", default="1,4,8")
  parser.add_argument("--seconds", type=float, default=3.0, help="timed per point and round")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  if args.part == "memory":
    memory([int(n) for n in args.lengths.split(",")], [int(c) for c in args.contexts.split(",")])
  else:
    speed(args.seconds, args.rounds)


if __name__ == "__main__":
  main()
