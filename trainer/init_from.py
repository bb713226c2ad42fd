"""`--config.init_from=PATH`: a run that starts from pretrained params instead of random ones.

PATH is either another run's workdir (the params, and variables, of its newest checkpoint) or a
directory in a format the experiment reads (the LM: a Hugging Face Llama). The trainer knows only
this much; the experiment maps names and layouts through two optional names of its contract:

  pretrained_keys(path) -> {dotted key: (value, where it comes from)}
      The config keys the pretrained model fixes (its shapes), and an `errors.UserError` for
      anything the experiment's model cannot represent.
  EXTENDABLE_KEYS: tuple of dotted keys
      Of those keys, the ones a config may set otherwise on purpose (the LM: RoPE's scaling, to train
      at a longer context than the pretrained model's): a value other than the key's default, from
      the config file or the command line, is kept, and the run says so.
  open_pretrained(path, config, leaves) -> reader
      `reader.read(leaf, shape, index)`: the numpy slice `index` of parameter `leaf` (a tuple of
      tree-path names), read from the files without reading the rest; `reader.bytes_read` so far.

The run starts at step 0 with a fresh optimizer (and its moving average from these params). Each
parameter is assembled on the mesh from its devices' slices: a process reads only the slices its
devices hold, once each, and puts each on its devices before reading the next, so no host ever holds
a whole model (benchmarks/init_from_memory.py measures it). Once the
workdir has checkpoints, resuming wins and init_from is ignored (said once); the keys it set are
kept in WORKDIR/init_from.json, so a resume needs PATH no more.
"""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from errors import UserError
from trainer import experiment as experiment_lib
from trainer import rundir
from trainer import state as state_lib
from trainer.checkpoint import store, tree
from trainer.config import assemble
from trainer.observe.metrics import console


def configure(config, workdir: str, given=()) -> None:
  """Sets the keys the pretrained model fixes in `config`: a key given on the command line
  (`given`, dotted names) with another value is an error naming both."""
  path = config.init_from
  if not path:
    return
  if store.has_checkpoints(workdir):
    console(f"init_from={path} is ignored: {workdir} has checkpoints, and the run resumes from them")
    keys = (rundir.read_json_object(rundir.init_from(workdir)) or {}).get("keys")
    if keys is None:  # Not recorded: read again where it is still there.
      keys = _keys(path, config) if os.path.isdir(path) else {}
  else:
    keys = _keys(path, config)
    if jax.process_index() == 0:
      os.makedirs(workdir, exist_ok=True)
      with open(rundir.init_from(workdir), "w") as f:
        json.dump({"path": os.path.abspath(path), "keys": keys}, f, indent=2)
  changed = []
  extendable = experiment_lib.load(config.experiment).EXTENDABLE_KEYS
  declared = assemble.declared(config.experiment)
  for dotted, (value, source) in keys.items():
    current = assemble.get_key(config, dotted)
    if dotted in extendable and current not in (value, declared[dotted].default):
      console(f"init_from={path}: keeps {dotted}={current} (its {source} says {value}): extended on purpose")
      continue
    if dotted in given and current != value:
      raise UserError(
        f"--config.{dotted}={current} disagrees with init_from={path}: its {source} makes it {value}; "
        f"drop --config.{dotted}"
      )
    if current != value:
      assemble.set_key(config, dotted, value)
      changed.append(f"{dotted}={value}")
  if changed:
    console(f"init_from={path} sets {', '.join(changed)}")


def _keys(path: str, config) -> dict:
  if not os.path.isdir(path):
    raise UserError(f"init_from={path} is not a directory")
  if store.has_checkpoints(path):
    return {}  # Another run: its shapes must be this config's (checked parameter by parameter).
  experiment = experiment_lib.load(config.experiment)
  if experiment.pretrained_keys is None:
    raise UserError(
      f"init_from={path} has no checkpoints/ of a run, and experiments/{config.experiment}.py reads no "
      "pretrained format (pretrained_keys, open_pretrained: trainer/init_from.py)"
    )
  return {k: list(v) for k, v in experiment.pretrained_keys(path).items()}


def initial_params(comp, config) -> tuple[dict, dict | None]:
  """(params, variables or None for the model's own) placed in comp's shardings, from
  config.init_from. Every process says what it read of the files and what its devices hold."""
  path = config.init_from
  if store.has_checkpoints(path):
    return _from_run(path, comp, config)
  leaves = [
    tuple(state_lib.path_keys(p)) for p, _ in jax.tree_util.tree_flatten_with_path(comp.mdef.params)[0]
  ]
  reader = comp.experiment.open_pretrained(path, config, leaves)
  held = [0]

  def place(p, abstract, sharding):
    """One parameter from its devices' slices, each read once and put on its devices before the
    next is read: beyond the shards, a process holds one slice at a time."""
    leaf, devices = tuple(state_lib.path_keys(p)), {}
    for device, index in sharding.addressable_devices_indices_map(abstract.shape).items():
      devices.setdefault(tuple((s.start, s.stop) for s in index), (index, []))[1].append(device)
    arrays = []
    for index, on in devices.values():
      host = np.asarray(reader.read(leaf, abstract.shape, index), abstract.dtype)
      held[0] += host.nbytes
      arrays += [jax.device_put(host, d) for d in on]
      del host
    return jax.make_array_from_single_device_arrays(abstract.shape, sharding, arrays)

  params = jax.tree_util.tree_map_with_path(place, comp.mdef.params, comp.shardings.params)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  print(
    f"init_from: process {jax.process_index()} read {reader.bytes_read:,} bytes of {path} for the "
    f"{held[0]:,} bytes of params its devices hold (the model's: {total:,})",
    flush=True,
  )
  return params, None


def _from_run(path: str, comp, config) -> tuple[dict, dict | None]:
  """Params (and variables, when the run has the same) of another run's newest checkpoint."""
  with store.read_only(path) as m:
    step = m.latest_step()
    if step is None:
      raise UserError(f"init_from={path}: no finished checkpoint in {rundir.checkpoints(path)}")
    saved = m.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    metadata = m.item_metadata(step)["state"]
  if saved.get("experiment") != config.experiment:
    raise UserError(
      f"init_from={path} is a run of experiment {saved.get('experiment')!r}, this one of "
      f"{config.experiment!r}"
    )
  abstract = state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx)
  target = {"params": abstract.params}
  _check_shapes("params", metadata["params"], target["params"], path, step)
  if comp.mdef.variables and "variables" in metadata:
    target["variables"] = abstract.variables
    _check_shapes("variables", metadata["variables"], target["variables"], path, step)
  restored = ocp.PyTreeCheckpointer().restore(
    os.path.join(rundir.checkpoint(os.path.abspath(path), step), "state"),
    args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    ),
  )
  console(f"initial params from checkpoint {step} of {path}")
  return restored["params"], restored.get("variables")


def _check_shapes(part: str, saved, target, path: str, step: int) -> None:
  ours, theirs = tree.paths_and_shapes(target), tree.paths_and_shapes(saved)
  differ = [f"{n} {list(theirs.get(n, ()))} -> {list(s)}" for n, s in ours.items() if theirs.get(n) != s]
  if differ or set(theirs) - set(ours):
    extra = sorted(set(theirs) - set(ours))
    raise UserError(
      f"init_from={path}: checkpoint {step}'s {part} are not this model's: "
      + "; ".join(differ[:4] + [f"{n} not in this model" for n in extra[:4]])
    )
