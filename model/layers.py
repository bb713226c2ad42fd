"""Layers the models share, in Flax NNX, each parameter with logical axis names: RMSNorm, RoPE (with
Llama 3's frequency scaling or without), multi-head attention (causal or not, with or without RoPE,
with or without Qwen3's RMSNorm of each query and key head; our einsums, our blockwise flash attention
(model/flash.py, split over the `context` axis by model/context.py) or jax.nn.dot_product_attention),
SwiGLU.

Shapes: B batch, L sequence, D embed, H heads, K head dim, F mlp.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import context, flash, splash
from model.partitioning import constrain

_init = nnx.initializers


def param(rngs, init, shape, axes):
  return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6):
    self.scale = param(rngs, _init.ones, (dim,), ("norm",))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


class RopeScaling(NamedTuple):
  """Llama 3's RoPE scaling (Hugging Face `rope_type: llama3`): frequencies whose wavelength exceeds
  original_max_len / low_freq_factor are divided by `factor`, those below original_max_len /
  high_freq_factor kept, and those between blended smoothly."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_len: int


def rope_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> np.ndarray:
  """float32[K/2]: the rotation frequency of each pair of dimensions, computed as transformers does
  (in float32, 1 / base^(2i/K)), so that positions rotate alike in both."""
  inv = 1.0 / (np.float32(base) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
  inv = inv.astype(np.float32)
  if scaling is None:
    return inv
  f, low, high, original = scaling
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > original / low, inv / f, inv)
  smooth = (original / wavelen - low) / (high - low)
  medium = (wavelen >= original / high) & (wavelen <= original / low)
  return np.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled).astype(np.float32)


def rope(x, positions, freq: np.ndarray):
  """Rotary embedding on [B, L, H, K] with positions [B, L] and `freq` [K/2] (rope_frequencies): the
  two halves of K are the pairs' two coordinates (Hugging Face's Llama layout)."""
  angle = positions[..., None, None].astype(jnp.float32) * jnp.asarray(freq)  # [B, L, 1, K/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# How attention is computed: 'einsum' (below, explicit: [B, H, L, L] scores), 'flash' (model/flash.py:
# key/value blocks, no [L, L] array; the only one that can split the sequence over the `context` axis),
# 'splash' (model/splash.py: JAX's Pallas kernel for TPUs, interpreted elsewhere), or
# jax.nn.dot_product_attention with XLA's implementation ('xla') or cuDNN's fused flash attention
# ('cudnn', GPUs only), or 'auto': the fastest correct one where the run is (`implementation`). All of
# them take scores and softmax in float32.
ATTENTION = ("einsum", "flash", "splash", "xla", "cudnn", "auto")


def implementation(impl: str, dtype, context_size: int | None = None, length: int | None = None) -> str:
  """The implementation `impl` compiles to for sequences of `length` (None: any the kernels take) split
  `context_size` ways (None: as the installed mesh and rules split it). 'auto': flash under a context
  axis; on TPUs splash from splash.MIN_LENGTH tokens on (a multiple of its tiles), else einsum; on GPUs
  cuDNN in bfloat16/float16, else XLA's; on CPUs einsum (XLA's and flash within a few percent of it on
  the smoke model: benchmarks/attention_kernels.py)."""
  if impl != "auto":
    return impl
  if (context.context_size() if context_size is None else context_size) > 1:
    return "flash"
  backend = jax.default_backend()
  if backend == "tpu":
    fits = length is None or (splash.supports(length) and length >= splash.MIN_LENGTH)
    return "splash" if fits else "einsum"
  if backend == "gpu":
    return "cudnn" if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"
  return "einsum"


