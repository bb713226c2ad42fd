"""What the LM's step costs and how it computes, for the metrics and --mode=inspect (experiments/lm.py
re-exports these as its contract's names): its model FLOPs, the bytes a mixture of experts exchanges,
and the attention implementation a mesh compiles."""

import numpy as np

from model import flash, moe
from model.layers import implementation


def model_flops_per_example(config, param_count: int) -> float:
  """Forward and backward FLOPs of one sequence: 6 per matmul parameter per token, plus attention's
  scores and mixing, 12 x layers x attention width (heads x head_dim) x seq_len per token (PaLM's
  appendix B count: the full square, though causal kernels may skip half). The embedding lookup is
  no matmul; a tied table is still one, as the output projection. A mixture of experts counts the
  parameters a token uses: top_k of its experts (whatever the routing computes)."""
  m, seq = config.model, config.data.seq_len
  matmul_params = param_count - (0 if m.tie_embeddings else m.vocab_size * m.embed_dim)
  if m.moe.num_experts:
    expert = 3 * m.embed_dim * (m.moe.expert_dim or m.mlp_dim)
    idle = (m.num_layers - m.moe.first_dense) * (m.moe.num_experts - m.moe.top_k) * expert
    matmul_params -= idle
  width = m.num_heads * (m.head_dim or m.embed_dim // m.num_heads)
  return seq * (6 * matmul_params + 12 * m.num_layers * width * seq)


def inspect_notes(config, mesh_shape: dict) -> list[str]:
  """The attention implementation this mesh compiles, and how a split sequence is attended."""
  m, n, c = config.model, config.data.seq_len, mesh_shape.get("context", 1)
  impl = implementation(m.attention, m.compute_dtype, c, n)
  if impl != "flash":
    scores = "[B, H, L, L] scores" if impl in ("einsum", "xla") else "fused, no score array"
    return [f"attention: {impl} ({scores}, L = {n})"]
  chunk = n // (2 * c)
  tile = flash.block_size(chunk, m.attention_block or flash.default_block())
  how = f"context {c} by {m.context_attention}: " if c > 1 else "no context axis: "
  return [
    f"attention: flash (model/flash.py), {how}each device holds chunks of {chunk} tokens, early and "
    f"late; tiles of [{tile}, {tile}] scores, no [L, L] array (L = {n})"
  ]


def routed_bytes_per_example(config) -> float:
  """Bytes of one sequence's routed activations sent to the experts and back in one forward pass:
  capacity routing's buffers [experts, capacity, embed] per MoE layer, there and back (--mode=inspect
  holds the all-to-alls against it). 0 for dense models and routings without an exchange."""
  m = config.model
  if not m.moe.num_experts or m.moe.routing != "capacity":
    return 0.0
  c = moe.capacity(config.data.seq_len, m.moe.top_k, m.moe.num_experts, m.moe.capacity_factor)
  per_layer = m.moe.num_experts * c * m.embed_dim * np.dtype(m.compute_dtype).itemsize
  return 2.0 * (m.num_layers - m.moe.first_dense) * per_layer
