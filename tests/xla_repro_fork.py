"""A fork for tests only: the smallest model XLA's SPMD partitioner gets wrong that we know of. Two
consecutive matrices, the first sharded (., tensor) and the second (fsdp, tensor), on the (2,2,2) mesh
with the batch over (data, fsdp): the first matrix's gradient is about 80% off on jax 0.12.0.1 (a
missing all-reduce; the same class as openxla/xla issue 40034). `install()` makes it the experiment
`xla_repro`, with the LM's keys (unused)."""

import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.sources import DataSources, recipe_fingerprint
from experiments import lm_keys
from trainer.experiment import Experiment

UNIT = "examples"
LOGICAL_AXES = {"inputs": None}
WIDTH, HIDDEN = 8, 16


class TwoMatrices(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.normal(1.0)
    self.w1 = nnx.Param(init(rngs.params(), (WIDTH, HIDDEN)), out_sharding=("inputs", "mlp"))  # (., tensor)
    self.w2 = nnx.Param(init(rngs.params(), (HIDDEN, WIDTH)), out_sharding=("embed", "mlp"))  # (fsdp, tensor)

  def __call__(self, x):
    return jnp.tanh(x @ self.w1.get_value()) @ self.w2.get_value()


class Rows:
  """Record i: WIDTH normal numbers seeded by i."""

  def __init__(self, n: int, offset: int = 0):
    self.n, self.offset = n, offset

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return {"x": np.random.default_rng(self.offset + int(i)).normal(size=WIDTH).astype(np.float32)}


def check_config(config) -> None:
  pass


def build_model(config, rngs: nnx.Rngs) -> TwoMatrices:
  return TwoMatrices(rngs)


def make_batch(records, valid):
  return {"x": records["x"], "weights": valid.astype(np.float32)}


def data_sources(config) -> DataSources:
  return DataSources(Rows(4096), Rows(64, 10**6), recipe_fingerprint("rows", [WIDTH]), make_batch)


def loss_sums(model, batch, rng):
  w = batch["weights"]
  return jnp.sum(jnp.sum(model(batch["x"]) ** 2, axis=-1) * w), jnp.sum(w), {}


EXPERIMENT = Experiment(
  UNIT=UNIT,
  LOGICAL_AXES=LOGICAL_AXES,
  check_config=check_config,
  build_model=build_model,
  data_sources=data_sources,
  loss_sums=loss_sums,
)


def install() -> None:
  sys.modules["experiments.xla_repro"] = sys.modules[__name__]
  sys.modules["experiments.xla_repro_keys"] = lm_keys
