"""Sharding strategies as named presets of logical-axis rules, and the optimizer state's placement.

| strategy | params, grads          | optimizer state                     | batch                 |
|----------|------------------------|-------------------------------------|-----------------------|
| dp       | replicated             | replicated                          | data x fsdp x expert  |
| zero1    | replicated             | sharded over data x fsdp (x expert) | data x fsdp x expert  |
| fsdp     | `embed` over fsdp      | follows params                      | data x fsdp x expert  |
| fsdp_tp  | `embed` over fsdp; `mlp`, `heads` over tensor | follows params | data x fsdp x expert |
Under every strategy a mixture of experts' expert weights ([experts, embed, mlp]) are split over `expert`
along their experts, on top of the above (fsdp_tp: experts over expert, embed over fsdp, mlp over
tensor). The batch is split over `expert` too, so attention is not repeated on every expert shard;
the routed rows are exchanged by all-to-all: [batch, experts, capacity, embed] goes from the batch
split over expert (`moe_batch` keeps data x fsdp) to the experts split over it, and back.
Under every strategy the activations' sequence (`act_seq`) is split over `context`; the batch arrays
arrive split by rows only, and each device takes its chunk of its rows' columns without communication.
Under fsdp and fsdp_tp, a parameter of at least `sharding.fsdp_min_size` elements that the rules leave
unsplit over `fsdp` (a table whose logical axes map to nothing, a fork's own weight) is split
along its largest dimension that can take it (`fsdp_spec`): per-device parameter and optimizer bytes
stay near total / N whatever axes a model names.

The presets name the trainer's logical axes only. An experiment's model may use more: its
LOGICAL_AXES maps each to the trainer name it is sharded like (or None: replicated). `sharding.rules`
entries then replace the entry of the same logical name, or put a new name on mesh axes; a name nothing
knows is an error naming the closest (check_rule_names).
"""

import difflib
import math

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from model.partitioning import logical_to_spec, mesh_axes
from trainer import mesh as mesh_lib

_BATCH = (
  ("batch", ("data", "fsdp", "expert")),
  ("act_seq", "context"),  # The sequence of every activation (model/context.py attends across it).
  ("moe_batch", ("data", "fsdp")),  # Routed rows, once the all-to-all has split their experts.
  ("experts", "expert"),
  ("act_experts", "expert"),
)
# Activations and small weights: replicated unless tensor parallelism names them below. `layers`, the
# leading axis of scanned layers' stacked params, is never split: each step of the scan reads one layer.
_COMMON = (
  ("layers", None),
  ("kv", None),
  ("norm", None),
  ("act_embed", None),
  ("act_kv", None),
)
_REPLICATED = (("embed", None), ("mlp", None), ("heads", None))
_NO_TP_ACTS = (("act_heads", None), ("act_mlp", None))
_TP = (("mlp", "tensor"), ("heads", "tensor"))
_TP_ACTS = (("act_heads", "tensor"), ("act_mlp", "tensor"))

PRESETS = {
  "dp": _BATCH + _COMMON + _REPLICATED + _NO_TP_ACTS,
  "zero1": _BATCH + _COMMON + _REPLICATED + _NO_TP_ACTS,
  "fsdp": _BATCH + _COMMON + _REPLICATED[1:] + (("embed", "fsdp"),) + _NO_TP_ACTS,
  "fsdp_tp": _BATCH + _COMMON + (("embed", "fsdp"),) + _TP + _TP_ACTS,
}


def resolve_rules(strategy: str, overrides, experiment_axes=None) -> tuple:
  """The preset for `strategy`, extended by the experiment's axes ({name: trainer name it is sharded
  like, or None}), with `overrides` ((logical name, mesh axes) pairs) applied."""
  if strategy not in PRESETS:
    raise UserError(f"sharding.strategy={strategy!r}: use one of {sorted(PRESETS)}")
  table = dict(PRESETS[strategy])
  for name, like in (experiment_axes or {}).items():
    if name in table:
      raise UserError(f"LOGICAL_AXES: {name!r} is one of the trainer's axes; change it with sharding.rules")
    if like is not None and like not in table:
      raise UserError(f"LOGICAL_AXES: {name!r} is sharded like {like!r}, which is not one of {sorted(table)}")
    table[name] = None if like is None else table[like]
  for entry in overrides:
    if len(entry) != 2:
      raise UserError(f"sharding.rules entry {entry!r}: expected (logical name, mesh axes)")
    name, axes = entry
    axes = tuple(axes) if isinstance(axes, list) else axes
    for axis in (axes,) if isinstance(axes, str) else axes or ():
      if axis not in mesh_lib.AXES:
        raise UserError(f"sharding.rules: {name!r} -> {axis!r} is not a mesh axis {mesh_lib.AXES}")
    table[name] = axes
  return tuple(table.items())


