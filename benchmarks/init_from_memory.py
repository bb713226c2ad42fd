"""What `--config.init_from` of a Hugging Face directory reads and holds per process, for lm_1b's shapes
(Llama 3.2 1B: 1.24B parameters) by default.

  .venv/bin/python benchmarks/init_from_memory.py [--config=configs/lm_1b.py] [--processes=2]
      [--cpu_devices=4] [--dir=DIR]

Writes a Hugging Face Llama directory of the config's shapes to --dir (default: a temporary one,
removed at the end): config.json and one model.safetensors in bfloat16, as the published checkpoints
are, filled with a constant (what is read matters here, not the values). Then starts --processes
processes joined by jax.distributed on this machine, FSDP over all their devices (mesh.fsdp=-1,
mesh.dcn_fsdp=processes), and each reads its params through trainer/init_from.py as training would
(no optimizer state, no step) and prints one row:
  read    bytes read from the files (bfloat16: half of what they become in float32);
  held    bytes of params its devices hold (float32);
  peak    its peak anonymous memory (RssAnon, sampled every 5 ms) above the level before reading;
  beyond  peak - held: what reading needs beyond its own shards.
On CPU a device's arrays are this process's memory, so held is part of peak; file pages mapped for
reading are page cache (RssFile), not counted.
"""

import argparse
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _anon_bytes() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("RssAnon:"):
        return int(line.split()[1]) * 1024
  return 0


def write_directory(config, directory: str) -> int:
  """A bfloat16 Hugging Face Llama directory of config's shapes; its size in bytes."""
  import functools

  import jax
  import numpy as np

  from experiments import lm
  from model import hf_llama
  from trainer import state as state_lib

  mdef = state_lib.model_def(functools.partial(lm.build_model, config))
  tensors, names = {}, hf_llama.names(config.model)
  for path, leaf in jax.tree_util.tree_flatten_with_path(mdef.params)[0]:
    lay, _, scanned = names.where(tuple(state_lib.path_keys(path)))
    shape = hf_llama.hf_shape(lay, leaf.shape[1:] if scanned else leaf.shape)
    tensors |= dict.fromkeys(names.hf_names(tuple(state_lib.path_keys(path))), shape)
  header, offset = {}, 0
  for name, shape in sorted(tensors.items()):
    size = 2 * int(np.prod(shape))
    header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, hf_llama.CONFIG), "w") as f:
    json.dump(hf_llama.hf_config(config.model), f)
  encoded = json.dumps(header).encode()
  chunk = np.full(2**24, 0x3C23, np.uint16).tobytes()  # bfloat16 0.01, 32 MiB at a time.
  with open(os.path.join(directory, hf_llama.SINGLE), "wb") as f:
    f.write(len(encoded).to_bytes(8, "little") + encoded)
    left = offset
    while left:
      f.write(chunk[: min(left, len(chunk))])
      left -= min(left, len(chunk))
  return offset


def worker(args) -> None:
  import jax

  from trainer import components, init_from
  from trainer.cluster import runtime

  runtime.configure_cpu_devices(args.cpu_devices)
  jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
  config = runpy.run_path(args.config)["get_config"]()
  config.init_from = args.dir
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor, config.mesh.dcn_fsdp = 1, -1, 1, args.processes
  workdir = tempfile.mkdtemp(prefix="init_from_bench_")  # Only for init_from.json; removed at once.
  init_from.configure(config, workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  comp = components.build(config, with_data=False)
  peak, done = [_anon_bytes()], threading.Event()
  before = peak[0]

  def sample():
    while not done.is_set():
      peak[0] = max(peak[0], _anon_bytes())
      time.sleep(0.005)

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  params, _ = init_from.initial_params(comp, config)
  jax.block_until_ready(params)
  done.set()
  thread.join()
  peak[0] = max(peak[0], _anon_bytes())
  held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
  row = {"process": jax.process_index(), "held": held, "peak": peak[0] - before}
  print("ROW " + json.dumps(row), flush=True)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default=os.path.join(REPO, "configs/lm_1b.py"))
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--cpu_devices", type=int, default=4)
  parser.add_argument("--dir", default="")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--process_id", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    return worker(args)
  made = not args.dir
  args.dir = args.dir or tempfile.mkdtemp(prefix="hf_llama_")
  try:
    config = runpy.run_path(args.config)["get_config"]()
    t = time.time()
    size = write_directory(config, args.dir)
    print(f"wrote {size:,} bytes of bfloat16 weights to {args.dir} in {time.time() - t:.0f} s", flush=True)
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    common = [sys.executable, __file__, "--worker", f"--config={args.config}", f"--dir={args.dir}"]
    common += [f"--processes={args.processes}", f"--cpu_devices={args.cpu_devices}"]
    common += [f"--coordinator=127.0.0.1:{port}"]
    procs = [
      subprocess.Popen([*common, f"--process_id={i}"], stdout=subprocess.PIPE, text=True, cwd=REPO)
      for i in range(args.processes)
    ]
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    for out in outputs:
      reads = [line for line in out.splitlines() if line.startswith("init_from: process")]
      rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
      for line, row in zip(reads, rows, strict=True):
        read = int(line.split()[4].replace(",", ""))
        gib = lambda n: f"{n / 2**30:.2f} GiB"
        print(
          f"process {row['process']}: read {gib(read)} ({read / size:.1%} of the file), held "
          f"{gib(row['held'])}, peak {gib(row['peak'])}, beyond its shards {gib(row['peak'] - row['held'])}"
        )
  finally:
    if made:
      shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
  main()
