"""A run directory: every path in it, named once, and reading back what a run wrote there, without
JAX (the launchers and reports use it). docs/reference/outputs.md lists them.

Every file here can be torn by a kill mid-write or edited by hand: a reader gets the rows it can
trust (errors.require_keys names what an incomplete one lacks).
"""

import json
import os

from errors import require_keys


def config(workdir: str) -> str:
  return os.path.join(workdir, "config.json")  # The resolved config.


def init_from(workdir: str) -> str:
  return os.path.join(workdir, "init_from.json")  # Where the initial params came from, and the keys they set.


def metrics(workdir: str) -> str:
  return os.path.join(workdir, "metrics.jsonl")  # Process 0: one row per logged step and event.


def summary(workdir: str) -> str:
  return os.path.join(workdir, "summary.json")


def processes(workdir: str) -> str:
  return os.path.join(workdir, "processes")


def process_log(workdir: str, process: int) -> str:
  return os.path.join(processes(workdir), f"process_{process}.jsonl")


def checkpoints(workdir: str) -> str:
  return os.path.join(workdir, "checkpoints")


def checkpoint(workdir: str, step: int) -> str:
  return os.path.join(checkpoints(workdir), str(step))


def tensorboard(workdir: str) -> str:
  return os.path.join(workdir, "tensorboard")


def profile(workdir: str, process: int) -> str:
  return os.path.join(workdir, "profile", f"process_{process}")


def crash_stacks(workdir: str, process: int) -> str:
  return os.path.join(workdir, "crashes", f"process_{process}.txt")


def compilation_cache(workdir: str) -> str:
  return os.path.join(workdir, "compilation_cache")


def user_compilation_cache() -> str:
  """The compilation cache every run of this user on this host shares: $XDG_CACHE_HOME, else ~/.cache."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jax-template", "compilation")


def mode_output(workdir: str, mode: str) -> str:
  """inspect.json, verify.json, eval.json: what --mode=inspect, verify and eval write."""
  return os.path.join(workdir, f"{mode}.json")


def report(workdir: str) -> str:
  return os.path.join(workdir, "report")  # The PNGs of `python -m trainer.observe.report`.


# Every row the trainer writes has its step; one without was written by other code or by hand.
_NOT_OURS = "the trainer did not write this row: remove it"


def read_jsonl(path: str, required: tuple[str, ...] = ()) -> list[dict]:
  """The JSON-object rows of a .jsonl file; a line torn by a kill (or anything but an object) is
  skipped, a row without a `required` key is a UserError naming it. A missing file has no rows."""
  rows = []
  try:
    with open(path) as f:
      for number, line in enumerate(f, 1):
        try:
          row = json.loads(line)
        except ValueError:
          continue
        if isinstance(row, dict):
          rows.append(require_keys(row, required, f"{path} line {number}", _NOT_OURS))
  except FileNotFoundError:
    pass
  return rows


def read_json_object(path: str) -> dict | None:
  """A JSON object file written atomically (summary.json); None if missing, torn or not an object."""
  try:
    with open(path) as f:
      value = json.load(f)
  except (OSError, ValueError):
    return None
  return value if isinstance(value, dict) else None


def newest_checkpoint(workdir: str | None) -> int | None:
  """The newest complete checkpoint step under WORKDIR/checkpoints (a partial save has a suffix)."""
  try:
    steps = [int(n) for n in os.listdir(checkpoints(workdir)) if n.isdigit()]
  except (OSError, TypeError):
    return None
  return max(steps, default=None)
