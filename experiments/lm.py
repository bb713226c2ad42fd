"""Next-token language modelling with the Llama-style decoder.

An experiment module provides three things the trainer calls:
  build_model(config, rngs)   -> an NNX module
  loss_sums(model, batch)     -> (loss_sum, valid_count, {metric: sum}); never a local mean
  data_sources(config)        -> DataSources(train, eval, loss_floor)
Fork this file to train something else; keep the loss as sums over valid tokens.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from data.sources import DataSources, make_sources
from model.transformer import Decoder


def build_model(config, rngs: nnx.Rngs) -> Decoder:
  m = config.model
  return Decoder(
    vocab_size=m.vocab_size,
    embed_dim=m.embed_dim,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    mlp_dim=m.mlp_dim,
    rope_base=m.rope_base,
    compute_dtype=m.compute_dtype,
    rngs=rngs,
  )


def loss_sums(model: Decoder, batch: dict[str, jax.Array]):
  """Sum of next-token cross-entropy over valid tokens, the valid-token count, and metric sums."""
  logits = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))  # [B, L, V]
  w = batch["weights"]  # [B, L]; 0 for padding rows and padding tokens.
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, L]
  correct = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
  return jnp.sum(xent * w), jnp.sum(w), {"accuracy": jnp.sum(correct * w)}


def data_sources(config) -> DataSources:
  return make_sources(config)
