"""Ours against MaxText 0.2.5 on configs/lm_mt_peer.py's model, interleaved A B A B in one run.

  .venv/bin/python benchmarks/maxtext_peer.py [--setup] [--steps=60] [--rounds=2]

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
TOKENS_PER_STEP = 8 * 128
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


def _ours(workdir: str, steps: int, log_every: int, cache: str) -> tuple[float, list[float]]:
  """(seconds from launch to the first metrics row, per-row step times) of one main.py run."""
  start = time.time()
  argv = [
    sys.executable,
    "main.py",
    "--config=configs/lm_mt_peer.py",
    f"--workdir={workdir}",
    "--cpu_devices=8",
  ]
  argv += [
    f"--config.steps={steps}",
    f"--config.log_every={log_every}",
    f"--config.compilation_cache={cache}",
  ]
  subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=900)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if "step_time_s" in r]
  return rows[0]["time"] - start, [r["step_time_s"] for r in rows if r["step"] > SKIP]


def ours_round(tmp: str, steps: int) -> dict:
  cache = os.path.join(tmp, "cache")
  shutil.rmtree(cache, ignore_errors=True)
  cold, _ = _ours(os.path.join(tmp, "cold"), 3, 1, cache)
  warm, _ = _ours(os.path.join(tmp, "warm"), 3, 1, cache)
  _, times = _ours(os.path.join(tmp, "steps"), steps, 10, cache)
  for name in ("cold", "warm", "steps"):
    shutil.rmtree(os.path.join(tmp, name))
  return {"step_s": statistics.median(times), "first_step_cold_s": cold, "first_step_warm_s": warm}


# MaxText's own defaults, and the settings closest to lm_mt_peer.py's (unrolled, no full remat).
MAXTEXT_VARIANTS = {"maxtext": [], "maxtext_like_ours": ["remat_policy=minimal", "scan_layers=false"]}


def maxtext_round(tmp: str, steps: int, extra: list[str]) -> dict:
  python = os.path.join(VENV, "bin", "python")
  base = os.path.join(VENV, "lib", "python3.12", "site-packages", "maxtext", "configs", "base.yml")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  argv = [python, "-m", "maxtext.trainers.pre_train.train", base, f"run_name=peer{time.time_ns()}"]
  argv += [f"base_output_directory={tmp}/maxtext", f"steps={steps}", *MAXTEXT_ARGS, *extra]
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
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  if args.setup:
    setup()
  peer = os.path.exists(os.path.join(VENV, "bin", "python"))
  if not peer:
    print("no .venv-maxtext: measuring ours only (--setup makes it; it needs pyenv's Python 3.12)")
  sides = ["ours", *MAXTEXT_VARIANTS] if peer else ["ours"]
  results = {side: [] for side in sides}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      for side in sides:
        if side == "ours":
          row = ours_round(tmp, args.steps)
        else:
          row = maxtext_round(tmp, args.steps, MAXTEXT_VARIANTS[side])
        results[side].append(row)
        print(f"round {r + 1} {side:<17} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
  print("8 logical CPU devices on one machine's cores: a ratio, not an interconnect figure")
  summary = {}
  for side, rows in results.items():
    if rows:
      summary[side] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
      s = summary[side]
      extra = f", warm {s['first_step_warm_s']:.1f} s" if "first_step_warm_s" in s else ""
      print(
        f"{side:<17} median step {s['step_s'] * 1e3:.1f} ms = {TOKENS_PER_STEP / s['step_s']:,.0f} tokens/s; "
        f"launch to first step: cold {s['first_step_cold_s']:.1f} s{extra}"
      )
  for side in sides[1:]:
    print(f"tokens/s ours / {side}: {summary[side]['step_s'] / summary['ours']['step_s']:.2f}x")


if __name__ == "__main__":
  main()
