"""The mixture of experts' routings against each other on one model, interleaved A B C A B C in one run:
capacity (per-sequence expert buffers), every (every expert on every token, the top k kept: the fork a
user writes first) and dropless (grouped matmuls by jax.lax.ragged_dot), at 8 and 32 experts.

  .venv/bin/python benchmarks/moe_routing.py [--experts=8,32] [--routings=capacity,every,dropless] \
      [--seconds=3] [--rounds=3]

The model is configs/moe_mt_peer.py's (d_model 128, 2 layers, top 2 of E SwiGLU experts of 512, batch
8 x 128 tokens, bf16 compute) with E and the routing changed, on 8 logical CPU devices (fsdp=8; no
expert axis: each device routes its own sequences). Every point is compiled first; then each round
times every point in turn for about `seconds` (the same batch, state donated; the step count fixed
in the first round), so that a slow stretch of the shared cores hits every routing alike. Prints per
point the median step time over rounds, tokens/s and three FLOPs counts per token (forward and
backward, in MFLOP):
  model     experiments/lm.py model_flops_per_example: the active parameters only (top_k experts), what
            MFU's numerator counts whatever the routing computes; the same for the three routings.
  computed  the matmul FLOPs the routing's program does (same formula, with the expert rows it
            multiplies): every E experts per token; capacity E x C slots per sequence (C = ceil(1.25 x
            L x k / E), empty slots included); dropless on XLA:CPU, where ragged_dot is one dense dot of
            every row against every group, k x E expert rows per token. The ideal dropless is `model`.
  XLA       the compiled step's cost analysis, over all devices (elementwise work and gathers included).
and `sent MB`, the bytes each device sends per step in the compiled step's collectives (inspect's
count): under capacity and every, fsdp gathers every expert's weights and all-reduces their gradients,
so it grows with E; dropless sorts the whole batch's assignments (its expert ids are gathered) and
keeps the expert weights split along embed, all-reducing partial sums of the sorted rows instead.
Then the ratio capacity / every (and capacity / dropless) in tokens/s per expert count.
On logical CPU devices all devices share the same cores: the ratio, not the absolute time, is the figure.

Measured (jax 0.12.0.1, 8 logical CPU devices on 2 shared cores; 2 minutes):
  routing   experts  ms/step  tokens/s   model  computed     XLA  sent MB
  capacity        8    143.3     7,147     6.7       7.9     8.3     37.2
  every           8    232.4     4,407     6.7      20.9    21.5     37.2
  dropless        8   1092.9       937     6.7      39.7    42.4     52.3
  capacity       32    431.3     2,374     6.7       7.9     8.8    136.3
  every          32    937.6     1,092     6.7      77.5    79.9    136.3
  dropless       32   5160.0       198     6.7     153.0   160.7     52.3
  tokens/s capacity / every: 1.62x at 8 experts, 2.17x at 32 (capacity / dropless: 7.63x, 11.97x)
Capacity computes 1.18x the active FLOPs at either expert count, every 3.1x and 11.6x. Capacity's step
still takes 3.0x longer at 32 experts than at 8: its collectives carry 3.7x the bytes and AdamW updates
3.7x the parameters (13.0M, against 3.5M), work that grows with the expert count on an fsdp mesh.
"""

import argparse
import os
import runpy
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "moe_mt_peer.py"
)


def point_config(experts: int, routing: str):
  config = runpy.run_path(CONFIG)["get_config"]()
  config.model.moe.num_experts = experts
  config.model.moe.routing = routing
  return config


def computed_flops_per_token(config, model_flops_per_token: float) -> float:
  """The matmul FLOPs per token (forward and backward) of the routing's program (module docstring)."""
  from model.moe import capacity

  m, seq = config.model, config.data.seq_len
  e, k = m.moe.num_experts, m.moe.top_k
  rows = {
    "every": e,
    "capacity": e * capacity(seq, k, e, m.moe.capacity_factor) / seq,
    "dropless": k * e,  # XLA:CPU: each of the k rows of a token against all E groups.
  }[m.moe.routing]
  expert = 6 * 3 * m.embed_dim * (m.moe.expert_dim or m.mlp_dim)  # One token through one expert.
  return model_flops_per_token + (m.num_layers - m.moe.first_dense) * (rows - k) * expert


