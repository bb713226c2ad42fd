"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE (Llama 3's scaling optional), SwiGLU, causal
grouped-query attention (Qwen3's per-head q/k RMSNorm optional), tied or untied embeddings; its blocks
unrolled or scanned, each rematerialized by a named policy or not; with `moe`, the MLP of every block
after the first `first_dense` is a mixture of experts (model/moe.py). Hugging Face's Llama and Qwen3
map onto it one to one (model/hf_llama.py), and so do Mixtral and Qwen3-MoE (model/hf_moe.py).

Every parameter carries logical axis names; activations are constrained where it matters.
Shapes: B batch, L sequence, D embed, H heads, K head dim, F mlp, V vocab.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from model import context
from model import moe as moe_lib
from model.layers import Attention, RMSNorm, RopeScaling, SwiGLU, implementation, param
from model.partitioning import constrain

_init = nnx.initializers
_policies = jax.checkpoint_policies
# What the backward pass keeps of a block's forward pass ('none': everything, no recomputation).
REMAT = {
  "none": None,
  "full": _policies.nothing_saveable,  # Only the block's input: the least memory, one more forward.
  "dots": _policies.dots_saveable,  # Every matmul's output; recomputes only the cheap elementwise ops.
  "dots_no_batch": _policies.dots_with_no_batch_dims_saveable,  # The weight matmuls, not attention's.
  "block_outputs": _policies.save_only_these_names("attn_out", "mlp_out"),  # The two residual branches.
}


class Block(nnx.Module):
  """Attention and an MLP, each a residual branch; the MLP a mixture of experts when `moe` (MoE's
  keyword arguments) is given. Returns the new stream and the MoE layer's auxiliary sums (or None)."""

  def __init__(self, dim, num_heads, mlp_dim, rope_base, *, norm_eps, rngs, moe=None, **attention):
    self.attn_norm = RMSNorm(dim, eps=norm_eps, rngs=rngs)
    self.attn = Attention(dim, num_heads, rope_base, norm_eps=norm_eps, rngs=rngs, **attention)
    self.mlp_norm = RMSNorm(dim, eps=norm_eps, rngs=rngs)
    self.mlp = moe_lib.MoE(dim, rngs=rngs, **moe) if moe else SwiGLU(dim, mlp_dim, rngs=rngs)

  def __call__(self, x, positions, mask, token_mask=None, segment_ids=None):
    attn = self.attn(self.attn_norm(x), positions, mask, causal=True, segment_ids=segment_ids)
    x = x + checkpoint_name(attn, "attn_out")
    aux = None
    if isinstance(self.mlp, moe_lib.MoE):
      y, aux = self.mlp(self.mlp_norm(x), token_mask)
    else:
      y = self.mlp(self.mlp_norm(x))
    x = x + checkpoint_name(y, "mlp_out")
    return constrain(x, ("batch", "act_seq", "act_embed")), aux


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """What a Decoder is: the model.* keys of a config, built once (experiments/lm.py decoder_config), and
  checked here alone. `head_dim` 0 means embed_dim / num_heads; after construction it is the real one."""

  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  rope_base: float
  compute_dtype: str
  num_kv_heads: int = 0  # 0: one per query head.
  head_dim: int = 0
  norm_eps: float = 1e-6
  rope_scaling: RopeScaling | None = None
  attention: str = "einsum"
  context_attention: str = "ring"
  attention_block: int = 0
  qk_norm: bool = False
  scan_layers: bool = False
  remat: str = "none"
  tie_embeddings: bool = False
  scale_tied_embeddings: bool = True
  z_loss: float = 0.0  # How its loss is taken (model/losses.py): z-loss weight, positions per chunk.
  loss_chunk: int = 0
  moe: dict | None = None  # model/moe.MoE's keyword arguments: the blocks after `first_dense` route.
  first_dense: int = 0
  balance_loss: float = 0.0  # The MoE auxiliary losses' weights, per token and MoE layer.
  router_z_loss: float = 0.0

  def __post_init__(self):
    if not self.head_dim and (self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 2):
      raise ValueError(
        f"embed_dim={self.embed_dim} must be a multiple of num_heads={self.num_heads} with an even head "
        "dimension (RoPE rotates pairs), or set head_dim"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
    if self.num_kv_heads and self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} (each key/value head "
        "serves a group of query heads), or be 0 for one per query head"
      )
    if self.remat not in REMAT:
      raise ValueError(f"remat={self.remat!r}: use one of {sorted(REMAT)}")
    object.__setattr__(self, "head_dim", self.head_dim or self.embed_dim // self.num_heads)


class Decoder(nnx.Module):
  """Tokens [B, L] -> logits [B, L, V] in float32 (`hidden`, then `logits`, for a loss taken in chunks)."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    c = config
    vocab_size, embed_dim, num_layers, norm_eps = c.vocab_size, c.embed_dim, c.num_layers, c.norm_eps
    moe, first_dense, tie_embeddings = c.moe, c.first_dense, c.tie_embeddings
    block_args = (embed_dim, c.num_heads, c.mlp_dim, c.rope_base)
    block_kwargs = dict(
      norm_eps=norm_eps,
      num_kv_heads=c.num_kv_heads,
      head_dim=c.head_dim,
      rope_scaling=c.rope_scaling,
      impl=c.attention,
      qk_norm=c.qk_norm,
      context_attention=c.context_attention,
      block=c.attention_block,
    )
    # Tied: the table also unembeds, so it starts small (1/sqrt(D)), and lookups are scaled back up;
    # Llama's tied table (scale_tied_embeddings=False) is looked up as it is.
    self.scale_embed = tie_embeddings and c.scale_tied_embeddings
    table_init = _init.normal(1.0 / math.sqrt(embed_dim) if tie_embeddings else 1.0)
    # One axis only on the table: a lookup into a table sharded on both axes rematerializes it.
    self.embed = param(rngs, table_init, (vocab_size, embed_dim), ("vocab", None))
    # With `moe` (model/moe.MoE's keyword arguments), the blocks after the first `first_dense` route.
    kinds = [None] * num_layers if not moe else [None] * first_dense + [moe] * (num_layers - first_dense)
    if c.scan_layers:
      # Blocks whose parameters are stacked [n, ...] along a leading `layers` axis: `layers` holds the
      # routed (or all) blocks, `dense_layers` the dense ones that come first in a mixture of experts.
      def stack(n, moe_args):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked(rngs):
          return Block(*block_args, rngs=rngs, moe=moe_args, **block_kwargs)

        return stacked(rngs)

      if moe and first_dense:
        self.dense_layers = stack(first_dense, None)
      self.layers = stack(kinds.count(kinds[-1]), kinds[-1])
    else:
      self.blocks = nnx.List([Block(*block_args, rngs=rngs, moe=kind, **block_kwargs) for kind in kinds])
    self.num_experts = moe["num_experts"] if moe else 0
    # The MoE auxiliary losses' weights (experiments/lm.py moe_sums), taken per token and MoE layer.
    self.moe_layers = kinds.count(moe) if moe else 0
    self.balance_loss, self.router_z_loss = c.balance_loss, c.router_z_loss
    self.final_norm = RMSNorm(embed_dim, eps=norm_eps, rngs=rngs)
    if not tie_embeddings:
      self.unembed = param(rngs, _init.lecun_normal(), (embed_dim, vocab_size), ("embed", "vocab"))
    self.compute_dtype = jnp.dtype(c.compute_dtype)
    self.attention = c.attention
    self.scan_layers, self.remat, self.tie_embeddings = c.scan_layers, c.remat, tie_embeddings
    self.z_loss, self.loss_chunk = c.z_loss, c.loss_chunk

  def __call__(self, tokens, positions=None, segment_ids=None):
    return self.logits(self.hidden(tokens, positions, segment_ids))

  def hidden(self, tokens, positions=None, segment_ids=None):
    """Tokens [B, L] -> the final normalized hidden states [B, L, D] in the compute dtype."""
    return self.hidden_and_aux(tokens, positions, segment_ids)[0]

  def hidden_and_aux(self, tokens, positions=None, segment_ids=None, token_mask=None):
    """Tokens [B, L] -> (hidden states [B, L, D], the MoE layers' auxiliary sums added up, model/moe.py,
    over the tokens of `token_mask` [B, L] (None: all); None without MoE layers)."""
    h, aux, order = self.hidden_aux_and_order(tokens, positions, segment_ids, token_mask)
    if order is not None:  # Back to the sequence's order: gathered over the context devices.
      h = constrain(jnp.take(h, np.argsort(order), axis=1), ("batch", "act_seq", "act_embed"))
    return h, aux

  def hidden_aux_and_order(self, tokens, positions=None, segment_ids=None, token_mask=None):
    """hidden_and_aux's states in the order the layers ran them, and that order: under a context axis
    the sequence balanced over its devices (`order`, [L] positions), else the sequence's own (None). A
    loss, a sum over positions, takes its targets in that order instead (jnp.take(targets, order,
    axis=1)): [B, L] ids cross the context devices, not the [B, L, D] states."""
    b, n = tokens.shape
    impl = implementation(self.attention, self.compute_dtype, length=n)
    blockwise = impl in ("flash", "splash")
    mask, order = None, None  # None: plain causal attention, which fused kernels do without a mask array.
    packed = positions is not None or segment_ids is not None
    positions = jnp.broadcast_to(jnp.arange(n), (b, n)) if positions is None else positions
    if blockwise:  # Masks per key/value block from positions and segment ids; the sequence balanced.
      segment_ids = jnp.zeros_like(positions) if segment_ids is None else segment_ids
      c = context.context_size()
      if c > 1:
        order = context.balanced_order(n, c)
        tokens, positions, segment_ids = (
          jnp.take(a, order, axis=1) for a in (tokens, positions, segment_ids)
        )
        token_mask = None if token_mask is None else jnp.take(token_mask, order, axis=1)
    elif packed:  # Attend only within the document: a [B, L, L] mask.
      mask = positions[:, :, None] >= positions[:, None, :]
      if segment_ids is not None:
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    x = constrain(self.embed_tokens(tokens), ("batch", "act_seq", "act_embed"))
    aux = moe_lib.zero_aux(self.num_experts) if self.num_experts else None

    def block_fn(block, carry):
      x, aux = carry
      x, block_aux = block(x, positions, mask, token_mask, segment_ids)
      return x, aux if block_aux is None else jax.tree.map(jnp.add, aux, block_aux)

    if self.remat != "none":
      block_fn = nnx.remat(block_fn, policy=REMAT[self.remat], prevent_cse=not self.scan_layers)
    if self.scan_layers:
      scan = nnx.scan(
        block_fn,
        in_axes=(0, nnx.Carry),
        out_axes=nnx.Carry,
        transform_metadata={nnx.PARTITION_NAME: "layers"},
      )
      for stack in (getattr(self, "dense_layers", None), self.layers):
        if stack is not None:
          x, aux = scan(stack, (x, aux))
    else:
      for block in self.blocks:
        x, aux = block_fn(block, (x, aux))
    return self.final_norm(x), aux, order

  def embed_tokens(self, tokens):
    """Tokens [B, L] -> embeddings [B, L, D] in the compute dtype (a tied table's scaled back up)."""
    x = jnp.take(self.embed[...], tokens, axis=0).astype(self.compute_dtype)
    return x * jnp.sqrt(jnp.asarray(x.shape[-1], x.dtype)) if self.scale_embed else x

  def logits(self, h):
    """Hidden states [..., D] -> float32 logits [..., V]."""
    w = self.embed[...].T if self.tie_embeddings else self.unembed[...]
    logits = (h @ w.astype(h.dtype)).astype(jnp.float32)
    return constrain(logits, ("batch", "act_seq", "act_vocab"))
