"""The train steps checks.first_step has passed, kept beside the compilation cache that served them
(COMPILATION_CACHE/first_step_checked/KEY.json): a new run of a program checked before, a new workdir of
the same config say, says so in one line and runs no second layout, unless checks.first_step_every_run.

The key is the loop's own compiled step (its instructions without debug information or sharding annotations:
first_step's fingerprint, which names its per-device shapes and collectives) with the device kind, platform
and its runtime's version (libtpu's build, CUDA's), process count, layout (jax, jaxlib, XLA_FLAGS), the
source of the check and of the step it compiles (CHECKER), and the value of every config key that can shape
the step (keys.Key.program; data keys show in the batch's shapes): XLA prints a large constant as {...}, so
a fork that changes only `model.rope_base` compiles a program that fingerprints alike. The step the check
compares (with gradients) is made by that same source from that same config, so the key names it too. The
check is of XLA's partitioning, which the same program on the same devices repeats exactly: another model,
optimizer, schedule, mesh, version or flag compiles another program and is checked. What the check does not
repeat is the values: a first step that is not finite (another seed or other data under the same program) is
then the loop's own NaN/Inf handling (checkpoint.on_nonfinite) rather than exit 7; a run's values on later
steps are what checks.replicas and checks.recompute check. Where the compilation cache is off nothing is
kept; with compilation_cache=workdir the records stay in each workdir.
"""

import datetime
import hashlib
import json
import os
import tempfile

import jax

FOLDER = "first_step_checked"  # Inside the cache folder: JAX's eviction only touches its own files.
_HERE = os.path.dirname(os.path.abspath(__file__))
# A change to the check, its comparison or the step it compiles with gradients invalidates every record.
CHECKER = [os.path.join(_HERE, f) for f in ("first_step.py", "compare.py", "checked_programs.py")]
CHECKER.append(os.path.join(os.path.dirname(_HERE), "step.py"))
_FIELDS = ("when", "workdir", "other")


def folder() -> str | None:
  """Where this process keeps its verdicts: in the compilation cache JAX uses, None where it is off."""
  cache = jax.config.jax_compilation_cache_dir
  return os.path.join(cache, FOLDER) if cache else None


def program_keys(config) -> dict:
  """{dotted key: value} of the config keys that can shape the compiled train step."""
  from trainer.config import assemble, keys

  declared = assemble.declared(config.experiment)
  return {
    k: assemble.get_key(config, k)
    for k, key in sorted(declared.items())
    if key.program and key.on_resume != keys.DATA
  }


def key(fingerprint: str, meta: dict, config) -> str:
  """The verdict's name: the compiled step's fingerprint on these devices under this layout and config."""
  checker = hashlib.sha256()
  for path in CHECKER:
    with open(path, "rb") as f:
      checker.update(f.read())
  what = {
    "program": fingerprint,
    "checker": checker.hexdigest(),
    "config": program_keys(config),
    "runtime": jax.devices()[0].client.platform_version,
    **{k: meta[k] for k in ("device_kind", "platform", "device_count", "process_count", "layout")},
  }
  return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def passed(name: str) -> dict | None:
  """The record of this program's passed check, or None (never checked here, unreadable or not one)."""
  where = folder()
  try:
    with open(os.path.join(where, f"{name}.json")) as f:
      entry = json.load(f)
  except (OSError, TypeError, ValueError):
    return None
  return entry if isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in _FIELDS) else None


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
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=where)  # A name of its own on a folder pods share.
    with os.fdopen(fd, "w") as f:
      json.dump(entry, f)
    os.replace(tmp, os.path.join(where, f"{name}.json"))
  except OSError:
    pass


def line(entry: dict) -> str:
  return (
    f"checks.first_step: this train step passed on these devices on {entry['when']} ({entry['workdir']}: "
    f"gradients and updates agreed with {entry['other']}); not run again "
    "(checks.first_step_every_run=true runs it)"
  )
