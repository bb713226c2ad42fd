"""How a config is put together: the trainer's declared keys (trainer/config/trainer_keys.py) plus an
experiment's (experiments/NAME_keys.py), locked; and the short config arguments of
`--config=configs/NAME.py:tiny,fsdp=8`.

The helpers live here so that config files stay values only. JAX-free, like everything a config file
loads: neither the trainer's machinery nor the experiment's model is imported.
"""

import ml_collections

import experiments
from errors import UserError
from trainer.config import keys, trainer_keys

# What `:tiny` does to the trainer's keys: a pulse of a few steps on 8 logical CPU devices, with
# checkpoints and one evaluation batch. The experiment's TINY shrinks its model and data on top.
TINY = {
  "steps": 2,
  "global_batch_size": 16,
  "log_every": 1,
  "eval_every": 0,
  "eval_steps": 1,
  "checkpoint.every": 2,
  "data.read_threads": 0,
  "data.worker_processes": 0,
  "optimizer.warmup_steps": 2,
}
# `fsdp=8`: these axes as given, the others 1, `data` the rest. The mesh keys' axes, in trainer/mesh.py's
# order (AXES; this file stays JAX-free).
MESH_ARGS = tuple(k[5:] for k in trainer_keys.KEYS if k.startswith("mesh.") and not k.startswith("mesh.dcn_"))
ARGS = {"steps": "steps", "batch": "global_batch_size", "strategy": "sharding.strategy"}


def declared(experiment: str) -> dict[str, keys.Key]:
  """Every key a config of `experiment` has: the trainer's, then the experiment's, which may add to the
  trainer's sections (data, model, ...) but never redefine a trainer key."""
  name = experiments.module_name(experiment)
  own = experiments.load_keys(name).KEYS
  for dotted in own:
    if dotted in trainer_keys.KEYS or any(dotted.startswith(f"{k}.") for k in trainer_keys.KEYS):
      raise UserError(
        f"experiments/{name}_keys.py redefines {dotted}, a key of trainer/config/trainer_keys.py"
      )
  return {**trainer_keys.KEYS, **own}


def config(experiment: str) -> ml_collections.ConfigDict:
  """The locked config of `experiment` at every key's default."""
  c = keys.to_config(declared(experiment))
  c.experiment = experiments.module_name(experiment)
  c.lock()
  return c


def dotted_keys(c, prefix: str = "") -> set[str]:
  """Every dotted key of a (nested) config."""
  out = set()
  for k, v in c.items():
    out |= dotted_keys(v, f"{prefix}{k}.") if isinstance(v, ml_collections.ConfigDict) else {f"{prefix}{k}"}
  return out


def get_key(c, dotted: str):
  node = c
  for part in dotted.split("."):
    node = node[part]
  return node


def set_key(c, dotted: str, value) -> None:
  node = c
  *path, leaf = dotted.split(".")
  for p in path:
    node = node[p]
  node[leaf] = value


def apply_args(c: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
  """Applies a config file's argument: comma-separated `tiny`, the mesh axes (`data=N`, `fsdp=N`,
  `expert=N`, `context=N`, `tensor=N`), `steps=N`, `batch=N` (global batch size) and `strategy=NAME`.
  Mesh axes named set the mesh: the others become 1, and `data` (unless named) takes the remaining
  devices (-1)."""
  mesh = {}
  for item in filter(None, (a.strip() for a in (arg or "").split(","))):
    name, _, value = item.partition("=")
    if item == "tiny":
      microbatches = min(c.microbatches, 2)
      for key, v in {**TINY, **experiments.load_keys(c.experiment).TINY}.items():
        set_key(c, key, v)
      c.microbatches = microbatches
    elif name in MESH_ARGS and value:
      mesh[name] = _int(item, value)
    elif name in ARGS and value:
      set_key(c, ARGS[name], value if name == "strategy" else _int(item, value))
    else:
      raise UserError(
        f"config argument {item!r}: use a comma-separated list of tiny, "
        f"{', '.join(f'{a}=N' for a in MESH_ARGS)}, steps=N, batch=N, strategy=NAME"
      )
  if mesh:
    for axis in MESH_ARGS:
      c.mesh[axis] = mesh.get(axis, -1 if axis == "data" else 1)
  return c


def _int(item: str, value: str) -> int:
  try:
    return int(value)
  except ValueError:
    raise UserError(f"config argument {item!r}: {value!r} is not a whole number") from None
