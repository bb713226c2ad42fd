"""Each device holds exactly the shard of every parameter and optimizer-state leaf that the
logical rules of the chosen strategy assign to it (read back from addressable_shards)."""

import math

import jax
import numpy as np
import pytest

from tests.conftest import tiny_config
from trainer import components

# The placement each strategy promises, written out independently of trainer/sharding.py.
WEIGHT_AXES = {
  "dp": {},
  "zero1": {},
  "fsdp": {"embed": ("fsdp",)},
  "fsdp_tp": {"embed": ("fsdp",), "mlp": ("tensor",), "heads": ("tensor",), "vocab": ("tensor",)},
}


def _expected_index(device, mesh, shape, dim_axes):
  """The slice of each dimension that `device` must hold, from its coordinates in the mesh."""
  coords = dict(zip(mesh.axis_names, np.argwhere(mesh.devices == device)[0], strict=True))
  index = []
  for size, axes in zip(shape, dim_axes, strict=True):
    ways = math.prod(mesh.shape[a] for a in axes)
    k = 0
    for a in axes:  # Row-major over the listed mesh axes.
      k = k * mesh.shape[a] + int(coords[a])
    index.append((k * size // ways, (k + 1) * size // ways))
  return tuple(index)


def _actual_index(shard, shape):
  return tuple(
    (s.start or 0, size if s.stop is None else s.stop) for s, size in zip(shard.index, shape, strict=True)
  )


def _zero1_axes(shape, ways):
  """ZeRO-1: the largest dimension divisible by the batch ways is split over (data, fsdp)."""
  free = [i for i, d in enumerate(shape) if ways > 1 and d % ways == 0]
  axes = [()] * len(shape)
  if free:
    axes[max(free, key=lambda i: shape[i])] = ("data", "fsdp")
  return axes


def _large_over_fsdp(shape, axes, mesh, min_size, logical):
  """FSDP: a leaf of min_size elements or more per layer not split over fsdp gets fsdp added to its
  largest dimension whose size the dimension's ways times fsdp divide, never the stacked `layers` one."""
  ways = mesh.shape["fsdp"]
  per_layer = math.prod(d for d, name in zip(shape, logical, strict=True) if name != "layers")
  if ways == 1 or per_layer < min_size or any("fsdp" in a for a in axes):
    return axes
  fits = [
    i
    for i, d in enumerate(shape)
    if d % (math.prod(mesh.shape[a] for a in axes[i]) * ways) == 0 and logical[i] != "layers"
  ]
  if fits:
    axes = list(axes)
    i = max(fits, key=lambda i: shape[i])
    axes[i] = (*axes[i], "fsdp")
  return axes


# The tiny model's largest leaves have 2,048 elements: 1,024 brings the large-leaf rule in. Scanned,
# 64 layers stacked: `layers` is the largest dimension of each stacked leaf and never split, and the norm
# scales [64, 32] (2,048 elements, 32 per layer, under 64) stay replicated.
@pytest.mark.parametrize(
  "strategy, min_size, scan",
  [
    ("dp", 2**14, False),
    ("zero1", 2**14, False),
    ("fsdp", 2**14, False),
    ("fsdp_tp", 2**14, False),
    ("fsdp", 1024, False),
    ("fsdp_tp", 1024, False),
    ("fsdp", 64, True),
  ],
)
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 4, 2)])
def test_every_leaf_lives_where_the_rules_say(strategy, min_size, scan, mesh_shape):
  data, fsdp, tensor = mesh_shape
  cfg = tiny_config(
    **{
      "sharding.strategy": strategy,
      "sharding.fsdp_min_size": min_size,
      "mesh.data": data,
      "mesh.fsdp": fsdp,
      "mesh.tensor": tensor,
      **({"model.scan_layers": True, "model.num_layers": 64} if scan else {}),
    }
  )
  comp = components.build(cfg)
  state = components.fresh_state(comp, cfg)
  mesh, table = comp.mesh, WEIGHT_AXES[strategy]
  names = jax.tree.leaves(
    comp.mdef.logical_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
  )
  params = jax.tree.leaves(state.params)
  adam = state.opt_state[1][0]  # chain(clip, adamw): adamw's ScaleByAdamState.
  checked = 0
  for logical, param, mu, nu in zip(
    names, params, jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), strict=True
  ):
    param_axes = [table.get(n, ()) if n else () for n in logical]
    if strategy in ("fsdp", "fsdp_tp"):
      param_axes = _large_over_fsdp(param.shape, param_axes, mesh, min_size, logical)
    if strategy == "zero1":
      opt_axes = _zero1_axes(param.shape, mesh.shape["data"] * mesh.shape["fsdp"])
    else:
      opt_axes = param_axes
    for leaf, axes in ((param, param_axes), (mu, opt_axes), (nu, opt_axes)):
      assert len(leaf.addressable_shards) == mesh.size
      for shard in leaf.addressable_shards:
        assert _actual_index(shard, leaf.shape) == _expected_index(shard.device, mesh, leaf.shape, axes)
        checked += 1
  assert checked == 3 * len(params) * mesh.size
  if strategy != "dp":  # Something really is split (not everything replicated).
    assert any(len({str(s.index) for s in x.addressable_shards}) > 1 for x in jax.tree.leaves(adam.mu))


def test_a_dimension_its_mesh_axes_do_not_divide_is_one_error_naming_the_parameter():
  from errors import UserError

  # fsdp_tp splits heads over tensor=2; one key/value head cannot be split.
  cfg = tiny_config(**{"model.num_heads": 4, "model.num_kv_heads": 1})
  with pytest.raises(UserError, match=r"parameter blocks/0/attn/wk has a dimension of 1, .*\('tensor',\)"):
    components.build(cfg)


def test_a_rule_for_a_name_nothing_knows_is_an_error_naming_the_closest_one_the_model_lacks_a_warning(capsys):
  """A misspelt 'exprt' for the router fork's 'expert' would leave the router unsplit, silently; `layers` is a
  preset's name, but this model (unscanned) has no such dimension."""
  from errors import UserError
  from tests import router_aux_fork

  router_aux_fork.install()
  cfg = tiny_config(**{"sharding.rules": (("exprt", "tensor"),)})
  cfg.unlock()
  cfg.experiment = "routed"
  cfg.lock()
  with pytest.raises(
    UserError, match=r"sharding.rules: 'exprt' is no logical axis name .* did you mean 'expert'\?"
  ):
    components.build(cfg, with_data=False)
  cfg.sharding.rules = (("expert", "tensor"), ("layers", None))
  comp = components.build(cfg, with_data=False)
  assert comp.shardings.params["router"]["kernel"].spec[1] == "tensor"
  out = capsys.readouterr().out
  assert "warning: sharding.rules: no parameter or variable of this model has a 'layers' dimension" in out, (
    out
  )
  assert "'expert'" not in out
