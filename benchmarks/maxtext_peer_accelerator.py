"""Ours against MaxText 0.2.5 on the accelerators of this host, shape by shape, interleaved (ours, then
each MaxText variant, round after round), with one FLOP count for both sides.

  python benchmarks/maxtext_peer_accelerator.py [--shapes=S,L,B] [--variants=defaults,flash_minimal,...]
    [--steps=40] [--rounds=1] [--json=FILE] [--maxtext_python=PYTHON]

Shapes (per device; the global batch is this times the devices, fsdp over all of them on both sides):
  S  ~107M: d768, 10 layers, 12 heads, SwiGLU 3072, vocab 8192, 32 x 128 tokens
  L  lm_125m's layer: d768, 12 layers, 12 query / 4 key-value heads, SwiGLU 2048, vocab 32768, 16 x 2048
  B  ~620M: lm_1b's layer (d2048, 32 / 8 heads, SwiGLU 8192) x 8 layers, vocab 32768, 4 x 2048
  tiny  a two-layer model for a CPU dry run of this script (--shapes=tiny)
bf16 compute, fp32 parameters, AdamW, synthetic data, no evaluation, MaxText without checkpoints and
ours with its defaults otherwise (attention `auto`, unrolled layers, no remat, its local checkpoint tier,
a checkpoint at the end only), and without the first-step check (a second compile, not a step cost).

MaxText runs once per variant (its settings on top of the shape's); its best is the figure compared:
  defaults       its own: scanned layers, full remat, `attention=autoselected`
  flash_minimal  attention=flash (Pallas splash) remat_policy=minimal
  flash_full     attention=flash remat_policy=full
  dot_minimal    attention=dot_product remat_policy=minimal
  unrolled       scan_layers=false remat_policy=none attention=dot_product (as ours runs)
A variant that fails (out of memory) is reported and left out of the best.

Step time: the median after the first 20 steps (ours: `step_time_s` of its metrics rows; MaxText: its
`completed step: S, seconds: T` lines). MFU for both: the template's model FLOPs per step (summary.json's
model_flops_per_step: 6 x matmul parameters x tokens + 12 x layers x width x L x tokens) over the step
time and the chip's bf16 peak (trainer/observe/hardware.py); MaxText's own TFLOP/s counts causal
attention as half and reads lower.

MaxText: `--maxtext_python` (default .venv-maxtext/bin/python when it exists, else this Python) must
import `maxtext`; extra import paths (a source tree, stubs) come from MAXTEXT_PYTHONPATH. On the TPU
v5e host of docs/guides/tpu.md that is MaxText 0.2.5 patched for Python 3.11 and JAX 0.10.2.
Without MaxText it measures ours alone. The table's figures are in docs/guides/tpu.md.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.maxtext_peer import _MAXTEXT_STEP, REPO, VENV, _settings  # noqa: E402
from trainer.observe import hardware  # noqa: E402

SHAPES = {  # batch per device, sequence, embed, layers, query heads, key/value heads, mlp, vocab
  "S": (32, 128, 768, 10, 12, 12, 3072, 8192),
  "L": (16, 2048, 768, 12, 12, 4, 2048, 32768),
  "B": (4, 2048, 2048, 8, 32, 8, 8192, 32768),
  "tiny": (2, 128, 64, 2, 4, 4, 256, 512),
}
# Steps left out of both sides' medians: compilation, warm-up, and ours' local tier copying every step
# until its first decision (at step 20 with log_every 10) says how often a copy costs little.
SKIP = 20
VARIANTS = {
  "defaults": [],
  "flash_minimal": ["attention=flash", "remat_policy=minimal"],
  "flash_full": ["attention=flash", "remat_policy=full"],
  "dot_minimal": ["attention=dot_product", "remat_policy=minimal"],
  "unrolled": ["scan_layers=false", "remat_policy=none", "attention=dot_product"],
}


def ours_flags(shape: str, devices: int, steps: int) -> list[str]:
  batch, seq, embed, layers, heads, kv, mlp, vocab = SHAPES[shape]
  values = {
    "mesh.data": 1,
    "mesh.fsdp": -1,
    "mesh.tensor": 1,
    "global_batch_size": batch * devices,
    "data.seq_len": seq,
    "model.embed_dim": embed,
    "model.num_layers": layers,
    "model.num_heads": heads,
    "model.num_kv_heads": kv,
    "model.mlp_dim": mlp,
    "model.vocab_size": vocab,
    "model.compute_dtype": "bfloat16",
    "steps": steps,
    "log_every": 10,
    "eval_every": 0,
    "eval_steps": 0,
    "checkpoint.every": steps,
    "checks.first_step": False,
  }
  return ["--config=configs/smoke_cpu.py", *(f"--config.{k}={v}" for k, v in values.items())]


def maxtext_shape(shape: str, steps: int, run: str, out: str) -> list[str]:
  batch, seq, embed, layers, heads, kv, mlp, vocab = SHAPES[shape]
  return [
    "dataset_type=synthetic",
    "skip_jax_distributed_system=true",
    "jax_cache_dir=",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    "log_period=1000",
    f"steps={steps}",
    f"run_name={run}",
    f"base_output_directory={out}",
    f"per_device_batch_size={batch}",
    f"max_target_length={seq}",
    f"base_emb_dim={embed}",
    f"base_num_decoder_layers={layers}",
    f"base_num_query_heads={heads}",
    f"base_num_kv_heads={kv}",
    f"head_dim={embed // heads}",
    f"base_mlp_dim={mlp}",
    f"vocab_size={vocab}",
  ]


def run_ours(tmp: str, flags: list[str], env: dict) -> dict:
  workdir = os.path.join(tmp, "ours")
  shutil.rmtree(workdir, ignore_errors=True)
  argv = [sys.executable, "main.py", f"--workdir={workdir}", *flags]
  p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
  if p.returncode != 0:
    return {"error": (p.stdout + p.stderr).strip().splitlines()[-1][:300]}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if "step_time_s" in r]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  times = [r["step_time_s"] for r in rows if r["step"] > SKIP] or [rows[-1]["step_time_s"]]
  said = [line for line in p.stdout.splitlines() if "tier" in line]  # Where copies go, or that it is off.
  return {"step_s": statistics.median(times), "flops_per_step": summary["model_flops_per_step"], "said": said}


def probe_devices(env: dict) -> tuple[int, str, str]:
  """The device count, kind and backend, read in a child process: a TPU is held by the first process
  that opens it, so this one must not, or every run it starts fails to reach the chip."""
  code = "import jax; print(jax.device_count(), jax.default_backend(), jax.devices()[0].device_kind)"
  p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
  if p.returncode != 0:
    sys.exit(f"error: JAX cannot reach a device: {(p.stderr.strip().splitlines() or [''])[-1]}")
  count, backend, kind = p.stdout.strip().splitlines()[-1].split(" ", 2)
  return int(count), kind, backend


def maxtext_python() -> str:
  venv = os.path.join(VENV, "bin", "python")
  return venv if os.path.exists(venv) else sys.executable


def maxtext_env(env: dict) -> dict:
  extra = os.environ.get("MAXTEXT_PYTHONPATH", "")
  return {**env, "PYTHONPATH": os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), extra) if p)}


def base_yml(python: str, env: dict) -> str | None:
  """MaxText's base.yml, or None where `python` cannot import maxtext."""
  code = "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))"
  p = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
  return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else None


