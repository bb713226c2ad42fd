"""Write a run's weights as safetensors, read through trainer/checkpoint/read.py (which a notebook
uses directly: `from trainer.checkpoint.read import load`). From the shell:

  python -m trainer.modes.export --workdir=runs/smoke [--step=N] --out=smoke.safetensors
  python -m trainer.modes.export --workdir=runs/text [--step=N] --format=hf --out=OUTDIR

`--format=NAME` writes in a format of the experiment's (its EXPORT_FORMATS: the LM's `hf` is a
Hugging Face Llama directory that transformers loads).
Without it the file holds every parameter under its tree path ('blocks/0/attn/wq'), and every other
variable of the model (a BatchNorm's statistics) under its own, with the config and step as the
file's metadata. `--ema` writes the params' moving average in place of the params (ema.decay > 0).
`safetensors.numpy.load_file` reads it back. Any mesh or device count the checkpoint was saved on
restores onto this process's first device.
"""

import os
import sys

import jax
import numpy as np

import exit_codes
from errors import UserError
from trainer import state as state_lib
from trainer.checkpoint.read import Loaded, load


def named_tensors(params) -> dict[str, np.ndarray]:
  """{'blocks/0/attn/wq': array, ...}: every parameter under its tree path."""
  return {
    "/".join(state_lib.path_keys(path)): np.ascontiguousarray(leaf)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
  }


def export(workdir: str, out: str, step: int | None = None, ema: bool = False) -> Loaded:
  """Writes checkpoint `step`'s params (or their average) and variables to `out` (safetensors), the
  config and step as metadata."""
  from safetensors.numpy import save_file

  run = load(workdir, step)
  weights = "ema" if ema else "params"
  metadata = {"config": run.config.to_json(), "step": str(run.step), "format": "np", "weights": weights}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  save_file(named_tensors(run.weights(ema)) | named_tensors(run.variables), out, metadata=metadata)
  return run


def export_format(workdir: str, out: str, fmt: str, step: int | None = None, ema: bool = False):
  """Writes checkpoint `step`'s params (or their average) in the experiment's format `fmt` to `out`;
  (run, [what was written])."""
  from trainer import components

  run = load(workdir, step)
  experiment = components.load_experiment(run.config)
  formats = experiment.EXPORT_FORMATS
  if fmt not in formats:
    offered = f"its formats: {', '.join(sorted(formats))}" if formats else "it declares no EXPORT_FORMATS"
    raise UserError(f"--format={fmt}: experiments/{run.config.experiment}.py cannot write it ({offered})")
  return run, formats[fmt](run, out, run.weights(ema))


def main(argv=None) -> None:
  import argparse

  parser = argparse.ArgumentParser(description="Write a run's params as a safetensors file.")
  parser.add_argument("--workdir", required=True, help="the run's --workdir")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  parser.add_argument("--out", required=True, help="FILE.safetensors to write (a directory for --format)")
  parser.add_argument("--format", default="", help="one of the experiment's formats (the LM: hf)")
  parser.add_argument("--ema", action="store_true", help="the params' moving average (ema.decay > 0)")
  args = parser.parse_args(argv)
  try:
    if args.format:
      run, written = export_format(args.workdir, args.out, args.format, args.step, args.ema)
    else:
      run, written = export(args.workdir, args.out, args.step, args.ema), []
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(exit_codes.USER_EXIT)
  if written:
    print(f"wrote checkpoint {run.step} ({run.config.experiment}) to {args.out}: {', '.join(written)}")
    return
  count = sum(x.size for x in jax.tree.leaves(run.params))
  what = "averaged parameters" if args.ema else "parameters"
  print(f"wrote {count:,} {what} of checkpoint {run.step} ({run.config.experiment}) to {args.out}")


if __name__ == "__main__":
  main()
