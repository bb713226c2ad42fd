"""This process's shards of a train state, to and from host memory, for the local and peer tiers
(trainer/checkpoint/local.py): a device copy the next step does not donate, the distinct shards as
numpy arrays keyed by their index, and the state rebuilt from them under the same layout."""

import jax
import jax.numpy as jnp
import numpy as np

from trainer.state import path_keys


def _index_key(index, shape) -> tuple:
  return tuple((s.start or 0, shape[i] if s.stop is None else s.stop) for i, s in enumerate(index))


def host_copy(state, chunk_bytes: float = float("inf"), before_chunk=lambda: None) -> dict:
  """{leaf path: {index: numpy array}}: this process's distinct shards, copied now (blocking). Their
  transfers start `chunk_bytes` at a time, each chunk once `before_chunk` returns and in host memory
  before the next one starts: the local tier paces them by the loop's steps (trainer/checkpoint/local.py)."""
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  out, distinct = {}, []  # Replicas of a shard (data parallelism) are transferred once.
  for path, leaf in leaves:
    shards = out["/".join(path_keys(path))] = {}
    for shard in leaf.addressable_shards:
      key = _index_key(shard.index, leaf.shape)
      if key not in shards:
        shards[key] = None
        distinct.append((shards, key, shard.data))
  i = 0
  while i < len(distinct):
    before_chunk()
    j, size = i, 0
    while j < len(distinct) and (j == i or size < chunk_bytes):
      distinct[j][2].copy_to_host_async()
      size, j = size + distinct[j][2].nbytes, j + 1
    for shards, key, data in distinct[i:j]:
      shards[key] = np.asarray(data)
    i = j
  return out


@jax.jit
def device_copy(state):
  """A second copy of `state` on the same devices and shardings (XLA keeps an explicit copy)."""
  return jax.tree.map(jnp.copy, state)


def pinned_copy(state):
  """A copy of `state` in its devices' pinned host memory (dispatched, not waited for): no device memory,
  but the next step, which donates `state`, waits until the transfers have read it."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), state)


def to_state(saved: dict, target):
  """`target` (abstract, with shardings) filled from `saved` shards; KeyError if a shard is missing."""

  def build(path, abstract):
    shards = saved["/".join(path_keys(path))]
    devices = abstract.sharding.addressable_devices_indices_map(abstract.shape)
    arrays = [
      jax.device_put(shards[_index_key(index, abstract.shape)].astype(abstract.dtype), device)
      for device, index in devices.items()
    ]
    return jax.make_array_from_single_device_arrays(abstract.shape, abstract.sharding, arrays)

  return jax.tree_util.tree_map_with_path(build, target)


def state_bytes(target) -> int:
  """Bytes of this process's distinct shards of `target` (abstract arrays with shardings)."""
  total = 0
  for leaf in jax.tree.leaves(target):
    indices = {
      _index_key(i, leaf.shape) for i in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
    }
    total += (
      len(indices) * int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * np.dtype(leaf.dtype).itemsize
    )
  return total