def run_maxtext(python: str, base: str, settings: list[str], env: dict) -> dict:
  argv = [python, "-m", "maxtext.trainers.pre_train.train", base, *settings]
  proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  times, tail = [], []
  for line in proc.stdout:
    tail = (tail + [line])[-20:]
    if (m := _MAXTEXT_STEP.search(line)) and int(m[1]) >= SKIP:
      times.append(float(m[2]))
  if proc.wait() != 0 or not times:
    last = next((t.strip() for t in reversed(tail) if "Error" in t or "error" in t), tail[-1:] or [""])
    return {"error": f"exit {proc.returncode}: {str(last)[:300]}"}
  return {"step_s": statistics.median(times)}


def table(results: dict, tokens: dict, peak: float | None) -> list[str]:
  """results[shape] = {'ours': row, 'maxtext': {variant: row}}: one line per shape, ours against
  MaxText's best variant, MFU by ours' FLOP count for both."""
  mfu = lambda flops, s: f"{flops / s / peak:.3f}" if peak and flops else "-"  # noqa: E731
  head = f"{'shape':<6}{'ours ms':>10}{'MFU':>7}{'MaxText best ms':>17}{'MFU':>7}  {'variant':<14}"
  lines = [head + "ours/MaxText"]
  for shape, r in results.items():
    ours, flops = r["ours"], r["ours"].get("flops_per_step")
    done = {v: row for v, row in r["maxtext"].items() if "step_s" in row}
    best = min(done, key=lambda v: done[v]["step_s"]) if done else None
    left = f"{shape:<6}" + f"{'failed':>17}"
    if "step_s" in ours:
      left = f"{shape:<6}{ours['step_s'] * 1e3:>10.1f}{mfu(flops, ours['step_s']):>7}"
    if best is None:
      lines.append(left + f"{'-':>17}{'-':>7}  {'-':<14}-")
      continue
    theirs = done[best]["step_s"]
    ratio = f"{theirs / ours['step_s']:.2f}x" if "step_s" in ours else "-"
    lines.append(left + f"{theirs * 1e3:>17.1f}{mfu(flops, theirs):>7}  {best:<14}{ratio}")
  for shape, r in results.items():
    for variant, row in r["maxtext"].items():
      if "error" in row:
        lines.append(f"{shape} MaxText {variant}: {row['error']}")
    if "error" in r["ours"]:
      lines.append(f"{shape} ours: {r['ours']['error']}")
  lines.append("tokens per step: " + ", ".join(f"{s} {tokens[s]:,}" for s in results))
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="S,L,B")
  parser.add_argument("--variants", default="defaults,flash_minimal,flash_full,unrolled")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--rounds", type=int, default=1)
  parser.add_argument("--json", default="", help="also append one JSON line per run to this file")
  parser.add_argument("--maxtext_python", default="")
  args = parser.parse_args()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  devices, kind, backend = probe_devices(env)
  accelerator = None if backend == "cpu" else hardware.for_device_kind(kind)
  if backend == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
  python = args.maxtext_python or maxtext_python()
  mt_env = maxtext_env(env)
  base = base_yml(python, mt_env)
  print(f"{devices} x {kind}; MaxText: {base or 'not importable: ours only'}", flush=True)
  shapes, variants = args.shapes.split(","), [v for v in args.variants.split(",") if v] if base else []
  results = {s: {"ours": {"error": "not run"}, "maxtext": {}} for s in shapes}
  tokens = {s: SHAPES[s][0] * SHAPES[s][1] * devices for s in shapes}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      for shape in shapes:
        runs = [("ours", None)] + [("maxtext", v) for v in variants]
        for side, variant in runs:
          t0 = time.time()
          if side == "ours":
            row = run_ours(tmp, ours_flags(shape, devices, args.steps), env)
          else:
            shape_settings = maxtext_shape(shape, args.steps, f"peer{time.time_ns()}", tmp)
            settings = _settings(shape_settings, VARIANTS[variant])
            row = run_maxtext(python, base, settings, mt_env)
            shutil.rmtree(os.path.join(tmp, "maxtext"), ignore_errors=True)
          row.update(shape=shape, side=side, variant=variant, round=r + 1, wall_s=round(time.time() - t0, 1))
          # Over rounds, each side's fastest run (or its failure, if none ran).
          held = results[shape] if side == "ours" else results[shape]["maxtext"]
          kept = held.get(variant or "ours", {})
          if "step_s" not in kept or row.get("step_s", float("inf")) < kept["step_s"]:
            held[variant or "ours"] = row
          print(json.dumps(row), flush=True)
          if args.json:
            with open(args.json, "a") as f:
              f.write(json.dumps({**row, "device": kind, "devices": devices}) + "\n")
  print("\n".join(table(results, tokens, accelerator.peak_flops if accelerator else None)))
  flags = " ".join(sys.argv[1:])
  print(f"repeat: python benchmarks/maxtext_peer_accelerator.py {flags}".rstrip())


if __name__ == "__main__":
  main()
