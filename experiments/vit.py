"""Image classification with a small Vision Transformer (model/vit.py) on oriented gratings in noise
(data/images.py): a procedurally generated, deterministic, learnable image set.

The loss is the summed cross-entropy over valid images and the count of valid images; accuracy is a
count-weighted metric (its sum). Dropout is on in training and draws per-example bits from the keys
the trainer passes, so the trajectory is the same on any mesh and process count.
The experiment contract this module fulfils is in experiments/__init__.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from data import images
from data.sources import DataSources, recipe_fingerprint
from errors import UserError
from model.vit import ViT
from trainer.experiment import Experiment
from trainer.observe.fields import Field

UNIT = "images"
# The ViT's own logical axes, all replicated: pixels of a patch, patch positions, classes.
LOGICAL_AXES = {"pixels": None, "patches": None, "classes": None}


def check_config(config) -> None:
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


EXPERIMENT = Experiment(
  UNIT=UNIT,
  LOGICAL_AXES=LOGICAL_AXES,
  check_config=check_config,
  build_model=build_model,
  data_sources=data_sources,
  loss_sums=loss_sums,
  METRICS=(Field("accuracy", "The share of valid images classified correctly."),),
)
