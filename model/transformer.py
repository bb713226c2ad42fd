"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, SwiGLU, causal attention, untied embeddings.

Every parameter carries logical axis names; activations are constrained where it matters.
Shapes: B batch, L sequence, D embed, H heads, K head dim, F mlp, V vocab.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.partitioning import constrain

_init = nnx.initializers


def _param(rngs, init, shape, axes):
  return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6):
    self.scale = _param(rngs, _init.ones, (dim,), ("norm",))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


def rope(x, positions, base: float):
  """Rotary embedding on [B, L, H, K] with positions [B, L]."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [K/2]
  angle = positions[..., None, None].astype(jnp.float32) * freq  # [B, L, 1, K/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, dim: int, num_heads: int, rope_base: float, *, rngs: nnx.Rngs):
    head_dim = dim // num_heads
    w = _init.lecun_normal(in_axis=0, out_axis=(1, 2))
    self.wq = _param(rngs, w, (dim, num_heads, head_dim), ("embed", "heads", "kv"))
    self.wk = _param(rngs, w, (dim, num_heads, head_dim), ("embed", "heads", "kv"))
    self.wv = _param(rngs, w, (dim, num_heads, head_dim), ("embed", "heads", "kv"))
    wo = _init.lecun_normal(in_axis=(0, 1), out_axis=2)
    self.wo = _param(rngs, wo, (num_heads, head_dim, dim), ("heads", "kv", "embed"))
    self.rope_base = rope_base

  def __call__(self, x, positions, mask):
    dt = x.dtype
    q = jnp.einsum("bld,dhk->blhk", x, self.wq[...].astype(dt))
    k = jnp.einsum("bld,dhk->blhk", x, self.wk[...].astype(dt))
    v = jnp.einsum("bld,dhk->blhk", x, self.wv[...].astype(dt))
    q = constrain(q, ("batch", "act_seq", "act_heads", "act_kv"))
    q, k = rope(q, positions, self.rope_base), rope(k, positions, self.rope_base)
    # Scores and softmax in float32 whatever the compute dtype: [B, H, L, L].
    scores = jnp.einsum("blhk,bmhk->bhlm", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bhlm,bmhk->blhk", probs, v)
    return jnp.einsum("blhk,hkd->bld", out, self.wo[...].astype(dt))


class SwiGLU(nnx.Module):
  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    w = _init.lecun_normal()
    self.gate = _param(rngs, w, (dim, hidden), ("embed", "mlp"))
    self.up = _param(rngs, w, (dim, hidden), ("embed", "mlp"))
    self.down = _param(rngs, w, (hidden, dim), ("mlp", "embed"))

  def __call__(self, x):
    dt = x.dtype
    h = jax.nn.silu(x @ self.gate[...].astype(dt)) * (x @ self.up[...].astype(dt))  # [B, L, F]
    h = constrain(h, ("batch", "act_seq", "act_mlp"))
    return h @ self.down[...].astype(dt)


class Block(nnx.Module):
  def __init__(self, dim, num_heads, mlp_dim, rope_base, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(dim, rngs=rngs)
    self.attn = Attention(dim, num_heads, rope_base, rngs=rngs)
    self.mlp_norm = RMSNorm(dim, rngs=rngs)
    self.mlp = SwiGLU(dim, mlp_dim, rngs=rngs)

  def __call__(self, x, positions, mask):
    x = x + self.attn(self.attn_norm(x), positions, mask)
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, ("batch", "act_seq", "act_embed"))


class Decoder(nnx.Module):
  """Tokens [B, L] -> logits [B, L, V] in float32."""

  def __init__(
    self,
    *,
    vocab_size: int,
    embed_dim: int,
    num_layers: int,
    num_heads: int,
    mlp_dim: int,
    rope_base: float,
    compute_dtype: str,
    rngs: nnx.Rngs,
  ):
    if embed_dim % num_heads or (embed_dim // num_heads) % 2:
      raise ValueError("embed_dim must be a multiple of num_heads with an even head_dim")
    # One axis only on the table: a lookup into a table sharded on both axes rematerializes it.
    self.embed = _param(rngs, _init.normal(1.0), (vocab_size, embed_dim), ("vocab", None))
    self.blocks = nnx.List(
      [Block(embed_dim, num_heads, mlp_dim, rope_base, rngs=rngs) for _ in range(num_layers)]
    )
    self.final_norm = RMSNorm(embed_dim, rngs=rngs)
    self.unembed = _param(rngs, _init.lecun_normal(), (embed_dim, vocab_size), ("embed", "vocab"))
    self.compute_dtype = jnp.dtype(compute_dtype)

  def __call__(self, tokens, positions=None, segment_ids=None):
    b, n = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    causal = positions[:, :, None] >= positions[:, None, :]  # [B, L, L]
    if segment_ids is not None:  # Packed sequences: attention never crosses documents.
      causal &= segment_ids[:, :, None] == segment_ids[:, None, :]
    x = jnp.take(self.embed[...], tokens, axis=0).astype(self.compute_dtype)
    x = constrain(x, ("batch", "act_seq", "act_embed"))
    for block in self.blocks:
      x = block(x, positions, causal)
    x = self.final_norm(x)
    logits = (x @ self.unembed[...].astype(x.dtype)).astype(jnp.float32)
    return constrain(logits, ("batch", "act_seq", "act_vocab"))
