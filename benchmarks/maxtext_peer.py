"""Ours against MaxText 0.2.5, interleaved A B A B in one run: configs/lm_mt_peer.py's dense model, or
with `--moe` configs/moe_mt_peer.py's mixture of experts against MaxText's MoE on the same shapes, or
with `--context` configs/long_mt_peer.py's context parallelism against MaxText's at 2,048 tokens.

  .venv/bin/python benchmarks/maxtext_peer.py [--setup] [--moe [--dropless] | --context] [--steps=60]
    [--rounds=2]

MaxText needs Python 3.12: `--setup` makes `.venv-maxtext` (PYENV_VERSION=3.12.1 python3.12 -m venv,
then pip install "maxtext[tpu]==0.2.5": about 3 minutes and 2.8 GB) when it is missing. Without that
venv it says so and measures ours alone. Both run on 8 logical CPU devices with fsdp=8, the same
shapes, batch 8 x 128 tokens, bf16 compute and fp32 params, synthetic data, no checkpoints. MaxText
runs twice per round: with its defaults (scanned layers, full remat: a second forward pass per step)
and as ours runs (`remat_policy=minimal scan_layers=false`), so the ratio is shown against both.

Per round and side: the median step time over the steps after the first 10 (ours: `step_time_s` of
metrics rows of 10 steps; MaxText: its `completed step: S, seconds: T` lines), tokens/s from it, and
launch to first step: ours from a 3-step run that logs every step (cold: empty compilation cache;
warm: the same cache again), MaxText from its `completed step: 0` line (its cache off, as its
CPU default). Prints the medians over rounds and the ratio ours/MaxText in tokens/s.
On logical CPU devices both sides share the same cores: the ratio, not the absolute time, is the figure.

The MoE case (`--moe`): MaxText's Mixtral block with `num_experts=8 num_experts_per_tok=2
base_moe_mlp_dim=512 load_balance_loss_weight=0.01` against configs/moe_mt_peer.py (capacity routing at
1.25, the balance loss at 0.01). MaxText's MoE defaults do not suit XLA:CPU. `megablox=true` runs its
Pallas TPU kernel in interpret mode: no refusal, 12.8 to 16.9 s per step here (against 0.25 s below).
Its expert parallelism (`ici_expert_parallelism=8 megablox=false`) stops at its ragged exchange
(wrapped here):
  jax.errors.JaxRuntimeError: UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
  ThunkEmitter. Standalone elemental and reduction operations must be wrapped into fusions by
  FusionWrapper.
So MaxText runs with `megablox=false sparse_matmul=false capacity_factor=1.25` (its dense einsum
dispatch: the path that drops tokens at a capacity, 40 slots per expert and sequence as ours) and
expert parallelism 1 (fsdp=8, as ours). `--dropless` adds both dropless routings: ours (ragged_dot under
GSPMD), MaxText's sparse path (`sparse_matmul=true capacity_factor=-1`: ragged_dot per device).
Measured with `--moe --rounds=2` (jax 0.12.0.1, 8 logical CPU devices on 2 shared cores, 3.5 min):
  ours              median step 108.0 ms = 9,480 tokens/s; launch to first step: cold 18.5 s, warm 6.3 s
  maxtext           median step 163.8 ms = 6,253 tokens/s; launch to first step: cold 15.8 s
  maxtext_like_ours median step 162.8 ms = 6,292 tokens/s; launch to first step: cold 15.4 s
  tokens/s ours / maxtext: 1.52x; ours / maxtext_like_ours: 1.51x
Before model/moe.py ran its experts as [E, B x C, D] (the batch ahead of the experts, 5x slower in bf16
on XLA:CPU) it was 0.93x and 0.90x. With `--dropless` (the run before that change, 8 min): ours
dropless 1093.3 ms = 937 tokens/s against MaxText's sparse path 614.5 ms = 1,666 tokens/s, 0.56x: ours
sorts the whole batch's assignments on every device (their expert ids gathered) where MaxText's sparse
path sorts each device's own tokens; dropless is ours for one expert shard on GPUs, capacity for CPUs.

The context case (`--context`, 30 steps a run): the dense model at 2 sequences of 2,048 tokens on mesh
data 2 x context 4, as configs/long_mt_peer.py (flash attention in blocks of 256, a ring of key/value
chunks, each device an early and a late chunk) and MaxText's `ici_data_parallelism=2
ici_context_parallelism=4 ici_fsdp_parallelism=1 per_device_batch_size=0.25` with
`context_parallel_load_balance=true` (its DUAL_CHUNK_SWAP order) and `attention=dot_product` (what its
`autoselected` picks on CPU). MaxText runs context parallelism on CPU only with its default all-gather
strategy; `context_parallel_strategy=ring` stops at its config check:
  Value error, Ring context parallelism strategy (context_parallel_strategy='ring') is only supported on
  GPUs or TPU with attention=flash and use_tokamax_splash=True.
Measured on 2026-12-05 with `--context --rounds=2` (jax 0.12.0.1, 8 logical CPU devices on 2 shared
cores, 11.7 min):
  ours              median step 651.0 ms = 6,292 tokens/s; launch to first step: cold 67.2 s, warm 28.8 s
  maxtext           median step 1995.0 ms = 2,053 tokens/s; launch to first step: cold 19.5 s
  maxtext_like_ours median step 2179.0 ms = 1,880 tokens/s; launch to first step: cold 20.5 s
  tokens/s ours / maxtext: 3.06x; ours / maxtext_like_ours: 3.35x
Ours' launch includes checks.first_step (a second compilation on another mesh) and the flash kernels'
compilation; MaxText's dot-product attention computes every device's [512, 2,048] scores in full.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(REPO, ".venv-maxtext")
SKIP = 10  # Steps left out of the medians: compilation and warm-up.
MAXTEXT_ARGS = [
  "dataset_type=synthetic",
  "hardware=cpu",
  "skip_jax_distributed_system=true",
  "jax_cache_dir=",
  "per_device_batch_size=1",
  "base_emb_dim=128",
  "base_num_query_heads=4",
  "base_num_kv_heads=4",
  "base_mlp_dim=512",
  "base_num_decoder_layers=2",
  "head_dim=32",
  "max_target_length=128",
  "vocab_size=1024",
  "enable_checkpointing=false",
  "ici_fsdp_parallelism=8",
  "log_period=1",
]
_MAXTEXT_STEP = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def setup() -> None:
  if os.path.exists(os.path.join(VENV, "bin", "python")):
    return
  env = {**os.environ, "PYENV_VERSION": "3.12.1"}
  print("making .venv-maxtext (Python 3.12, maxtext[tpu]==0.2.5): a few minutes", flush=True)
  subprocess.run(["python3.12", "-m", "venv", VENV], check=True, env=env)
  subprocess.run([os.path.join(VENV, "bin", "pip"), "install", "-q", "maxtext[tpu]==0.2.5"], check=True)


def _ours(
  workdir: str, steps: int, log_every: int, cache: str, extra: list[str]
) -> tuple[float, list[float]]:
  """(seconds from launch to the first metrics row, per-row step times) of one main.py run."""
  start = time.time()
  argv = [sys.executable, "main.py", f"--workdir={workdir}", "--cpu_devices=8", *extra]
  argv += [
    f"--config.steps={steps}",
    f"--config.log_every={log_every}",
    f"--config.compilation_cache={cache}",
  ]
  subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=900)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if "step_time_s" in r]
  return rows[0]["time"] - start, [r["step_time_s"] for r in rows if r["step"] > SKIP]


def ours_round(tmp: str, steps: int, extra: list[str]) -> dict:
  cache = os.path.join(tmp, "cache")
  shutil.rmtree(cache, ignore_errors=True)
  cold, _ = _ours(os.path.join(tmp, "cold"), 3, 1, cache, extra)
  warm, _ = _ours(os.path.join(tmp, "warm"), 3, 1, cache, extra)
  _, times = _ours(os.path.join(tmp, "steps"), steps, 10, cache, extra)
  for name in ("cold", "warm", "steps"):
    shutil.rmtree(os.path.join(tmp, name))
  return {"step_s": statistics.median(times), "first_step_cold_s": cold, "first_step_warm_s": warm}


# Each case: our config and our sides (main.py flags), MaxText's sides (its settings on top of MAXTEXT_ARGS),
# and the ratios printed (ours, MaxText). MaxText runs with its own defaults, and with the settings
# closest to ours (unrolled, no full remat).
_LIKE_OURS = ["remat_policy=minimal", "scan_layers=false"]
# configs/moe_mt_peer.py as MaxText's MoE: its Mixtral block (a top-k of SwiGLU experts), no megablox
# (its Pallas TPU kernel, interpreted on CPU) and its dense einsum dispatch (`sparse_matmul=false`), the
# one of its paths that drops tokens at a capacity factor, as ours does. Its capacity per sequence,
# int(ceil(L x k / E) x 1.25) = 40, equals ours, ceil(1.25 x L x k / E).
_EXPERTS = [
  "decoder_block=mixtral",
  "num_experts=8",
  "num_experts_per_tok=2",
  "base_moe_mlp_dim=512",
  "megablox=false",
  "load_balance_loss_weight=0.01",
]
_MOE = [*_EXPERTS, "sparse_matmul=false", "capacity_factor=1.25"]
# Dropless on both sides: ours by ragged_dot, MaxText's sparse path by ragged_dot (`sparse_matmul=true`,
# no capacity), each device routing its own tokens (expert parallelism 1).
_MOE_DROPLESS = [*_EXPERTS, "sparse_matmul=true", "capacity_factor=-1"]
_OURS_DROPLESS = ["--config.model.moe.routing=dropless", "--config.checks.first_step=false"]
# configs/long_mt_peer.py as MaxText runs context parallelism on CPU: 2 sequences of 2,048 tokens (its
# per_device_batch_size=0.25 on 8 devices), data 2 x context 4, its default all-gather strategy (its ring
# is for GPUs and TPUs only) with its load-balanced causal order (DUAL_CHUNK_SWAP, as ours), and its
# dot-product attention (what `attention=autoselected` picks on CPU).
_CONTEXT = [
  "per_device_batch_size=0.25",
  "max_target_length=2048",
  "ici_fsdp_parallelism=1",
  "ici_data_parallelism=2",
  "ici_context_parallelism=4",
  "context_parallel_strategy=all_gather",
  "context_parallel_load_balance=true",
  "attention=dot_product",
]
CASES = {
  "dense": {
    "tokens": 8 * 128,
    "ours": {"ours": ["--config=configs/lm_mt_peer.py"]},
    "maxtext": {"maxtext": [], "maxtext_like_ours": _LIKE_OURS},
    "ratios": [("ours", "maxtext"), ("ours", "maxtext_like_ours")],
  },
  "moe": {
    "tokens": 8 * 128,
    "ours": {"ours": ["--config=configs/moe_mt_peer.py"]},
    "maxtext": {"maxtext": _MOE, "maxtext_like_ours": _MOE + _LIKE_OURS},
    "ratios": [("ours", "maxtext"), ("ours", "maxtext_like_ours")],
  },
  "moe_dropless": {
    "tokens": 8 * 128,
    # Without the first-step check: in bf16 on this mesh it stops the run (exit 6, updates 0.39 off dp's;
    # float32 passes); timing only.
    "ours": {"ours_dropless": ["--config=configs/moe_mt_peer.py", *_OURS_DROPLESS]},
    "maxtext": {"maxtext_dropless": _MOE_DROPLESS + _LIKE_OURS},
    "ratios": [("ours_dropless", "maxtext_dropless")],
  },
  "context": {
    "tokens": 2 * 2048,
    "steps": 30,  # About 1 s a step on this side and 2 s on MaxText's: 20 steps timed.
    "ours": {"ours": ["--config=configs/long_mt_peer.py"]},
    "maxtext": {"maxtext": _CONTEXT, "maxtext_like_ours": _CONTEXT + _LIKE_OURS},
    "ratios": [("ours", "maxtext"), ("ours", "maxtext_like_ours")],
  },
}


def _settings(*lists: list[str]) -> list[str]:
  """MaxText's key=value settings, a later one replacing an earlier one of the same key."""
  merged = {}
  for setting in (s for settings in lists for s in settings):
    merged[setting.partition("=")[0]] = setting
  return list(merged.values())


