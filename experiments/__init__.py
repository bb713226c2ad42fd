"""The experiment contract: what an experiment provides, and what the trainer guarantees in return.

An experiment is a module `experiments/NAME.py` (or a folder `experiments/NAME/` with `__init__.py`)
that binds a model, data and a loss. `trainer/` knows it only through the names below; nothing in
`trainer/` is specific to one experiment. `python -m experiments.new MINE --from=lm|vit` copies one.

Its keys live beside it, in `experiments/NAME_keys.py`, which imports no JAX (config files load it
without the model):
  KEYS: dict[str, trainer.config.keys.Key]
      The experiment's own keys (typically `model.*` and `data.*`), each declared once: default, rule
      (trainer/config/rules.py has whole, real, one_of, ...), resume class (keys.DATA for data keys:
      the data fingerprint decides; keys.MODEL, keys.changes(...), keys.refused(...), keys.FREE) and a
      one-line meaning. `configs/base.py`'s `get_config(NAME)` adds them to the trainer's keys before
      the config is locked, so they are checked like every other key; redefining a trainer key is an
      error. tests/test_config_checks.py walks every key with wrong values.
  TINY: dict[str, object]
      Overrides (dotted keys) that shrink the experiment to a pulse on 8 logical CPU devices: what a
      config's `:tiny` argument applies on top of the trainer's own shrinking.

What the module provides: `EXPERIMENT = trainer.experiment.Experiment(UNIT=..., loss_sums=..., ...)`,
naming its parts; each part's meaning and default are in trainer/experiment.py (required: UNIT,
LOGICAL_AXES, check_config, build_model, data_sources, loss_sums; the rest optional), and
trainer.experiment.load reads it. docs/reference/contract.md lists them (`make docs`).

What the trainer guarantees:
  - Global batch t holds the same records in the same order on any number of devices and processes;
    an epoch's last batch is padded with rows whose records are zeros and `valid` is False.
  - Each process reads only its own rows; batches are prepared ahead and sharded over the batch axes
    (arrays of any rank, split along their first dimension).
  - loss_sum / count is the objective of the whole global batch: the gradient is that of the summed
    loss divided once by the global count; a globally empty batch is refused before it runs.
  - Checked, not assumed: a missing name, a batch without zero `weights` on padding rows, a
    loss_sums that does not return (scalar, scalar, {name: scalar}), and a variable write the train
    state could not keep end in one `error:` line.
"""

import importlib
import os
import re
from types import ModuleType

from errors import UserError

_HERE = os.path.dirname(os.path.abspath(__file__))


def module_name(name: str) -> str:
  """'lm', 'experiments.lm', 'experiments/lm.py' or 'experiments/lm/' -> 'lm'."""
  given = name
  name = name.strip().rstrip("/")
  if name.endswith(".py"):
    name = name[: -len(".py")]
  if "/" in name or os.sep in name:
    folder, name = os.path.split(os.path.normpath(name))
    if os.path.abspath(folder) != _HERE and os.path.normpath(folder) != "experiments":
      raise UserError(f"experiment={given!r}: an experiment lives in experiments/ (experiments/NAME.py)")
  elif name.startswith("experiments."):
    name = name[len("experiments.") :]
  if not re.fullmatch(r"[A-Za-z_]\w*", name):
    raise UserError(f"experiment={given!r}: use a module name under experiments/, e.g. 'lm'")
  return name


# Command-line tools beside the experiments: `python -m experiments.new` forks one, `experiments.sample`
# reads text from a trained language model.
TOOLS = ("new", "sample")


def available() -> list[str]:
  names = []
  for entry in sorted(os.listdir(_HERE)):
    stem = entry[:-3] if entry.endswith(".py") else entry
    is_module = entry.endswith(".py") or os.path.isfile(os.path.join(_HERE, entry, "__init__.py"))
    if is_module and not stem.startswith("_") and stem not in TOOLS and not stem.endswith("_keys"):
      names.append(stem)
  return names


def _no_such(name: str) -> UserError:
  return UserError(f"experiment={name!r}: no experiments/{name}.py (available: {', '.join(available())})")


def load_keys(name: str) -> ModuleType:
  """experiments/NAME_keys.py: the experiment's KEYS and TINY, without importing the experiment."""
  name = module_name(name)
  try:
    module = importlib.import_module(f"experiments.{name}_keys")
  except ModuleNotFoundError as e:
    if e.name not in (f"experiments.{name}_keys", f"experiments.{name}"):
      raise
    if not any(os.path.exists(os.path.join(_HERE, n)) for n in (f"{name}.py", f"{name}/__init__.py")):
      raise _no_such(name) from None
    raise UserError(
      f"experiments/{name}_keys.py is missing: an experiment's keys live there (KEYS and TINY, see "
      "experiments/__init__.py)"
    ) from None
  missing = [n for n in ("KEYS", "TINY") if not hasattr(module, n)]
  if missing:
    raise UserError(f"experiments/{name}_keys.py lacks {', '.join(missing)} (see experiments/__init__.py)")
  return module


def import_module(name: str) -> ModuleType:
  """The experiment module `name` (see module_name); trainer.experiment.load reads its parts."""
  name = module_name(name)
  try:
    return importlib.import_module(f"experiments.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"experiments.{name}":
      raise
    raise _no_such(name) from None
