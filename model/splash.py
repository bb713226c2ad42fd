"""Causal attention within segments by the Pallas splash kernel that ships with JAX (TPUs; elsewhere
Pallas interpret mode, which is how CPU tests check it).

The kernel takes one example's [H, L, K] queries (pre-scaled by 1/sqrt(K)) and [G, L, K] keys and
values (grouped-query attention natively: H a multiple of G), a static causal mask per head, and
segment ids that keep packed documents apart; it is vmapped over the batch and, under a mesh, run per
device in a shard_map over the batch and heads axes (a Pallas call is not partitioned by XLA).

Its tile sizes decide its speed: the kernel's own default (128) is several times slower at L = 2048
than 512-tiles on the TPU v5e. `block_sizes` picks one from the sequence length, up to MAX_BLOCK
(benchmarks/attention_kernels.py measures the candidates).

Shapes: B batch, L sequence, H query heads, G key/value heads, K head dim.
"""

import functools

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec as P

from model.partitioning import logical_to_spec

# The kernel's tiles run on 128-lane vector units: sequences must be a multiple of this.
LANE = 128
# The tile (queries and keys, forward and backward) unless model.attention_block says: the largest
# multiple of 128 dividing L, up to this (the fastest of 256-2,048 at L = 2,048 on the TPU v5e:
# benchmarks/attention_kernels.py).
MAX_BLOCK = 1024
# 'auto' picks the kernel from this length on: below it the explicit einsum was faster on the TPU v5e
# (benchmarks/attention_kernels.py from 128 to 2,048 tokens).
MIN_LENGTH = 512


def supports(length: int) -> bool:
  """Whether the kernel takes sequences of `length`."""
  return length % LANE == 0


def block_sizes(length: int, block: int = MAX_BLOCK) -> "kernel_lib.BlockSizes":
  """One tile size for every pass: the largest multiple of 128 dividing `length`, at most `block`."""
  b = max(d for d in range(LANE, min(length, block) + 1, LANE) if length % d == 0)
  return kernel_lib.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    block_q_dq=b,
    block_kv_dq=b,
  )


def _kernel(heads: int, length: int, block: int, interpret: bool):
  """The kernel for one example of `heads` query heads over `length` positions. Built per call: its
  arrays belong to the trace (and mesh) that calls it; JAX caches the mask's tables by shape."""
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length)) for _ in range(heads)])
  return kernel_lib.make_splash_mha(
    mask,
    block_sizes=block_sizes(length, block),
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )


def _local(q, k, v, seg, block: int):
  """One device's examples: q [b, L, h, K], k, v [b, L, g, K], seg [b, L] -> [b, L, h, K]."""
  b, n, h, d = q.shape
  if not supports(n):
    raise ValueError(f"'splash' attention needs a sequence length that is a multiple of {LANE}: got {n}")
  kernel = _kernel(h, n, block, jax.default_backend() != "tpu")
  to_heads = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [b, L, h, K] -> [b, h, L, K]
  q = to_heads(q * jnp.asarray(1.0 / d**0.5, q.dtype))
  segments = kernel_lib.SegmentIds(q=seg, kv=seg)
  out = jax.vmap(kernel)(q, to_heads(k), to_heads(v), segment_ids=segments)
  return jnp.swapaxes(out, 1, 2)


def attention(q, k, v, segment_ids, *, block: int = MAX_BLOCK):
  """Causal attention of q [B, L, H, K] on k, v [B, L, G, K] within segments [B, L] int (the sequence
  in its own order: causal by position index). Returns [B, L, H, K] in q's dtype."""
  rules, mesh = spmd.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return _local(q, k, v, segment_ids, block)
  spec = logical_to_spec(("batch", "act_seq", "act_heads", "act_kv"), rules)
  return jax.shard_map(
    functools.partial(_local, block=block),
    mesh=mesh,
    in_specs=(spec, spec, spec, P(*spec[:2])),
    out_specs=spec,
    check_vma=False,
  )(q, k, v, segment_ids)
