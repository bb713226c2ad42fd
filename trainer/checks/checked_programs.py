"""The train steps checks.first_step has passed, kept beside the compilation cache that served them
(COMPILATION_CACHE/first_step_checked/KEY.json): a new run of a program checked before, a new workdir of
the same config say, says so in one line and runs no second layout, unless checks.first_step_every_run.

The key is the loop's own compiled step (its instructions without debug information or sharding
annotations: first_step's fingerprint, which names its per-device shapes and collectives) with the
device kind, platform, process count and layout (jax, jaxlib, XLA_FLAGS). The check is of XLA's
partitioning of that program, which the same program on the same devices repeats exactly; a run's
own values are what checks.replicas and checks.recompute check. Another model, config, step count,
mesh, version or flag is another key and is checked. Where the cache is off nothing is kept.
"""

import datetime
import hashlib
import json
import os

import jax

FOLDER = "first_step_checked"  # Inside the cache folder: JAX's eviction only touches its own files.


def folder() -> str | None:
  """Where this process keeps its verdicts: in the compilation cache JAX uses, None where it is off."""
  cache = jax.config.jax_compilation_cache_dir
  return os.path.join(cache, FOLDER) if cache else None


def key(fingerprint: str, meta: dict) -> str:
  """The verdict's name: the compiled step's fingerprint on these devices under this layout."""
  what = {
    "program": fingerprint,
    **{k: meta[k] for k in ("device_kind", "platform", "device_count", "process_count", "layout")},
  }
  return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def passed(name: str) -> dict | None:
  """The record of this program's passed check, or None (never checked here, or unreadable)."""
  where = folder()
  try:
    with open(os.path.join(where, f"{name}.json")) as f:
      return json.load(f)
  except (OSError, TypeError, ValueError):
    return None


def record(name: str, workdir: str, other: str, worst: dict) -> None:
  """Keeps a passed check (written whole or not at all: concurrent runs share the folder). A cache
  that cannot be written costs the next run a check, nothing more."""
  where = folder()
  if where is None:
    return
  entry = {
    "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "workdir": os.path.abspath(workdir),
    "other": other,
    "worst": worst,
  }
  try:
    os.makedirs(where, exist_ok=True)
    tmp = os.path.join(where, f"{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
      json.dump(entry, f)
    os.replace(tmp, os.path.join(where, f"{name}.json"))
  except OSError:
    pass


def line(entry: dict) -> str:
  return (
    f"checks.first_step: this program passed on these devices on {entry['when']} ({entry['workdir']}: "
    f"gradients and updates agreed with {entry['other']}); not run again "
    "(checks.first_step_every_run=true runs it)"
  )
