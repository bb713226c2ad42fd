"""What the local and peer checkpoint tiers cost (trainer/checkpoint/local.py): a real 2-process job
(launch/local.py, 2 x 4 logical CPU devices, mesh data 2 x fsdp 2 x tensor 2) with a copy every step
against the same job with the tiers off, interleaved A B A B, for the smoke model and a ~107M-parameter
model (benchmarks/checkpoint.py's LARGE, on fsdp 8). Prints seconds per step between the metrics rows
after the tiers' first four copies (written to new files, once per run), wall time with every blocking
copy and save included; the ratio off / on (1.0: no cost; the goal is >= 0.97); and the host memory the
tiers hold per process. The copies go where they go by default, a folder under /dev/shm where there is
one, or under --base. The 107M model's eight copies per process, 4.8 GiB, in host memory beside two
processes' devices do not fit a 24 GiB machine (a process was killed for memory): --base=/tmp puts them in
the page cache of a disk, whose writeback costs CPU too; --processes=1 measures the local tier alone (no
partner), in /dev/shm.

  .venv/bin/python benchmarks/local_tier.py [--steps=24] [--rounds=2] [--models=smoke,107m] [--base=DIR]
      [--processes=2]
  .venv/bin/python benchmarks/local_tier.py --pieces [--mib=6.4]

--pieces times what one copy of that many MiB costs a process's CPU, in one process without devices:
writing it to a new file in that folder, over an older copy's file (what the tiers do), and its
checksum (XXH3-128; sha256 beside it).

Logical CPU devices share this machine's cores with the writer threads: the ratio, not the seconds,
carries over, and a GPU host copies over PCIe instead.
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from checkpoint import LARGE  # noqa: E402

sys.path.insert(0, REPO)
from trainer.checkpoint.local import default_dir  # noqa: E402
from trainer.checkpoint.local_copies import KEEP, checksum  # noqa: E402

FLAGS = [
  "--config=configs/smoke_cpu.py",
  "--config.eval_steps=0",
  "--config.eval_every=0",
  "--config.checks.first_step=false",
]
FLAGS += ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.log_every=4"]


def seconds_per_step(
  model: dict, steps: int, local_every: int, workdir: str, processes: int
) -> tuple[float, dict]:
  """(seconds per step after the first window, the local tier's size line from process 0's output)."""
  flags = [*FLAGS, f"--config.steps={steps}", f"--config.checkpoint.every={steps}"]
  flags += [f"--config.{k}={v}" for k, v in model.items()]
  flags += [f"--config.checkpoint.local_every={local_every}", f"--workdir={workdir}"]
  flags += [f"--config.checkpoint.local_dir={workdir}-local"]  # Under the base: /dev/shm where it exists.
  launcher = [
    sys.executable,
    "launch/local.py",
    f"--processes={processes}",
    f"--cpu_devices={8 // processes}",
  ]
  launcher += ["--"]
  result = subprocess.run(launcher + flags, cwd=REPO, capture_output=True, text=True, timeout=1800)
  if result.returncode:
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line.lower()]
    raise SystemExit("\n".join(errors[:10]) or result.stdout[-3000:])
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if "loss" in r]
  # From the first row after the tiers' first KEEP + 1 copies, whose files are new (a one-off per run: a
  # new file's pages are allocated as written, 3.1 s for the 4th 1.2 GiB copy in /dev/shm against 0.3 s
  # over a spare), or the first row where the run is too short for that.
  first = next((r for r in rows[:-1] if r["step"] >= KEEP + 2), rows[0])
  last = rows[-1]
  sizes = [line for line in result.stdout.splitlines() if "local tier:" in line and "MiB" in line]
  return (last["time"] - first["time"]) / (last["step"] - first["step"]), (sizes[0] if sizes else "")


def default_base() -> str:
  """Where the tiers' copies go by default (trainer/checkpoint/local.py's default_dir)."""
  return os.path.dirname(default_dir("benchmark"))


def pieces(mib: float, base: str, repeats: int = 30) -> None:
  """Milliseconds of one copy's pieces of work, each the median of `repeats`."""
  blob = memoryview(os.urandom(int(mib * 2**20)))

  def ms(fn) -> float:
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      fn()
      times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)

  with tempfile.TemporaryDirectory(dir=base) as folder:
    path = os.path.join(folder, "shards")

    def new_file():
      with open(path + ".tmp", "wb") as f:
        f.write(blob)
      os.replace(path + ".tmp", path)

    def over_old():
      with open(path, "r+b") as f:
        f.write(blob)

    print(f"one copy of {mib} MiB in {folder}: milliseconds per copy")
    print(f"  a new file {ms(new_file):.2f}, over an old file {ms(over_old):.2f}")
    sha256 = ms(lambda: hashlib.sha256(blob).digest())
    print(f"  its checksum (XXH3-128) {ms(lambda: checksum(blob)):.2f}, sha256 {sha256:.2f}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=24)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--models", default="smoke,107m", help="which of smoke, 107m to measure")
  parser.add_argument("--pieces", action="store_true", help="time one copy's pieces instead")
  parser.add_argument("--mib", type=float, default=6.4, help="with --pieces: the copy's size")
  parser.add_argument("--base", default=default_base(), help="the folder the runs and copies go under")
  parser.add_argument("--processes", type=int, default=2, help="1: the local tier alone, no partner")
  args = parser.parse_args()
  if args.pieces:
    return pieces(args.mib, args.base)
  print(
    f"{args.processes} processes x {8 // args.processes} logical CPU devices; seconds per step, "
    "copies every step against none"
  )
  # The ~107M model fully sharded over the 8 devices: each process copies half of its 1.2 GiB state,
  # and the tiers' eight copies per process fit this machine's memory.
  large = {**LARGE, "mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1}
  for name in args.models.split(","):
    model = {"smoke": {}, "107m": large}[name]
    times = {0: [], 1: []}
    size = ""
    with tempfile.TemporaryDirectory(dir=args.base) as tmp:
      for r in range(args.rounds):
        for every in (0, 1):
          workdir = os.path.join(tmp, f"{every}-{r}")
          s, line = seconds_per_step(model, args.steps, every, workdir, args.processes)
          times[every].append(s)
          size = line or size
    off, on = statistics.median(times[0]), statistics.median(times[1])
    print(f"{name:>6}: off {off:.3f} s, local+peer every step {on:.3f} s: off/on {off / on:.3f}x")
    rounds = ", ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(times[0], times[1], strict=True))
    print(f"        each round, off/on s per step: {rounds}")
    if size:
      print(f"        {size.split('] ', 1)[-1]}")


if __name__ == "__main__":
  main()
