"""Why the local tier has one writer thread (trainer/checkpoint/local.py): host memory and device-to-host
speed over repeated copies of a ~1.2 GiB state (the ~107M model's parameters and two optimizer moments,
216 float32 arrays), by the thread that brings each copy to host memory and writes it to /dev/shm:

  thread: a new thread per copy (the tier before issue 36's fix)
  one:    one writer thread for the run (the tier now)
  trim:   a new thread per copy, then malloc_trim(0)

Prints each copy's resident memory (VmRSS), its seconds to host memory (and GiB/s) and to write. On an
accelerator only: logical CPU devices hand numpy their own buffers, so nothing is copied. Run each mode in
its own process (an accelerator takes one):

  .venv/bin/python benchmarks/host_copy_threads.py {thread,one,trim} [--copies=12]

On a TPU v5e host: a thread per copy grew 1.1 GiB per copy at 3 GiB/s; one writer held 15.1 GiB from the
second copy on at 12.6 GiB/s; trim held it at 2.7 GiB/s (fresh pages faulted in each time).
"""

import argparse
import ctypes
import os
import queue
import shutil
import sys
import threading
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.checkpoint.local_shards import device_copy, host_copy  # noqa: E402

SHAPES = [(8192, 768)] * 2 + [(768, 768)] * 40 + [(768, 3072)] * 30


def resident_mib() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("mode", choices=["thread", "one", "trim"])
  parser.add_argument("--copies", type=int, default=12)
  args = parser.parse_args()
  state = [jnp.full(shape, i, jnp.float32) for i, shape in enumerate(SHAPES * 3)]
  mib = sum(x.nbytes for x in state) / 2**20
  folder = f"/dev/shm/host-copy-threads-{os.getpid()}"
  os.makedirs(folder)
  print(f"{args.mode}: {len(state)} arrays, {mib:.0f} MiB on {jax.devices()[0].device_kind}")
  print(f"  resident at the start: {resident_mib()} MiB")

  def copy(box: list, i: int) -> tuple[float, float]:
    started = time.time()
    host = host_copy(box.pop())  # The tier's own: every shard's transfer started, then each awaited.
    copied = time.time()
    with open(f"{folder}/{i % 3}", "wb") as f:
      for shards in host.values():
        for a in shards.values():
          f.write(memoryview(a).cast("B"))
    return copied - started, time.time() - copied

  jobs, done = queue.Queue(), queue.Queue()

  def writer(copies: int) -> None:
    for _ in range(copies):
      done.put(copy(*jobs.get()))

  if args.mode == "one":
    threading.Thread(target=writer, args=(args.copies,)).start()
  try:
    for i in range(args.copies):
      box = [device_copy(state)]
      jobs.put((box, i))
      if args.mode != "one":
        threading.Thread(target=writer, args=(1,)).start()
      to_host_s, write_s = done.get()
      if args.mode == "trim":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
      print(
        f"  copy {i}: resident {resident_mib()} MiB, to host {to_host_s:.3f} s "
        f"({mib / 1024 / to_host_s:.1f} GiB/s), written {write_s:.3f} s"
      )
  finally:
    shutil.rmtree(folder)


if __name__ == "__main__":
  main()
