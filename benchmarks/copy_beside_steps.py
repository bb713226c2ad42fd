"""Where a local-tier copy's cost lands on an accelerator (trainer/checkpoint/local.py): steps of a ~1.2 GiB
state (the ~107M model's parameters and two moments, as benchmarks/host_copy_threads.py), each with its
input sent to the device as it is dispatched (--batch_kib; 0: none), run in windows of 4, each window's
result awaited as the loop's logging does. Every --every steps the loop dispatches the tier's device copy,
and one writer thread brings it to host memory (local_shards.host_copy) and with --write writes it as the
tier does (pickled into a file in /dev/shm over the last one's, checksummed on the way). Prints, by a
window's place after a copy, its seconds per step and its longest dispatch of a step: a transfer that holds
back the device slows the window while dispatch stays short; one that holds the host (the GIL) lengthens the
dispatch.

  .venv/bin/python benchmarks/copy_beside_steps.py [--steps=512] [--every=64] [--matmuls=24]
      [--chunk_mib=0] [--write] [--batch_kib=64] [--order=queued|idle] [--paced]

--chunk_mib=N starts the transfers N MiB of arrays at a time, each group awaited before the next,
instead of all at once (host_copy): whether a gentler transfer costs the steps less. --order=idle queues
a copy's transfers on an idle chip before the next step, as the trainer's loop does at a logging step
(it waits for the copy's step; the writer starts the transfers before the loop dispatches again): whether
a step waits behind transfers queued before it. --paced starts one chunk (64 MiB unless --chunk_mib) per
step the loop dispatches, so each chunk runs beside a step queued before it.

On logical CPU devices a device's buffer is handed to numpy without a copy: run it on an accelerator.

On a TPU v5e host (JAX 0.10.2), `--steps=1024 --every=64 --matmuls=36 --batch_kib=0` (steps of 29.7 ms): the
window after a copy ran at 0.0304 s per step against 0.0297 later (about 3 ms per copy; the transfer 0.21 s,
5.8 GiB/s), the same with --write (0.37 s a copy); with each step's 64 KiB input sent (the default) and
--write, 0.0315 against 0.0299 (6 ms per copy; --chunk_mib=64: 2.4 ms); the longest dispatch 1.5-2.7 ms
throughout. (Those runs timed a copy's work from its dispatch, up to a step early.) In the tier's own loop
(benchmarks/local_tier.py --accelerator --every=32 --timeline) the same window cost about 85 ms a copy. The
same run with --order=idle: the window that ends with the copy (the loop waiting for its transfers to be
queued) 0.0367 against 0.0298 s per step, with --order=idle --paced 0.0298 (windows 4-15 kept only). The
tier's pacing (checkpoint.local_pace_mib) was then measured in its own loop: benchmarks/local_tier.py.
"""

import argparse
import os
import pickle
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from host_copy_threads import SHAPES  # noqa: E402

from trainer.checkpoint import local_copies as copies  # noqa: E402
from trainer.checkpoint.local_shards import device_copy, host_copy  # noqa: E402

WINDOW = 4


