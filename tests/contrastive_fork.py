"""A fork a researcher might write, for tests only: the ViT's encoder trained with a sigmoid loss over
every pair of images in the global batch (in-batch negatives; same orientation = positive pair), as
SigLIP does. Its loss couples the examples, and it says so (COUPLES_EXAMPLES). `install()` makes it
the experiment `contrastive`, with the ViT's keys."""

import dataclasses
import sys

import jax
import jax.numpy as jnp

from experiments import vit, vit_keys

UNIT = "pairs"
COUPLES_EXAMPLES = True
TEMPERATURE, BIAS = 10.0, -5.0


def loss_sums(model, batch, rng):
  """Summed pairwise sigmoid loss over pairs of distinct valid images, the number of such pairs, and
  the positive pairs among them: padding rows are in no pair, so they are never negatives."""
  z = model(batch["images"], rng)  # [B, D]: the ViT's last layer as the embedding.
  z = z / jnp.linalg.norm(z, axis=-1, keepdims=True)
  logits = TEMPERATURE * z @ z.T + BIAS  # [B, B]
  same = (batch["labels"][:, None] == batch["labels"][None, :]).astype(jnp.float32)
  w = batch["weights"]
  pairs = w[:, None] * w[None, :] * (1.0 - jnp.eye(w.shape[0]))
  loss = jax.nn.softplus(-(2.0 * same - 1.0) * logits)
  return jnp.sum(loss * pairs), jnp.sum(pairs), {"positives": jnp.sum(same * pairs)}


# The ViT's experiment with this loss, as a fork that changes only its loss writes it.
EXPERIMENT = dataclasses.replace(
  vit.EXPERIMENT, UNIT=UNIT, loss_sums=loss_sums, COUPLES_EXAMPLES=COUPLES_EXAMPLES
)


def install() -> None:
  """Registers this module as experiments.contrastive (with experiments/vit_keys.py's keys)."""
  sys.modules["experiments.contrastive"] = sys.modules[__name__]
  sys.modules["experiments.contrastive_keys"] = vit_keys
  assert vit.UNIT == "images"  # This fork counts pairs instead.
