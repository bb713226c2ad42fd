"""Causal attention over a sequence split across the `context` mesh axis (context parallelism).

The rules map the activations' sequence axis (`act_seq`) onto mesh axes; their size c is the context
size. The sequence is cut into 2c chunks and device i holds chunks i and 2c-1-i (`balanced_order`:
the decoder permutes its tokens so, and back at the end), so under the causal mask every device has the
same work: a late chunk sees much, an early one little. Each device attends its two query chunks to
every key/value chunk not after them, with model/flash.py's blocks (or model/splash.py's kernel, whose
mask is static: causal for a chunk itself, full for one before), and combines the pieces by their
log-sum-exp; pairs that the causal order masks whole are skipped (`lax.cond`). Two strategies:
  ring        key/value chunks travel around the ring by `ppermute`, c - 1 hops: each device holds two
              chunks at a time (memory ~ L / c), and on GPUs the next hop overlaps the current pair.
  all_gather  every device gathers all keys and values once (memory ~ L for K and V, one collective
              per layer, less latency): pays while K/V are small next to activations (GQA, short L).
Flash's masks come from positions and segment ids, never from array indices, so packed documents and
RoPE stay correct under any order; splash's index order holds within a chunk, which is contiguous.

The same code runs without a context axis (c = 1: two chunks, no collective), inside a shard_map over
every mesh axis, so every device computes its own shard's blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd
from jax.sharding import PartitionSpec as P

from model import flash, splash
from model.partitioning import logical_to_spec, mesh_axes

STRATEGIES = ("ring", "all_gather")


def _split():
  """(rules, mesh, the mesh axes the sequence is split over, their size) as installed; outside a mesh
  with rules (None, None, (), 1)."""
  rules, mesh = spmd.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return None, None, (), 1
  axes = mesh_axes(logical_to_spec(("act_seq",), rules)[0])
  return rules, mesh, axes, int(np.prod([mesh.shape[a] for a in axes], dtype=int))


def context_size() -> int:
  """The number of devices the sequence is split over under the installed rules and mesh (1 outside)."""
  return _split()[3]


def balanced_order(length: int, c: int) -> np.ndarray:
  """Indices that reorder a sequence of `length` so that a contiguous split into c parts gives part i
  the chunks i and 2c-1-i of 2c (identity for c = 1)."""
  if length % (2 * c):
    raise ValueError(f"sequence length {length} must be a multiple of 2 x context ({2 * c})")
  chunks = np.arange(length).reshape(2 * c, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * c - 1 - i]]) for i in range(c)])


def _pair(q, qp, qs, q_id, kv, kv_id, block, kernel):
  """One query chunk against one key/value chunk: (out, lse), or nothing when the key chunk comes after
  the query chunk (the causal order masks it whole). 'splash' knows its mask statically: causal for the
  chunk itself, full (within segments) for a chunk wholly before."""
  k, v, kp, ks = kv

  def skip():
    b, n, h, d = q.shape
    return jnp.zeros((b, n, h, d), jnp.float32), jnp.full((b, n, h), flash.NEG, jnp.float32)

  if kernel == "splash":
    same = lambda: splash.pair(q, k, v, qs, ks, causal=True, block=block)  # noqa: E731
    before = lambda: splash.pair(q, k, v, qs, ks, causal=False, block=block)  # noqa: E731
    if isinstance(q_id, int) and isinstance(kv_id, int):
      return (skip, same, before)[(kv_id <= q_id) + (kv_id < q_id)]()
    return jax.lax.switch((kv_id <= q_id).astype(int) + (kv_id < q_id).astype(int), (skip, same, before))

  def attend():
    return flash.attend(q, k, v, qp, kp, qs, ks, block=block)

  if isinstance(q_id, int) and isinstance(kv_id, int):
    return attend() if kv_id <= q_id else skip()
  return jax.lax.cond(kv_id <= q_id, attend, skip)


def _local(q, k, v, pos, seg, *, axes, c, strategy, block, kernel):
  """Inside shard_map: this device's queries [b, L/c, H, K] against every key chunk. Hops are a scan:
  one compiled body whatever c (unrolled, c = 8 took a 2-step pulse's compile from 15 s to 120 s)."""
  i = jax.lax.axis_index(axes) if c > 1 else 0
  halves = lambda x: jnp.split(x, 2, axis=1)  # noqa: E731
  q_halves = list(zip(halves(q), halves(pos), halves(seg), (i, 2 * c - 1 - i), strict=True))

  def add(acc, kv, src):
    """acc (per query half: (out, lse), or None) merged with both halves of the key chunk from `src`."""
    acc = list(acc)
    for j, (kh, vh, ph, sh) in enumerate(zip(*map(halves, kv), strict=True)):
      kv_id = src if j == 0 else 2 * c - 1 - src
      for n, (qh, qph, qsh, q_id) in enumerate(q_halves):
        out, lse = _pair(qh, qph, qsh, q_id, (kh, vh, ph, sh), kv_id, block, kernel)
        acc[n] = (out, lse) if acc[n] is None else flash.merge(*acc[n], out, lse)
    return tuple(acc)

  kv = (k, v, pos, seg)
  if c == 1:
    acc = add((None, None), kv, 0)
  else:
    b, n, h, d = q.shape  # A scan's carry starts as "no key seen", which `merge` weighs 0 exactly.
    none = (jnp.zeros((b, n // 2, h, d), jnp.float32), jnp.full((b, n // 2, h), flash.NEG, jnp.float32))
    if strategy == "all_gather":
      gathered = [jax.lax.all_gather(x, axes, axis=0) for x in kv]  # [c, b, L/c, ...]
      acc, _ = jax.lax.scan(
        lambda acc, x: (add(acc, x[:4], x[4]), None), (none, none), (*gathered, jnp.arange(c))
      )
    else:

      def hop(carry, n):
        """Device i sends what it holds on to i + 1 while attending to it (chunks of i - n)."""
        kv, acc = carry
        ahead = [jax.lax.ppermute(x, axes, [(s, (s + 1) % c) for s in range(c)]) for x in kv]
        return (ahead, add(acc, kv, (i - n) % c)), None

      (kv, acc), _ = jax.lax.scan(hop, (list(kv), (none, none)), jnp.arange(c - 1))
      acc = add(acc, kv, (i - (c - 1)) % c)
  return jnp.concatenate([acc[0][0], acc[1][0]], axis=1).astype(q.dtype)


def attention(
  q, k, v, positions, segment_ids, *, strategy: str = "ring", block: int = flash.BLOCK, kernel: str = "flash"
):
  """Causal attention within segments of q [B, L, H, K] on k, v [B, L, G, K] held in `balanced_order`
  for the installed context size; positions and segment_ids [B, L] int. Returns [B, L, H, K]. Each
  pair of chunks by `kernel`: 'flash' (model/flash.py) or 'splash' (model/splash.py: chunks of a
  multiple of 128 tokens)."""
  if strategy not in STRATEGIES:
    raise ValueError(f"context attention {strategy!r}: use one of {STRATEGIES}")
  rules, mesh, axes, c = _split()
  options = dict(strategy=strategy, block=block, kernel=kernel)
  if mesh is None:
    return _local(q, k, v, positions, segment_ids, axes=(), c=1, **options)
  q_spec = logical_to_spec(("batch", "act_seq", "act_heads", "act_kv"), rules)
  row_spec = P(*q_spec[:2])

  def local(q, k, v, pos, seg):
    return _local(q, k, v, pos, seg, axes=axes, c=c, **options)

  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(q_spec, q_spec, q_spec, row_spec, row_spec),
    out_specs=q_spec,
    check_vma=False,
  )(q, k, v, positions, segment_ids)
