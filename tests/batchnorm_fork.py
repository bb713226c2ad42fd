"""A fork a researcher might write, for tests only: a small convnet with nnx.BatchNorm, written the
natural Flax way, on the ViT's gratings. Its first BatchNorm normalizes the raw pixels, so its running
statistics can be checked against the data's own (tests/test_model_state.py). Padding rows are masked
out of the batch statistics (`mask=`); in training the statistics couple the examples of the batch,
and the experiment says so (COUPLES_EXAMPLES). `install()` makes it the experiment `batchnorm`, with
the ViT's keys."""

import dataclasses
import sys

import jax.numpy as jnp
import optax
from flax import nnx

from experiments import vit, vit_keys

UNIT = "images"
LOGICAL_AXES = {}
COUPLES_EXAMPLES = True  # Batch statistics: an example's loss depends on the rest of its batch.
MOMENTUM = 0.8  # The running statistics' decay per step.
CHANNELS = 8


class ConvNet(nnx.Module):
  def __init__(self, num_classes: int, rngs: nnx.Rngs):
    self.pixel_norm = nnx.BatchNorm(1, momentum=MOMENTUM, rngs=rngs)
    self.conv = nnx.Conv(1, CHANNELS, (3, 3), rngs=rngs)
    self.norm = nnx.BatchNorm(CHANNELS, momentum=MOMENTUM, rngs=rngs)
    self.head = nnx.Linear(CHANNELS, num_classes, rngs=rngs)

  def __call__(self, images, valid, train: bool):
    # Statistics over valid rows only: a padding row's zeros are not data.
    mask = lambda x: jnp.broadcast_to(valid[:, None, None, None], x.shape)
    x = self.pixel_norm(images, use_running_average=not train, mask=mask(images))
    x = nnx.relu(self.conv(x))
    x = self.norm(x, use_running_average=not train, mask=mask(x))
    return self.head(x.mean(axis=(1, 2)))


def build_model(config, rngs: nnx.Rngs) -> ConvNet:
  return ConvNet(config.data.num_classes, rngs)


def loss_sums(model: ConvNet, batch, rng):
  """Summed cross-entropy over valid images, their count, and the number classified correctly. In
  training (rng given) BatchNorm uses and updates the batch statistics; in evaluation its running ones."""
  w = batch["weights"]
  logits = model(batch["images"], w > 0, train=rng is not None)
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
  correct = (jnp.argmax(logits, axis=-1) == batch["labels"]).astype(jnp.float32)
  return jnp.sum(xent * w), jnp.sum(w), {"accuracy": jnp.sum(correct * w)}


# The ViT's experiment (its keys, checks and data) with this model and loss.
EXPERIMENT = dataclasses.replace(
  vit.EXPERIMENT,
  UNIT=UNIT,
  LOGICAL_AXES=LOGICAL_AXES,
  build_model=build_model,
  loss_sums=loss_sums,
  COUPLES_EXAMPLES=COUPLES_EXAMPLES,
)


def install() -> None:
  """Registers this module as experiments.batchnorm (with experiments/vit_keys.py's keys)."""
  sys.modules["experiments.batchnorm"] = sys.modules[__name__]
  sys.modules["experiments.batchnorm_keys"] = vit_keys
