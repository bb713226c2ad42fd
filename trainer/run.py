"""Entry point behind main.py: runs one mode with a parsed config."""

from trainer.errors import UserError

MODES = ("train", "eval", "inspect", "verify")


def run(config, workdir: str, mode: str) -> None:
  if mode == "train":
    from trainer.train import train

    train(config, workdir)
  else:
    raise UserError(f"--mode={mode} is not available yet; use one of: train")