def chunked_host_copy(copy: list, chunk_bytes: float, before=lambda: None, started=lambda: None) -> list:
  """host_copy's transfers started a chunk of arrays at a time, each chunk awaited before the next;
  the callable `before` is called before a chunk's transfers start, `started` once they have."""
  out, i = [], 0
  while i < len(copy):
    before()
    j, size = i, 0
    while j < len(copy) and (size < chunk_bytes or j == i):
      copy[j].copy_to_host_async()
      size, j = size + copy[j].nbytes, j + 1
    started()
    out += [np.asarray(a) for a in copy[i:j]]
    i = j
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=512)
  parser.add_argument("--every", type=int, default=64)
  parser.add_argument("--chunk_mib", type=int, default=0, help="transfers started this many MiB at a time")
  parser.add_argument(
    "--batch_kib", type=int, default=64, help="each step's input sent to the device; 0: none"
  )
  parser.add_argument("--write", action="store_true", help="and write each copy as the tier does")
  parser.add_argument(
    "--order", choices=["queued", "idle"], default="queued", help="idle: transfers before the next step"
  )
  parser.add_argument("--paced", action="store_true", help="one chunk of transfers per dispatched step")
  parser.add_argument("--matmuls", type=int, default=24, help="a step's 4096^2 matmuls: its length")
  args = parser.parse_args()
  state = [jnp.full(shape, 0.5, jnp.float32) for shape in SHAPES * 3]
  w = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16) / 64

  def step(state, y, batch):  # An optimizer-like update of every leaf, and matmuls for the step's length.
    y = y + batch.mean().astype(y.dtype)
    for _ in range(args.matmuls):
      y = jnp.tanh(y @ w)
    return [a * 0.999 + 1e-3 for a in state], y

  step = jax.jit(step, donate_argnums=0)
  y = jnp.ones((4096, 4096), jnp.bfloat16)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 512, (max(args.batch_kib, 1) * 256,), np.int32) for _ in range(8)]
  on_device = jax.device_put(batches[0])  # With --batch_kib=0, every step's input, sent once.
  state, y = step(state, y, on_device)
  jax.block_until_ready(device_copy(state))  # Compiled before timing.
  mib = sum(a.nbytes for a in state) / 2**20
  print(
    f"{len(state)} arrays, {mib:.0f} MiB on {jax.devices()[0].device_kind}; a copy every {args.every} steps"
  )

  transfers, jobs, done = [], queue.Queue(), queue.Queue()
  issued, steps_dispatched, rush = threading.Event(), threading.Semaphore(0), threading.Event()
  chunk_bytes = args.chunk_mib * 2**20 or (64 * 2**20 if args.paced else float("inf"))

  def next_dispatch():  # --paced: a chunk's transfers wait for a step dispatched since the last chunk.
    while args.paced and not rush.is_set() and not steps_dispatched.acquire(timeout=0.01):
      pass

  def write():  # One writer thread for the run, as the tier's.
    while (copy := jobs.get()) is not None:
      jax.block_until_ready(copy)  # Its step has run: the copy's work starts, as the tier times it.
      started = time.perf_counter()
      while steps_dispatched.acquire(blocking=False):  # Only steps dispatched from now on pace it.
        pass
      if args.order == "idle":  # The first chunk goes before the next step: the loop waits for it.
        steps_dispatched.release()
      if args.chunk_mib or args.paced or args.order == "idle":
        host = chunked_host_copy(copy, chunk_bytes, next_dispatch, issued.set)
      else:
        host = host_copy(copy)
      if args.write:  # As the tier writes a copy: pickled into its file in /dev/shm, checksummed.
        copies.stage(folder, 0, lambda w, host=host: pickle.dump(host, w, protocol=5))
        os.replace(os.path.join(folder, "0.tmp"), os.path.join(folder, copies.SPARE))  # Written over next.
      del host
      transfers.append(time.perf_counter() - started)
      done.put(None)

  folder = tempfile.mkdtemp(dir="/dev/shm")
  writer = threading.Thread(target=write, daemon=True)
  writer.start()
  pending = False

  windows: dict[int, list[float]] = {}  # place after a copy -> seconds per step
  dispatches: dict[int, list[float]] = {}  # place after a copy -> the longest dispatch in it
  began, longest = time.perf_counter(), 0.0
  for s in range(1, args.steps + 1):
    t = time.perf_counter()
    batch = jax.device_put(batches[s % 8]) if args.batch_kib else on_device  # Each step's input.
    state, y = step(state, y, batch)
    steps_dispatched.release()
    longest = max(longest, time.perf_counter() - t)
    if s % args.every == 0:
      if pending:
        rush.set()  # Waited for: the rest of its chunks go unpaced.
        done.get()
      rush.clear()  # The copy before is done: this one is paced.
      jobs.put(device_copy(state))
      pending = True
      if args.order == "idle":  # As the trainer's loop at a logging step: the chip idle, its transfers first.
        issued.wait()
        issued.clear()
    if s % WINDOW == 0:
      jax.block_until_ready(y)
      now = time.perf_counter()
      if s > 2 * args.every:  # After the first copies (new host pages).
        place = (s - 1) % args.every // WINDOW
        windows.setdefault(place, []).append((now - began) / WINDOW)
        dispatches.setdefault(place, []).append(longest)
      began, longest = now, 0.0
  rush.set()
  jobs.put(None)
  writer.join()
  shutil.rmtree(folder)
  transfer_s = statistics.median(transfers)
  what = "to host memory and written" if args.write else "to host memory"
  print(f"a copy's work, {what}: {transfer_s:.3f} s ({mib / 1024 / transfer_s:.1f} GiB/s)")
  print("window after a copy: seconds per step (median), longest dispatch (median)")
  for place in sorted(windows):
    per_step, dispatch_ms = statistics.median(windows[place]), statistics.median(dispatches[place]) * 1e3
    print(f"  {place}: {per_step:.4f}  {dispatch_ms:.2f} ms")


if __name__ == "__main__":
  main()
