"""How two computations of the same thing are compared, by verify (the mesh against one device) and
by the first-step check (one partitioning against another): norm ratios per parameter group, against
tolerances by compute dtype."""

import jax
import numpy as np

from trainer import state as state_lib

# (loss relative difference, gradient/parameter norm ratio) by compute dtype; measured in tests.
TOLERANCES = {"float32": (1e-5, 1e-3), "bfloat16": (2e-3, 5e-2)}


def group(path) -> str:
  """A leaf's group: its module path (the tree path without the leaf's own name)."""
  keys = state_lib.path_keys(path)
  return "/".join(keys[:-1]) or keys[-1]


def _groups(tree) -> dict[str, list[np.ndarray]]:
  out: dict[str, list[np.ndarray]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out.setdefault(group(path), []).append(np.asarray(leaf, np.float64))
  return out


def _norm(leaves) -> float:
  return float(np.sqrt(sum(np.sum(x * x) for x in leaves)))


def _worst_element(a, b) -> float:
  return max(float(np.max(np.abs(x - y) / (np.abs(y) + 1e-12))) for x, y in zip(a, b, strict=True))


def compare(mesh_tree, one_tree, base_tree=None) -> dict[str, tuple[float, float]]:
  """Per group: (|mesh - one| / |one - base or one|, worst element's relative difference)."""
  mesh_g, one_g = _groups(mesh_tree), _groups(one_tree)
  base_g = _groups(base_tree) if base_tree is not None else None
  out = {}
  for name, one in one_g.items():
    diff = _norm([m - o for m, o in zip(mesh_g[name], one, strict=True)])
    scale = _norm([o - b for o, b in zip(one, base_g[name], strict=True)]) if base_g else _norm(one)
    out[name] = (diff / max(scale, 1e-30), _worst_element(mesh_g[name], one))
  return out
