"""Image classification with a small Vision Transformer (model/vit.py) on oriented gratings in noise
(data/images.py): a procedurally generated, deterministic, learnable image set.

The loss is the summed cross-entropy over valid images and the count of valid images; accuracy is a
count-weighted metric (its sum). Dropout is on in training and draws per-example bits from the keys
the trainer passes, so the trajectory is the same on any mesh and process count.
The experiment contract this module fulfils is in experiments/__init__.py.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from data import images
from data.sources import DataSources, recipe_fingerprint
from errors import UserError
from model.vit import ViT
from trainer import config_checks

UNIT = "images"
# The ViT's own logical axes, all replicated: pixels of a patch, patch positions, classes.
LOGICAL_AXES = {"pixels": None, "patches": None, "classes": None}
TINY = {
  "data.image_size": 8,
  "model.patch_size": 4,
  "model.embed_dim": 32,
  "model.num_layers": 1,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
}


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.data = ml_collections.ConfigDict()
  c.data.num_examples = 100_000  # Training images per epoch.
  c.data.eval_examples = 1_024  # Held-out images, from a disjoint random stream.
  c.data.image_size = 16  # Height and width in pixels (one channel).
  c.data.num_classes = 8  # Orientations, evenly spaced over 180 degrees.
  c.data.noise = 1.2  # Standard deviation of the pixel noise (the grating's amplitude is 1).
  c.model = ml_collections.ConfigDict()
  c.model.patch_size = 4  # Pixels per patch side; image_size must be a multiple.
  c.model.embed_dim = 64  # Width of the residual stream.
  c.model.num_layers = 2  # Encoder blocks.
  c.model.num_heads = 4  # Attention heads; embed_dim must be a multiple.
  c.model.mlp_dim = 128  # Hidden width of the SwiGLU MLP.
  c.model.dropout = 0.1  # Dropout rate after the embedding and each residual branch (training only).
  return c


# One rule per key of default_config() (tests/test_config_checks.py holds every experiment to it).
CONFIG_RULES = {
  "data.num_examples": config_checks.whole(0),
  "data.eval_examples": config_checks.whole(0),
  "data.image_size": config_checks.whole(1),
  "data.num_classes": config_checks.whole(2),
  "data.noise": config_checks.real(0.0),
  "model.patch_size": config_checks.whole(1),
  "model.embed_dim": config_checks.whole(1),
  "model.num_layers": config_checks.whole(1),
  "model.num_heads": config_checks.whole(1),
  "model.mlp_dim": config_checks.whole(1),
  "model.dropout": config_checks.real(0.0, 1.0, high_open=True),
}


def check_config(config) -> None:
  config_checks.check_rules(config, CONFIG_RULES)
  d, m = config.data, config.model
  if d.image_size % m.patch_size:
    raise UserError(f"data.image_size={d.image_size} must be a multiple of model.patch_size={m.patch_size}")
  if m.embed_dim % m.num_heads:
    raise UserError(f"model.embed_dim={m.embed_dim} must be a multiple of model.num_heads={m.num_heads}")


def build_model(config, rngs: nnx.Rngs) -> ViT:
  d, m = config.data, config.model
  return ViT(
    image_size=d.image_size,
    channels=1,
    patch_size=m.patch_size,
    num_classes=d.num_classes,
    embed_dim=m.embed_dim,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    mlp_dim=m.mlp_dim,
    dropout=m.dropout,
    compute_dtype=m.compute_dtype,
    rngs=rngs,
  )


def data_sources(config) -> DataSources:
  d = config.data
  make = lambda n, split: images.GratingSource(n, d.image_size, d.num_classes, d.noise, config.seed, split)
  recipe = ["gratings", d.num_examples, d.eval_examples, d.image_size, d.num_classes, d.noise, config.seed]
  return DataSources(
    train=make(d.num_examples, images.TRAIN),
    eval=make(d.eval_examples, images.EVAL),
    fingerprint=recipe_fingerprint("gratings", recipe),
    make_batch=make_batch,
  )


def make_batch(records, valid) -> dict[str, np.ndarray]:
  """images [rows, H, W, 1], labels [rows], weights [rows] (0 on padding rows)."""
  return {"images": records["image"], "labels": records["label"], "weights": valid.astype(np.float32)}


def loss_sums(model: ViT, batch: dict[str, jax.Array], rng):
  """Summed cross-entropy over valid images, their count, and the number classified correctly."""
  logits = model(batch["images"], rng)  # [B, C]; rng None (evaluation): no dropout.
  w = batch["weights"]  # [B]
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])  # [B]
  correct = (jnp.argmax(logits, axis=-1) == batch["labels"]).astype(jnp.float32)
  return jnp.sum(xent * w), jnp.sum(w), {"accuracy": jnp.sum(correct * w)}
