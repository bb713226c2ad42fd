"""What the local and peer checkpoint tiers cost (trainer/checkpoint/local.py): a real 2-process job
(launch/local.py, 2 x 4 logical CPU devices, mesh data 2 x fsdp 2 x tensor 2) with a copy every step
against the same job with the tiers off, interleaved A B A B, for the smoke model and a ~107M-parameter
model (benchmarks/checkpoint.py's LARGE, on fsdp 8). Prints seconds per step from the metrics row after
the tiers' first four copies (written to new files, once per run) and the second logging step to the last,
and over the second half of the steps; wall time with every blocking copy and save included; the ratio off
/ on (1.0: no cost; the goal is >= 0.97); and the host memory the tiers hold per process. The copies go
where they go by default, a folder under /dev/shm where there is one, or under --base. The 107M model's
eight copies per process, 4.8 GiB, in host memory beside two processes' devices do not fit a 24 GiB
machine (a process was killed for memory): --base=/tmp puts them in the page cache of a disk, whose
writeback costs CPU too; --processes=1 measures the local tier alone (no partner), in /dev/shm.

--accelerator runs one process on this machine's accelerators instead (main.py without --cpu_devices,
mesh data over every device): the steps run on the chip while the copies take the host's CPU and the
device-to-host link, as on a cluster. --every=-1 compares the default cadence instead of a copy every
step (a copy every 2, 4, 8 ... steps where a copy's work takes more than a tenth of a step; its lines are
printed), and --set=KEY=VALUE overrides the config (a batch that gives the chip a realistic step).
--timeline, with --every=N (a multiple of 4, the steps of a logging window), prints the seconds per step
of each logging window by its place after a copy, against the same windows of the run without: whether
a copy slows the steps right after it or the later ones; and, from processes/process_0.jsonl, how much of
each step the loop spent taking batches, dispatching it and, at the window's end, waiting for the devices
(a loop whose dispatch takes most of a step has no slack for a copy's host work). The transfers are paced
by the loop's steps (checkpoint.local_pace_mib; --set=checkpoint.local_pace_mib=0 compares them unpaced).

  .venv/bin/python benchmarks/local_tier.py [--steps=24] [--rounds=2] [--models=smoke,107m] [--base=DIR]
      [--processes=2] [--accelerator] [--every=1] [--timeline] [--set=global_batch_size=128 ...]
  .venv/bin/python benchmarks/local_tier.py --pieces [--mib=6.4]

--pieces times what one copy of that many MiB costs a process's CPU, in one process without devices:
writing it to a new file in that folder, over an older copy's file (what the tiers do), and its
checksum (XXH3-128; sha256 beside it); and the loop's dispatch of the device copy.

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

import jax
import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from checkpoint import LARGE  # noqa: E402

sys.path.insert(0, REPO)
from trainer import rundir  # noqa: E402
from trainer.checkpoint.local_copies import KEEP, checksum  # noqa: E402
from trainer.checkpoint.local_room import default_dir  # noqa: E402
from trainer.checkpoint.local_shards import device_copy  # noqa: E402

FLAGS = [
  "--config=configs/smoke_cpu.py",
  "--config.eval_steps=0",
  "--config.eval_every=0",
  "--config.checks.first_step=false",
]
LOG_EVERY = 4
FLAGS += ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
FLAGS += [f"--config.log_every={LOG_EVERY}"]


def seconds_per_step(
  model: dict, steps: int, local_every: int, workdir: str, processes: int, period: int
) -> tuple[tuple[float, float], list[str], dict[int, list[float]]]:
  """((seconds per step after the first windows, over the second half of the steps), process 0's lines
  about the devices and the local tier, its windows (`windows`) in periods of `period` steps).

  processes=0: one process on the accelerators, without logical CPU devices.
  """
  flags = [*FLAGS, f"--config.steps={steps}", f"--config.checkpoint.every={steps}"]
  flags += [f"--config.{k}={v}" for k, v in model.items()]
  flags += [f"--config.checkpoint.local_every={local_every}", f"--workdir={workdir}"]
  flags += [f"--config.checkpoint.local_dir={workdir}-local"]  # Under the base: /dev/shm where it exists.
  launcher = [sys.executable, "main.py"]
  if processes:
    launcher = [sys.executable, "launch/local.py", f"--processes={processes}"]
    launcher += [f"--cpu_devices={8 // processes}", "--"]
  result = subprocess.run(launcher + flags, cwd=REPO, capture_output=True, text=True, timeout=1800)
  if result.returncode:
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line.lower()]
    raise SystemExit("\n".join(errors[:10]) or result.stdout[-3000:])
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if "loss" in r]
  # From the first row after the tiers' first KEEP + 1 copies, whose files are new (a one-off per run: a
  # new file's pages are allocated as written, 3.1 s for the 4th 1.2 GiB copy in /dev/shm against 0.3 s
  # over a spare), and after the default cadence's first decision holds (from the second logging step:
  # until then it copies every step), or the first row where the run is too short for that.
  first = next((r for r in rows[:-1] if r["step"] >= max(KEEP + 2, 2 * LOG_EVERY)), rows[0])
  # And over the second half of the steps: the default cadence settled, after its first decisions.
  half = next((r for r in rows[:-1] if r["step"] >= steps // 2), first)
  last = rows[-1]
  lines = [line.split("] ", 1)[-1] for line in result.stdout.splitlines()]
  lines = [line for line in lines if line.startswith(("devices:", "local tier:"))]
  per_step = lambda row: (last["time"] - row["time"]) / (last["step"] - row["step"])
  host = {r["step"]: r for r in rundir.read_jsonl(rundir.process_log(workdir, 0)) if "steps" in r}
  return (per_step(first), per_step(half)), lines, windows(rows, host, half, period)


PARTS = {"batch_fetch_s": "taking batches", "dispatch_s": "dispatching", "device_wait_s": "the end's wait"}


def windows(rows: list[dict], host: dict[int, dict], since: dict, period: int) -> dict[int, list[dict]]:
  """{w: each logging window after `since` that is the w-th of a period of `period` steps, as seconds
  per step in all ("s") and in each of process 0's PARTS}: copied every `period` steps, the window the
  copy's step ends is the last of its period, so window 0 runs while its copy is written."""
  found: dict[int, list[dict]] = {}
  for before, row in zip(rows, rows[1:], strict=False):
    if row["step"] > since["step"] and row["step"] < rows[-1]["step"]:
      steps = row["step"] - before["step"]
      window = {"s": (row["time"] - before["time"]) / steps}
      window |= {part: host.get(row["step"], {}).get(part, 0.0) / steps for part in PARTS}
      found.setdefault((row["step"] - 1) % period // LOG_EVERY, []).append(window)
  return found


def default_base() -> str:
  """Where the tiers' copies go by default (trainer/checkpoint/local_room.py)."""
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

  # The loop's own part: dispatching the device copy of a state of the ~107M model's 216 leaves (small
  # here: the dispatch, not the copy), one program (local_shards.device_copy).
  state = [jnp.zeros((8, 8)) for _ in range(216)]
  dispatched = ms(lambda: jax.block_until_ready(device_copy(state)))
  print(f"  the loop's device copy of 216 leaves: {dispatched:.2f}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=24)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--models", default="smoke,107m", help="which of smoke, 107m to measure")
  parser.add_argument("--pieces", action="store_true", help="time one copy's pieces instead")
  parser.add_argument("--mib", type=float, default=6.4, help="with --pieces: the copy's size")
  parser.add_argument("--base", default=default_base(), help="the folder the runs and copies go under")
  parser.add_argument("--processes", type=int, default=2, help="1: the local tier alone, no partner")
  parser.add_argument("--accelerator", action="store_true", help="one process on the accelerators")
  parser.add_argument("--every", type=int, default=1, help="-1: the default cadence; N: every N steps")
  parser.add_argument("--timeline", action="store_true", help="with --every=N: each window after a copy")
  parser.add_argument("--set", action="append", default=[], help="KEY=VALUE, a config override")
  args = parser.parse_args()
  if args.timeline and (args.every <= 0 or args.every % LOG_EVERY):
    raise SystemExit(f"error: --timeline needs --every=N, N a multiple of {LOG_EVERY} (a logging window)")
  if args.pieces:
    return pieces(args.mib, args.base)
  processes = 0 if args.accelerator else args.processes
  if processes:
    print(f"{processes} processes x {8 // processes} logical CPU devices", end="")
    # The ~107M model fully sharded over the 8 devices: each process copies half of its 1.2 GiB state,
    # and the tiers' eight copies per process fit this machine's memory.
    mesh = {"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1}
  else:
    print("1 process on the accelerators", end="")
    mesh = {"mesh.data": -1, "mesh.fsdp": 1, "mesh.tensor": 1}
  overrides = dict(kv.split("=", 1) for kv in args.set)
  cadence = "the default cadence" if args.every == -1 else f"a copy every {args.every} steps"
  print(f"; seconds per step, {cadence} against none")
  for name in args.models.split(","):
    model = {"smoke": {}, "107m": LARGE}[name] | (mesh if name == "107m" or not processes else {})
    model |= overrides
    times = {0: [], args.every: []}
    lines, timeline = [], {}
    with tempfile.TemporaryDirectory(dir=args.base) as tmp:
      for r in range(args.rounds):
        for every in times:
          workdir = os.path.join(tmp, f"{every}-{r}")
          s, lines_now, by_window = seconds_per_step(
            model, args.steps, every, workdir, processes, max(args.every, 1)
          )
          times[every].append(s)
          lines = lines_now or lines
          for w, seconds in by_window.items():
            timeline.setdefault(w, {}).setdefault(every, []).extend(seconds)
    for i, which in enumerate(("", " (second half)")):
      off, on = (statistics.median(t[i] for t in times[every]) for every in times)
      print(f"{name:>6}: off {off:.3f} s, local tier on {on:.3f} s: off/on {off / on:.3f}x{which}")
    rounds = ", ".join(f"{a[0]:.3f}/{b[0]:.3f}" for a, b in zip(*times.values(), strict=True))
    print(f"        each round, off/on s per step: {rounds}")
    for line in lines:  # The devices, the tier's size and the last round's cadence decisions.
      print(f"        {line}")
    if args.timeline:  # Where a copy's cost lands: the steps right after it, or later.
      print(f"        s per step in the k-th window of {LOG_EVERY} steps after a copy, second half, off/on:")
      print(f"          (of which, per step: {', '.join(PARTS.values())}; the rest runs between steps)")
      for w, by_every in sorted(timeline.items()):
        median = lambda key, e, by=by_every: statistics.median(x[key] for x in by.get(e) or [{key: 0.0}])
        parts = "; ".join(f"{median(k, 0):.4f}/{median(k, args.every):.4f}" for k in PARTS)
        print(f"          {w}: {median('s', 0):.4f}/{median('s', args.every):.4f}  ({parts})")


if __name__ == "__main__":
  main()
