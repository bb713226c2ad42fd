"""Replicas that should be identical, checked: a host that computes wrong, not only one that dies.

Silent data corruption and non-deterministic kernels make copies of a replicated array drift apart
without any error. Every `checks.replica_every` steps, and before every checkpoint, each device
computes two cheap checksums of its copy of every leaf of the train state (params, optimizer state):
the wrapping sum of its bits, and of its bits times their position (which a swap changes). Devices
holding the same shard of a leaf (the data axis for FSDP, every device for DP) must agree; a device
whose copy differs from the majority is named with its process, and the run stops before saving,
so the newest checkpoint is the last good one.
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import exit_codes
from errors import UserError
from trainer import state as state_lib


class ReplicaMismatch(UserError):
  """Copies that must be equal differ: a device computed wrong. Not the user's mistake, and not
  restarted (exit_codes.py): the same host would compute wrong again."""

  exit_code = exit_codes.COMPUTED_WRONG_EXIT


def _bits(x):
  """The array's bits as uint32 (2-byte types widened, 8-byte types as pairs)."""
  if x.dtype.itemsize == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if x.dtype.itemsize == 2:
    return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  if x.dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: a trailing dimension of 2.


def _checksums(*blocks):
  """[1, leaves, 2] for this device's blocks: wrapping sums of the bits, plain and position-weighted."""
  rows = []
  for block in blocks:
    bits = _bits(block).reshape(-1)
    weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32)
    rows.append(jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)]))
  return jnp.stack(rows)[None]


@functools.lru_cache(maxsize=8)
def _program(mesh, specs: tuple):
  everything = P(tuple(mesh.axis_names))
  fn = jax.shard_map(
    lambda *blocks: _checksums(*blocks), mesh=mesh, in_specs=specs, out_specs=everything, check_vma=False
  )
  return jax.jit(fn, out_shardings=NamedSharding(mesh, everything))


def named_leaves(state) -> list[tuple[str, jax.Array]]:
  tree = {"params": state.params, "variables": state.variables, "opt_state": state.opt_state}
  tree["ema"] = state.ema
  return [
    ("/".join(state_lib.path_keys(p)), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def checksums(mesh, arrays) -> jax.Array:
  """[devices in mesh order, leaves, 2]: each device's checksums of its block of every array."""
  return _program(mesh, tuple(x.sharding.spec for x in arrays))(*arrays)


def check(state, mesh, step: int) -> None:
  """Raises ReplicaMismatch naming every device (and its process) whose copy of a leaf differs from
  the majority of the devices holding the same shard."""
  leaves = [(name, x) for name, x in named_leaves(state) if x.size]
  sums = np.asarray(multihost_utils.process_allgather(checksums(mesh, [x for _, x in leaves]), tiled=True))
  devices = list(mesh.devices.flat)  # Row k of `sums` is devices[k]'s (out_specs over every axis).
  bad: dict = collections.defaultdict(list)  # device -> [leaf names] it differs from the majority on
  split: list[str] = []  # Leaves whose copies disagree with no majority (e.g. two copies).
  for j, (name, x) in enumerate(leaves):
    holders = collections.defaultdict(list)  # shard index -> rows of the devices holding it
    index = x.sharding.devices_indices_map(x.shape)
    for k, d in enumerate(devices):
      holders[str(index[d])].append(k)
    for rows in holders.values():
      votes = collections.Counter(tuple(sums[k, j]) for k in rows)
      if len(votes) < 2:
        continue
      majority, count = votes.most_common(1)[0]
      if 2 * count <= len(rows):
        ids = ", ".join(f"{devices[k].id} (process {devices[k].process_index})" for k in rows)
        split.append(f"{name} on devices {ids}, no majority")
        continue
      for k in rows:
        if tuple(sums[k, j]) != majority:
          bad[devices[k]].append(name)
  if bad or split:
    compared = sum(1 for _, x in leaves if _has_copies(x))
    named = [
      f"device {d.id} (process {d.process_index}): {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
      for d, names in sorted(bad.items(), key=lambda kv: kv[0].id)
    ]
    raise ReplicaMismatch(
      f"step {step}: copies that must be identical differ: {'; '.join(named + split[:3])}. A device "
      f"computed wrong (memory or silent data corruption); nothing was saved after the last good check "
      f"of the {compared} of {len(leaves)} leaves that have copies: take that host out and resume"
    )


def _has_copies(x) -> bool:
  index = list(x.sharding.devices_indices_map(x.shape).values())
  return len({str(i) for i in index}) < len(index)


def perturb_one_copy(tree, device):
  """Tests only: the same tree with `device`'s copy of its first replicated leaf changed in one
  element, as silent corruption would leave it."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  for i, x in enumerate(leaves):
    index = x.sharding.devices_indices_map(x.shape)
    if device not in index or sum(1 for v in index.values() if v == index[device]) < 2:
      continue
    shards = []
    for shard in x.addressable_shards:
      data = shard.data
      if shard.device == device:
        data = data.at[(0,) * data.ndim].add(1.0)
      shards.append(data)
    leaves[i] = jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
    return jax.tree_util.tree_unflatten(treedef, leaves)
  raise ValueError(f"no leaf is replicated on {device}")