def prepare(config) -> dict:
  """Components, a state, one batch and the compiled step of one point, with its FLOPs counts."""
  import jax

  from data import pipeline
  from experiments import lm
  from trainer import components, state
  from trainer.observe import flops
  from trainer.observe.collectives import collectives
  from trainer.step import make_train_step

  comp = components.build(config)
  st = components.fresh_state(comp, config)
  batch = pipeline.to_global(components.local_batches(comp)(0), comp.batch_sharding, config.global_batch_size)
  with jax.set_mesh(comp.mesh):
    step = make_train_step(comp, config.microbatches).lower(st, batch).compile()
  tokens = config.global_batch_size * config.data.seq_len
  model = lm.model_flops_per_example(config, state.param_count(st.params)) / config.data.seq_len
  return {
    "step": step,
    "state": st,
    "batch": batch,
    "tokens": tokens,
    "model": model,
    "computed": computed_flops_per_token(config, model),
    "xla": flops.compiled_per_device(step) * len(comp.mesh.devices.flat) / tokens,
    "sent": sum(c["sent_bytes_per_device"] for c in collectives(step.as_text(), comp.mesh)),
    "times": [],
  }


def time_steps(point: dict, seconds: float) -> float:
  """Seconds per step over the point's number of steps: in the first round, after one untimed step,
  enough steps for about `seconds` (at least 2), kept for the later rounds."""
  import jax

  st = point["state"]
  if "steps" not in point:
    t0 = time.perf_counter()
    st, m = point["step"](st, point["batch"])
    jax.block_until_ready(m)
    point["steps"] = max(2, round(seconds / (time.perf_counter() - t0)))
  t0 = time.perf_counter()
  for _ in range(point["steps"]):
    st, m = point["step"](st, point["batch"])
  jax.block_until_ready(m)
  point["state"] = st
  return (time.perf_counter() - t0) / point["steps"]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--experts", default="8,32")
  parser.add_argument("--routings", default="capacity,every,dropless")
  parser.add_argument("--seconds", type=float, default=3.0, help="timed per point and round")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()

  from trainer.cluster import runtime

  runtime.configure_cpu_devices(8)  # Before anything touches jax.devices().
  from absl import logging

  from trainer.observe.metrics import device_label

  logging.set_verbosity(logging.WARNING)
  experts = [int(e) for e in args.experts.split(",")]
  routings = args.routings.split(",")
  print(f"devices: {device_label()}; {CONFIG} with num_experts and routing changed")
  print(f"about {args.seconds} s of steps per point and round, {args.rounds} rounds", flush=True)
  points = {}
  for e in experts:
    for routing in routings:
      t0 = time.perf_counter()
      points[e, routing] = prepare(point_config(e, routing))
      print(f"  compiled {routing} at {e} experts in {time.perf_counter() - t0:.1f} s", flush=True)
  for r in range(args.rounds):
    for (e, routing), point in points.items():
      point["times"].append(time_steps(point, args.seconds))
      ms = 1e3 * point["times"][-1]
      print(
        f"  round {r + 1}: {routing:<8} {e:>2} experts {ms:8.1f} ms/step ({point['steps']} steps)", flush=True
      )
  print(
    f"\n{'routing':<9}{'experts':>8}{'ms/step':>9}{'tokens/s':>10}"
    f"{'model':>8}{'computed':>10}{'XLA':>8}{'sent MB':>9}   (MFLOP per token, forward and backward)"
  )
  tokens_per_s = {}
  for (e, routing), p in points.items():
    step_s = statistics.median(p["times"])
    tokens_per_s[e, routing] = p["tokens"] / step_s
    print(
      f"{routing:<9}{e:>8}{1e3 * step_s:>9.1f}{tokens_per_s[e, routing]:>10,.0f}"
      f"{p['model'] / 1e6:>8.1f}{p['computed'] / 1e6:>10.1f}{p['xla'] / 1e6:>8.1f}{p['sent'] / 1e6:>9.1f}"
    )
  for e in experts:
    for other in routings:
      if other != "capacity" and (e, "capacity") in tokens_per_s:
        ratio = tokens_per_s[e, "capacity"] / tokens_per_s[e, other]
        print(f"tokens/s capacity / {other} at {e} experts: {ratio:.2f}x")


if __name__ == "__main__":
  main()