def maxtext_round(tmp: str, steps: int, extra: list[str]) -> dict:
  python = os.path.join(VENV, "bin", "python")
  base = os.path.join(VENV, "lib", "python3.12", "site-packages", "maxtext", "configs", "base.yml")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  argv = [python, "-m", "maxtext.trainers.pre_train.train", base, f"run_name=peer{time.time_ns()}"]
  argv += [f"base_output_directory={tmp}/maxtext", f"steps={steps}", *_settings(MAXTEXT_ARGS, extra)]
  start, first, times = time.time(), None, []
  proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for line in proc.stdout:
    if m := _MAXTEXT_STEP.search(line):
      first = first or time.time() - start
      if int(m[1]) >= SKIP:
        times.append(float(m[2]))
  if proc.wait() != 0 or not times:
    raise RuntimeError(f"MaxText exited {proc.returncode} with {len(times)} steps timed")
  shutil.rmtree(os.path.join(tmp, "maxtext"), ignore_errors=True)
  return {"step_s": statistics.median(times), "first_step_cold_s": first}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--setup", action="store_true", help="make .venv-maxtext if it is missing")
  parser.add_argument(
    "--moe", action="store_true", help="the mixture-of-experts case (configs/moe_mt_peer.py)"
  )
  parser.add_argument("--dropless", action="store_true", help="with --moe: also both dropless routings")
  parser.add_argument(
    "--context", action="store_true", help="the context-parallel case (configs/long_mt_peer.py)"
  )
  parser.add_argument("--steps", type=int, default=None, help="steps per run (default 60; --context 30)")
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  if args.setup:
    setup()
  peer = os.path.exists(os.path.join(VENV, "bin", "python"))
  if not peer:
    print("no .venv-maxtext: measuring ours only (--setup makes it; it needs pyenv's Python 3.12)")
  if args.context:
    cases = [CASES["context"]]
  elif args.moe:
    cases = [CASES["moe"], *([CASES["moe_dropless"]] if args.dropless else [])]
  else:
    cases = [CASES["dense"]]
  steps = args.steps or cases[0].get("steps", 60)
  sides, tokens = {}, {}  # name -> (run one round, its flags or settings); name -> tokens per step
  for case in cases:
    sides.update({name: (ours_round, flags) for name, flags in case["ours"].items()})
    if peer:
      sides.update({name: (maxtext_round, settings) for name, settings in case["maxtext"].items()})
    tokens.update({name: case["tokens"] for name in (*case["ours"], *case["maxtext"])})
  results = {side: [] for side in sides}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      for side, (run_round, extra) in sides.items():
        row = run_round(tmp, steps, extra)
        results[side].append(row)
        print(f"round {r + 1} {side:<17} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
  print("8 logical CPU devices on one machine's cores: a ratio, not an interconnect figure")
  summary = {}
  for side, rows in results.items():
    summary[side] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    s = summary[side]
    extra = f", warm {s['first_step_warm_s']:.1f} s" if "first_step_warm_s" in s else ""
    print(
      f"{side:<17} median step {s['step_s'] * 1e3:.1f} ms = {tokens[side] / s['step_s']:,.0f} tokens/s; "
      f"launch to first step: cold {s['first_step_cold_s']:.1f} s{extra}"
    )
  for case in cases:
    for ours, theirs in case["ratios"] if peer else ():
      print(f"tokens/s {ours} / {theirs}: {summary[theirs]['step_s'] / summary[ours]['step_s']:.2f}x")


if __name__ == "__main__":
  main()
