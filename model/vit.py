"""A small Vision Transformer in Flax NNX: patch embedding, learned positions, pre-norm encoder
blocks (bidirectional attention, SwiGLU), mean pooling and a classification head, with dropout.

Dropout draws its bits per example from the keys the trainer passes (uint32[B, 2]), so an example
gets the same mask on any mesh, process count or microbatch split. Shapes: B batch, N patches,
P pixels per patch, D embed, C classes.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import Attention, RMSNorm, SwiGLU, param
from model.partitioning import constrain

_init = nnx.initializers


def dropout(x, keys, rate: float, site: int):
  """Inverted dropout on x [B, ...] with per-example keys [B, 2]; identity when keys is None."""
  if keys is None or rate == 0.0:
    return x
  site_keys = jax.vmap(lambda k: jax.random.fold_in(k, site))(keys)
  keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(site_keys)
  return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def patchify(images, patch: int):
  """[B, H, W, Ch] -> [B, N, P] with N = (H/patch)(W/patch), P = patch * patch * Ch."""
  b, h, w, ch = images.shape
  x = images.reshape(b, h // patch, patch, w // patch, patch, ch)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * ch)


class EncoderBlock(nnx.Module):
  def __init__(self, dim, num_heads, mlp_dim, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(dim, rngs=rngs)
    self.attn = Attention(dim, num_heads, rngs=rngs)
    self.mlp_norm = RMSNorm(dim, rngs=rngs)
    self.mlp = SwiGLU(dim, mlp_dim, rngs=rngs)

  def __call__(self, x, keys, rate: float, site: int):
    x = x + dropout(self.attn(self.attn_norm(x)), keys, rate, site)
    x = x + dropout(self.mlp(self.mlp_norm(x)), keys, rate, site + 1)
    return constrain(x, ("batch", "act_seq", "act_embed"))


class ViT(nnx.Module):
  """Images [B, H, W, Ch] -> class logits [B, C] in float32."""

  def __init__(
    self,
    *,
    image_size: int,
    channels: int,
    patch_size: int,
    num_classes: int,
    embed_dim: int,
    num_layers: int,
    num_heads: int,
    mlp_dim: int,
    dropout: float,
    compute_dtype: str,
    rngs: nnx.Rngs,
  ):
    if image_size % patch_size:
      raise ValueError(f"image_size {image_size} must be a multiple of patch_size {patch_size}")
    if embed_dim % num_heads:
      raise ValueError("embed_dim must be a multiple of num_heads")
    patches, pixels = (image_size // patch_size) ** 2, patch_size * patch_size * channels
    self.patch_embed = param(rngs, _init.lecun_normal(), (pixels, embed_dim), ("pixels", "embed"))
    self.pos_embed = param(rngs, _init.normal(0.02), (patches, embed_dim), ("patches", "embed"))
    self.blocks = nnx.List(
      [EncoderBlock(embed_dim, num_heads, mlp_dim, rngs=rngs) for _ in range(num_layers)]
    )
    self.final_norm = RMSNorm(embed_dim, rngs=rngs)
    self.head = param(rngs, _init.lecun_normal(), (embed_dim, num_classes), ("embed", "classes"))
    self.patch_size, self.rate = patch_size, dropout
    self.compute_dtype = jnp.dtype(compute_dtype)

  def __call__(self, images, keys=None):
    """keys: uint32[B, 2] per-example dropout keys, or None (no dropout: evaluation)."""
    dt = self.compute_dtype
    x = patchify(images.astype(dt), self.patch_size) @ self.patch_embed[...].astype(dt)  # [B, N, D]
    x = x + self.pos_embed[...].astype(dt)
    x = dropout(constrain(x, ("batch", "act_seq", "act_embed")), keys, self.rate, 0)
    for i, block in enumerate(self.blocks):
      x = block(x, keys, self.rate, 1 + 2 * i)
    x = jnp.mean(self.final_norm(x), axis=1)  # [B, D]
    return (x @ self.head[...].astype(dt)).astype(jnp.float32)
