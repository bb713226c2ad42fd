"""AdamW's moments in bfloat16 against float32 (`optimizer.moments_dtype`): the loss over a run of
make train's model on 8 logical CPU devices, and the optimizer's bytes per device from --mode=inspect.

  .venv/bin/python benchmarks/moments_dtype.py [--steps=300] [--config=configs/smoke_cpu.py]

Prints, per dtype, the train loss every 50 steps, the final eval loss, and inspect's optimizer bytes;
then the largest train-loss difference over the logged steps. The figures are in docs/results.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(workdir: str, config: str, dtype: str, steps: int, mode: str = "train") -> None:
  argv = [sys.executable, "main.py", f"--config={config}", f"--workdir={workdir}", "--cpu_devices=8"]
  argv += [f"--mode={mode}", f"--config.optimizer.moments_dtype={dtype}", f"--config.steps={steps}"]
  argv += ["--config.log_every=50", f"--config.eval_every={steps}", f"--config.checkpoint.every={steps}"]
  subprocess.run(argv, cwd=REPO, check=True, capture_output=True, timeout=3600)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--config", default="configs/smoke_cpu.py")
  args = parser.parse_args()
  losses = {}
  with tempfile.TemporaryDirectory() as tmp:
    for dtype in ("float32", "bfloat16"):
      workdir = os.path.join(tmp, dtype)
      run(workdir, args.config, dtype, args.steps)
      with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
      losses[dtype] = {r["step"]: r["loss"] for r in rows if "loss" in r}
      evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
      run(os.path.join(tmp, dtype + "_inspect"), args.config, dtype, args.steps, mode="inspect")
      with open(os.path.join(tmp, dtype + "_inspect", "inspect.json")) as f:
        totals = json.load(f)["totals"]
      curve = "  ".join(f"{s}: {v:.4f}" for s, v in sorted(losses[dtype].items()) if s % 50 == 0)
      print(f"{dtype:<9} train loss {curve}")
      print(
        f"{'':<9} eval loss {evals[-1]:.4f}; optimizer {totals['opt_state_bytes_per_device_max']:,} B a "
        f"device (params {totals['param_bytes_per_device_max']:,} B)"
      )
  common = sorted(set(losses["float32"]) & set(losses["bfloat16"]))
  worst = max(common, key=lambda s: abs(losses["float32"][s] - losses["bfloat16"][s]))
  gap = losses["bfloat16"][worst] - losses["float32"][worst]
  print(f"largest train-loss difference (bfloat16 - float32): {gap:+.2e} at step {worst}")


if __name__ == "__main__":
  main()
