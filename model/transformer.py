"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, SwiGLU, causal attention, untied embeddings.

Every parameter carries logical axis names; activations are constrained where it matters.
Shapes: B batch, L sequence, D embed, H heads, K head dim, F mlp, V vocab.
"""

import jax.numpy as jnp
from flax import nnx

from model.layers import Attention, RMSNorm, SwiGLU, param
from model.partitioning import constrain

_init = nnx.initializers


class Block(nnx.Module):
  def __init__(self, dim, num_heads, mlp_dim, rope_base, num_kv_heads=0, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(dim, rngs=rngs)
    self.attn = Attention(dim, num_heads, rope_base, num_kv_heads=num_kv_heads, rngs=rngs)
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
    num_kv_heads: int = 0,
    rngs: nnx.Rngs,
  ):
    if embed_dim % num_heads or (embed_dim // num_heads) % 2:
      raise ValueError("embed_dim must be a multiple of num_heads with an even head_dim")
    # One axis only on the table: a lookup into a table sharded on both axes rematerializes it.
    self.embed = param(rngs, _init.normal(1.0), (vocab_size, embed_dim), ("vocab", None))
    self.blocks = nnx.List(
      [Block(embed_dim, num_heads, mlp_dim, rope_base, num_kv_heads, rngs=rngs) for _ in range(num_layers)]
    )
    self.final_norm = RMSNorm(embed_dim, rngs=rngs)
    self.unembed = param(rngs, _init.lecun_normal(), (embed_dim, vocab_size), ("embed", "vocab"))
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