class Attention(nnx.Module):
  """Multi-head attention; with `num_kv_heads` < `num_heads`, grouped-query attention: each group of
  num_heads / num_kv_heads query heads shares one key and value head (fewer K/V weights and cache).
  With `qk_norm`, each query and key head is RMS-normalized over its head_dim before RoPE, one learned
  scale [K] for all query heads and one for all key heads (Qwen3's q_norm and k_norm)."""

  def __init__(
    self,
    dim: int,
    num_heads: int,
    rope_base: float = 10_000.0,
    *,
    num_kv_heads: int = 0,
    head_dim: int = 0,
    rope_scaling: RopeScaling | None = None,
    impl: str = "einsum",
    qk_norm: bool = False,
    norm_eps: float = 1e-6,
    context_attention: str = "ring",
    block: int = 0,
    rngs: nnx.Rngs,
  ):
    head_dim, kv_heads = head_dim or dim // num_heads, num_kv_heads or num_heads
    if num_heads % kv_heads:
      raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={kv_heads}")
    if impl not in ATTENTION:
      raise ValueError(f"attention {impl!r}: use one of {ATTENTION}")
    w = _init.lecun_normal(in_axis=0, out_axis=(1, 2))
    self.wq = param(rngs, w, (dim, num_heads, head_dim), ("embed", "heads", "kv"))
    self.wk = param(rngs, w, (dim, kv_heads, head_dim), ("embed", "heads", "kv"))
    self.wv = param(rngs, w, (dim, kv_heads, head_dim), ("embed", "heads", "kv"))
    wo = _init.lecun_normal(in_axis=(0, 1), out_axis=2)
    self.wo = param(rngs, wo, (num_heads, head_dim, dim), ("heads", "kv", "embed"))
    if qk_norm:
      self.q_norm = RMSNorm(head_dim, eps=norm_eps, rngs=rngs)
      self.k_norm = RMSNorm(head_dim, eps=norm_eps, rngs=rngs)
    self.qk_norm = qk_norm
    self.rope_base, self.rope_scaling = rope_base, rope_scaling
    if context_attention not in context.STRATEGIES:
      raise ValueError(f"context attention {context_attention!r}: use one of {context.STRATEGIES}")
    self.impl, self.context_attention, self.block = impl, context_attention, block

  def __call__(self, x, positions=None, mask=None, causal=False, segment_ids=None):
    """x [B, L, D]; positions [B, L] for RoPE (None: no RoPE); mask [B, L, L] (None: attend to all,
    or with `causal` to every earlier position). 'flash' takes no mask: it is causal within
    `segment_ids` [B, L] by `positions`, and the sequence is in context.balanced_order."""
    dt = x.dtype
    q = jnp.einsum("bld,dhk->blhk", x, self.wq[...].astype(dt))
    k = jnp.einsum("bld,dgk->blgk", x, self.wk[...].astype(dt))
    v = jnp.einsum("bld,dgk->blgk", x, self.wv[...].astype(dt))
    q = constrain(q, ("batch", "act_seq", "act_heads", "act_kv"))
    if self.qk_norm:  # [B, L, H, K], normalized over K.
      q, k = self.q_norm(q), self.k_norm(k)
    if positions is not None:
      freq = rope_frequencies(q.shape[-1], self.rope_base, self.rope_scaling)
      q, k = rope(q, positions, freq), rope(k, positions, freq)
    impl = implementation(self.impl, dt, length=q.shape[1])
    if self.impl == "auto" and not causal and impl in ("flash", "splash"):  # Both kernels are causal.
      impl = "einsum"
    split = context.context_size() > 1
    if split and impl not in ("flash", "splash"):
      raise ValueError(f"attention {impl!r} cannot split the sequence over the context axis: use 'flash'")
    if impl == "flash" or split:  # Chunks of the sequence, merged by their log-sum-exp.
      if not causal or positions is None:
        raise ValueError(f"{impl!r} attention over a context axis is causal and needs positions")
      seg = jnp.zeros_like(positions) if segment_ids is None else segment_ids
      block = self.block or (splash.MAX_BLOCK if impl == "splash" else flash.default_block())
      out = context.attention(
        q, k, v, positions, seg, strategy=self.context_attention, block=block, kernel=impl
      )
      return jnp.einsum("blhk,hkd->bld", out, self.wo[...].astype(dt))
    if impl == "splash":
      if not causal or mask is not None and segment_ids is None:
        raise ValueError("'splash' attention is causal within segment_ids; it takes no mask array")
      seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids
      out = splash.attention(q, k, v, seg, block=self.block or splash.MAX_BLOCK)
      return jnp.einsum("blhk,hkd->bld", out, self.wo[...].astype(dt))
    if impl != "einsum":
      out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=None if mask is None else mask[:, None],
        is_causal=causal,  # With a mask too: cuDNN then skips the blocks above the diagonal.
        implementation=impl,
      )
      return jnp.einsum("blhk,hkd->bld", out, self.wo[...].astype(dt))
    b, n, h, d = q.shape
    if causal and mask is None:
      mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    g = k.shape[2]
    q = q.reshape(b, n, g, h // g, d)  # Query head i belongs to key/value group i // (h / g).
    # Scores and softmax in float32 whatever the compute dtype: [B, G, H/G, L, L].
    # preferred_element_type: the products accumulate and come out in float32, never rounded to bf16.
    scores = jnp.einsum("blgrk,bmgk->bgrlm", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    if mask is not None:
      scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bgrlm,bmgk->blgrk", probs, v).reshape(b, n, h, d)
    return jnp.einsum("blhk,hkd->bld", out, self.wo[...].astype(dt))


class SwiGLU(nnx.Module):
  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    w = _init.lecun_normal()
    self.gate = param(rngs, w, (dim, hidden), ("embed", "mlp"))
    self.up = param(rngs, w, (dim, hidden), ("embed", "mlp"))
    self.down = param(rngs, w, (hidden, dim), ("mlp", "embed"))

  def __call__(self, x):
    dt = x.dtype
    h = jax.nn.silu(x @ self.gate[...].astype(dt)) * (x @ self.up[...].astype(dt))  # [B, L, F]
    h = constrain(h, ("batch", "act_seq", "act_mlp"))
    return h @ self.down[...].astype(dt)
