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


def _lib():
  """JAX's splash modules, imported where a kernel is built: every run imports this file (for `auto`'s
  rule) and most never call the kernel."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

  return kernel_lib, mask_lib


def supports(length: int) -> bool:
  """Whether the kernel takes sequences of `length`."""
  return length % LANE == 0


def block_sizes(length: int, block: int = MAX_BLOCK):
  """One tile size for every pass: the largest multiple of 128 dividing `length`, at most `block`."""
  b = max(d for d in range(LANE, min(length, block) + 1, LANE) if length % d == 0)
  return _lib()[0].BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    block_q_dq=b,
    block_kv_dq=b,
  )


def _kernel(heads: int, length: int, block: int, interpret: bool, causal=True, residuals=False):
  """The kernel for one example of `heads` query heads over `length` positions, causal or full (every
  key: a key chunk wholly before its query chunk); with `residuals` it returns (out, (lse,)). Built per
  call: its arrays belong to the trace (and mesh) that calls it; JAX caches the mask's tables by shape."""
  kernel_lib, mask_lib = _lib()
  shape = (length, length)
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask(shape) if causal else mask_lib.FullMask(shape)] * heads)
  return kernel_lib.make_splash_mha(
    mask,
    block_sizes=block_sizes(length, block),
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
    save_residuals=residuals,
  )


def _heads_first(q, k, v):
  """[b, L, heads, K] -> [b, heads, L, K] as the kernel takes them, q scaled by 1/sqrt(K)."""
  q = q * jnp.asarray(1.0 / q.shape[-1] ** 0.5, q.dtype)
  return tuple(jnp.swapaxes(x, 1, 2) for x in (q, k, v))


def _local(q, k, v, seg, block: int):
  """One device's examples: q [b, L, h, K], k, v [b, L, g, K], seg [b, L] -> [b, L, h, K]."""
  b, n, h, d = q.shape
  if not supports(n):
    raise ValueError(f"'splash' attention needs a sequence length that is a multiple of {LANE}: got {n}")
  kernel = _kernel(h, n, block, jax.default_backend() != "tpu")
  segments = _lib()[0].SegmentIds(q=seg, kv=seg)
  out = jax.vmap(kernel)(*_heads_first(q, k, v), segment_ids=segments)
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


def pair(q, k, v, q_seg, kv_seg, *, causal: bool, block: int = MAX_BLOCK):
  """One query chunk q [b, n, h, K] against one key/value chunk [b, n, g, K] (model/context.py's ring
  and all-gather): (out [b, n, h, K], lse [b, n, h]) in float32, for `flash.merge`. `causal`: the
  chunks are the same (causal by index), else every key comes first (full, within segments). Its
  backward pass takes the lse's cotangent only on rows that also have the output's, as the merges of
  model/context.py give them (a row's weight in a merge scales both)."""
  if not supports(q.shape[1]):
    raise ValueError(f"'splash' attention needs chunks of a multiple of {LANE} tokens: got {q.shape[1]}")
  out, lse = _pair(*_heads_first(q, k, v), q_seg, kv_seg, causal, block)
  return jnp.swapaxes(out, 1, 2).astype(jnp.float32), jnp.swapaxes(lse, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _pair(q, k, v, q_seg, kv_seg, causal, block):
  return _pair_fwd(q, k, v, q_seg, kv_seg, causal, block)[0]


def _pair_fwd(q, k, v, q_seg, kv_seg, causal, block):
  b, h, n, _ = q.shape
  kernel = _kernel(h, n, block, jax.default_backend() != "tpu", causal, residuals=True)
  out, (lse,) = jax.vmap(kernel)(q, k, v, segment_ids=_lib()[0].SegmentIds(q=q_seg, kv=kv_seg))
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _pair_bwd(causal, block, residuals, cotangents):
  """The kernel's own backward pass (JAX's private _splash_attention_bwd, the same in JAX 0.10.2 and
  0.12.0.1), with the log-sum-exp's cotangent too: d lse / d s = p, so a score's gradient is
  p (dp - di + dlse), where the kernel computes di = rowsum(out * dout). Handing it `out` moved along
  dout by dlse / |dout|^2 makes that di - dlse."""
  q, k, v, q_seg, kv_seg, out, lse = residuals
  dout, dlse = cotangents
  do32 = dout.astype(jnp.float32)
  norm = jnp.sum(do32 * do32, axis=-1)
  shift = jnp.where(norm > 0, dlse / jnp.where(norm > 0, norm, 1.0), 0.0)
  moved = out.astype(jnp.float32) - shift[..., None] * do32
  b, h, n, _ = q.shape
  kernel = _kernel(h, n, block, jax.default_backend() != "tpu", causal)
  kernel_lib, options = _lib()[0], kernel.kwargs
  masks = [_collapsed(m) for m in (kernel.dq_mask_info, kernel.dkv_mask_info)]

  def one(q, k, v, q_seg, kv_seg, out, lse, dout):
    res = (q, k, v, kernel_lib.SegmentIds(q=q_seg, kv=kv_seg), None, out, lse, *masks)
    grads = kernel_lib._splash_attention_bwd(  # noqa: SLF001 - see the docstring.
      False,
      options["mask_value"],
      options["is_mqa"],
      options["block_sizes"],
      options["residual_checkpoint_name"],
      options["mask_function"],
      options["attn_logits_soft_cap"],
      options["interpret"],
      res,
      dout,
    )
    return grads[3:6]  # dq, dk, dv

  dq, dk, dv = jax.vmap(one)(q, k, v, q_seg, kv_seg, moved, lse, dout.astype(q.dtype))
  return dq, dk, dv, None, None


_pair.defvjp(_pair_fwd, _pair_bwd)


def _collapsed(info):
  """A mask's tables as the kernel's own entry point hands them on: partial blocks [n, block, block]."""
  if info is None or info.partial_mask_blocks is None:
    return info
  blocks = info.partial_mask_blocks
  return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))
