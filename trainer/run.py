"""Entry point behind main.py: runs one mode with a parsed config."""

import sys

from trainer.errors import UserError

MODES = ("train", "eval", "inspect", "verify")


def run(config, workdir: str, mode: str) -> None:
  if mode == "train":
    from trainer.train import train

    train(config, workdir)
  elif mode == "verify":
    from trainer.verify import verify

    if not verify(config, workdir):
      sys.exit(1)  # The table above says which group and step failed.
  else:
    raise UserError(f"--mode={mode} is not available yet; use one of: train, verify")
