"""Entry point behind main.py: runs one mode with a parsed config."""

import os
import sys

import exit_codes
from errors import UserError

MODES = ("train", "eval", "inspect", "verify")


def run(config, workdir: str, mode: str, target_device: str | None = None, given=()) -> None:
  """`given`: the dotted keys set on the command line (init_from's keys must agree with them)."""
  from trainer import init_from
  from trainer.cluster import runtime

  init_from.configure(config, workdir, given)
  runtime.use_compilation_cache(config.compilation_cache, workdir)
  if mode == "train":
    import trainer
    from trainer.train import train

    summary = train(config, workdir, started=trainer.STARTED)  # Start-up counts the imports.
    # A scheduler that restarts failed jobs (launch/k8s sets this) would take a clean exit as "finished".
    code = os.environ.get("PREEMPTED_EXIT_CODE")
    if code and summary.get("preempted_by") and summary["final_step"] < config.steps:
      sys.exit(int(code))
  elif mode == "eval":
    from trainer.evaluate import evaluate_checkpoint

    evaluate_checkpoint(config, workdir)
  elif mode == "inspect":
    from trainer.modes.inspect import inspect

    inspect(config, workdir, target_device)
  elif mode == "verify":
    from trainer.modes.verify import verify

    if not verify(config, workdir):
      sys.exit(exit_codes.FAILED_EXIT)  # The table above says which group and step failed.
  else:
    raise UserError(f"--mode={mode}: use one of {', '.join(MODES)}")
