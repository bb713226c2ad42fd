"""Launch to first metrics row of a new run whose programs were compiled before (the user-level
compilation cache, trainer/cluster/runtime.py): the same config run three times in three new workdirs
sharing one cache ($XDG_CACHE_HOME set to a fresh folder, as a new user's ~/.cache): cold (an empty
cache), then warm twice (the program, and its passed checks.first_step, from the cache:
trainer/checks/checked_programs.py), then warm with checks.first_step_every_run=true (the check's two
programs traced and loaded, and run). Prints seconds from launch to the first row and the start-up
phases of summary.json (imports, build, init, compile, first_step_check). The goal: at most 5 s warm on
the smoke config.

  .venv/bin/python benchmarks/fast_start.py [--config=configs/smoke_cpu.py] [-- extra main.py flags]

On logical CPU devices the imports and the mesh are most of what is left; a GPU adds the backend's
start-up, which no cache saves.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_to_first_row(config: str, workdir: str, cache_home: str, extra: list[str]) -> tuple[float, dict]:
  """(seconds from launch to the first metrics row, summary.json's start-up seconds) of one run."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["XDG_CACHE_HOME"] = cache_home  # The default cache, under a folder of our own.
  argv = [sys.executable, "main.py", f"--config={config}", f"--workdir={workdir}", "--cpu_devices=8"]
  argv += ["--config.steps=3", "--config.log_every=1", "--config.eval_every=0", *extra]
  start = time.time()
  subprocess.run(argv, cwd=REPO, env=env, check=True, capture_output=True, timeout=900)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    first = next(r for r in map(json.loads, f) if "loss" in r)
  with open(os.path.join(workdir, "summary.json")) as f:
    startup = json.load(f)["startup_s"]
  return first["time"] - start, startup


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="configs/smoke_cpu.py")
  args, extra = parser.parse_known_args()
  extra = [a for a in extra if a != "--"]
  print(f"{args.config} on 8 logical CPU devices, steps 3; seconds from launch to the first metrics row")
  with tempfile.TemporaryDirectory() as tmp:
    again = ["--config.checks.first_step_every_run=true"]
    runs = [("cold", []), ("warm", []), ("warm again", []), ("warm, check run again", again)]
    for i, (name, flags) in enumerate(runs):
      seconds, startup = launch_to_first_row(args.config, os.path.join(tmp, f"run{i}"), tmp, extra + flags)
      phases = ", ".join(f"{k} {v:.1f}" for k, v in startup.items())
      print(f"  {name:>21}: {seconds:5.1f} s  (start-up: {phases})")


if __name__ == "__main__":
  main()