def check_rule_names(overrides, traced, experiment_axes=None) -> list[str]:
  """`sharding.rules` names against those that can use them. One that neither the model's parameters
  and variables (`traced`), the presets nor LOGICAL_AXES know would change nothing (a weight named
  'expert' stays unsplit under a rule for 'experts'): an error naming the closest. One the presets or
  LOGICAL_AXES know but no parameter or variable of this model carries (`layers` without scanned
  layers) is a warning, returned; activation names (`batch`, `act_*`) are not warned about, since
  only a forward pass shows them."""
  known = set(traced) | {n for preset in PRESETS.values() for n, _ in preset} | set(experiment_axes or {})
  warnings = []
  for name, _ in overrides:
    if name in traced:
      continue
    if name not in known:
      close = difflib.get_close_matches(name, sorted(known), n=1)
      hint = f"did you mean {close[0]!r}?" if close else f"the names: {sorted(known)}"
      raise UserError(
        f"sharding.rules: {name!r} is no logical axis name of this model, the presets or the "
        f"experiment's LOGICAL_AXES, so its rule would split nothing; {hint} (a name only the model's "
        "activations use is declared in the experiment's LOGICAL_AXES)"
      )
    if name != "batch" and not name.startswith("act_"):
      warnings.append(
        f"warning: sharding.rules: no parameter or variable of this model has a {name!r} dimension "
        "(e.g. 'layers' without model.scan_layers): its rule changes nothing"
      )
  return warnings


def traced_names(*spec_trees) -> set[str]:
  """The logical axis names in trees of logical PartitionSpecs (ModelDef.logical_specs, variable_specs)."""
  leaves = jax.tree.leaves(spec_trees, is_leaf=lambda x: isinstance(x, P))
  return {name for spec in leaves for entry in spec for name in mesh_axes(entry)}


def unsplit_notes(logical_axes, rules, mesh_shape: dict) -> list[str]:
  """Why a dimension is not split where its rule says: one mesh axis cannot split two dimensions of one
  array, so logical_to_spec leaves the later dimension unsplit over an axis an earlier one took (a
  weight ('embed', 'mlp') with both mapped to fsdp is split along embed only). One line per such
  dimension and axis (axes of size 1 split nothing either way: not noted)."""
  table = dict(rules)
  kept = [mesh_axes(entry) for entry in logical_to_spec(logical_axes, rules)]
  holder = {axis: j for j, axes in enumerate(kept) for axis in axes}
  notes = []
  for i, name in enumerate(logical_axes):
    for axis in mesh_axes(table.get(name)) if name is not None else ():
      if axis not in kept[i] and mesh_shape.get(axis, 1) > 1:
        j = holder[axis]
        notes.append(
          f"dimension {i} ({name!r}) is not split over {axis!r}: dimension {j} ({logical_axes[j]!r}) "
          "already is, and one mesh axis cannot split two dimensions of one array"
        )
  return notes


def shards_optimizer_over_batch(strategy: str) -> bool:
  return strategy == "zero1"


def batch_axes(rules) -> tuple[str, ...]:
  return mesh_axes(logical_to_spec(("batch",), rules)[0])


def zero1_spec(shape, param_spec: P, mesh: Mesh, rules) -> P:
  """ZeRO-1: a replicated parameter's optimizer moment split over the batch axes along the largest
  dimension they divide. A leaf no dimension of which they divide stays replicated (scalars, tiny
  vectors); that is an explicit choice, listed by --mode=inspect."""
  axes = tuple(a for a in batch_axes(rules) if a not in jax.tree.leaves(tuple(param_spec)))
  ways = math.prod(mesh.shape[a] for a in axes)
  spec = list(param_spec) + [None] * (len(shape) - len(param_spec))
  free = [i for i, d in enumerate(shape) if spec[i] is None and ways > 1 and d % ways == 0]
  if not free:
    return P(*spec)
  spec[max(free, key=lambda i: shape[i])] = axes if len(axes) > 1 else axes[0]
  return P(*spec)


def shards_params_over_fsdp(strategy: str) -> bool:
  return strategy in ("fsdp", "fsdp_tp")


def fsdp_spec(shape, param_spec: P, mesh: Mesh, min_size: int, logical=()) -> P:
  """FSDP for every large parameter: one of `min_size` elements or more that `param_spec` leaves
  unsplit over fsdp gets fsdp added to its largest dimension that can take it (a dimension already
  split over `tensor` is split over both: a lookup table then stays split along one dimension only,
  which the lookup handles without gathering the table; none divisible: left as it is). A dimension
  whose `logical` name is `layers` (stacked scanned layers) is never chosen nor counted in the size."""
  ways = mesh.shape["fsdp"]
  spec = list(param_spec) + [None] * (len(shape) - len(param_spec))
  names = tuple(logical) + (None,) * len(shape)
  # A stacked parameter is as large as one layer's slice: the scan reads one at a time.
  size = math.prod(d for d, name in zip(shape, names, strict=False) if name != "layers")
  if ways == 1 or "fsdp" in jax.tree.leaves(tuple(spec)) or size < min_size:
    return P(*spec)
  axes = [mesh_axes(a) for a in spec]
  fits = [
    i
    for i, d in enumerate(shape)
    if d % (math.prod(mesh.shape[a] for a in axes[i]) * ways) == 0 and names[i] != "layers"
  ]
  if fits:
    i = max(fits, key=lambda i: shape[i])
    spec[i] = "fsdp" if not axes[i] else (*axes[i], "fsdp")
  return P(*spec)


def optimizer_leaf_sharding(shape, param_sharding: NamedSharding, strategy: str, rules) -> NamedSharding:
  if not shards_optimizer_over_batch(strategy):
    return param_sharding
  mesh = param_sharding.mesh
  return NamedSharding(mesh, zero1_spec(shape, param_sharding.spec, mesh, rules))
