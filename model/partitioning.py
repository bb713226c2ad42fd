"""Logical axis names -> mesh PartitionSpecs.

Model code names logical axes only (`embed`, `mlp`, `batch`, ...). The trainer installs the
config's rules with `nnx.logical_axis_rules(rules)` while it traces, and these helpers read them.
"""

from collections.abc import Sequence

import jax
from flax.core import spmd
from jax.sharding import PartitionSpec as P


def logical_to_spec(logical_axes: Sequence[str | None], rules) -> P:
  """Maps each logical axis through `rules`; an unknown name or a mesh axis used twice is an error."""
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name in logical_axes:
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise ValueError(f"logical axis {name!r} has no entry in sharding.rules")
    mesh_axes = table[name]
    axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
    # An axis may not shard two dimensions of one array; the later dimension stays replicated.
    axes = tuple(a for a in axes if a not in used)
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def mesh_axes(entry) -> tuple[str, ...]:
  """One dimension's entry of a PartitionSpec (None, an axis name, or a tuple of them) as a tuple."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Sharding constraint on an activation by logical names; a no-op when no rules are installed."""
  rules = spmd.get_logical_axis_rules()
  if not rules:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, rules))
