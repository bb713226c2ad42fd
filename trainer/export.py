"""`python -m trainer.export ...`: the same command as `python -m trainer.modes.export` (see there)."""

from trainer.modes.export import main

if __name__ == "__main__":
  main()
