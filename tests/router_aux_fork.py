"""A fork a researcher might write, for tests only: the LM with a router-like parameter (a linear map
of the final hidden states to EXPERTS logits, along its own logical axis `expert`) whose only gradient
comes from an auxiliary loss, a penalty on its logits' squares, weighted AUX_WEIGHT. `loss_sums`
writes the auxiliary term as a sum over valid tokens, as the contract asks; `loss_sums_batch_mean`
writes it the way a mixture-of-experts port often does, `xent_sum + 0.01 * aux_mean`: a mean over the
batch, which weighs it 0.01 / N per token and shifts the loss by a few 1e-6 only, below verify's loss
tolerance (--mode=verify catches it by the router's gradient). `install()` makes it the experiment
`routed`, with the LM's keys."""

import sys

import jax
import jax.numpy as jnp
from flax import nnx

from experiments import lm, lm_keys
from experiments.lm import UNIT, check_config, data_sources, example_batch
from model.layers import param
from trainer.experiment import Experiment

LOGICAL_AXES = {**lm.LOGICAL_AXES, "expert": None}  # The router's own axis: replicated unless a rule says.
EXPERTS = 4
AUX_WEIGHT = 0.01


class Router(nnx.Module):
  def __init__(self, embed_dim: int, rngs: nnx.Rngs):
    self.kernel = param(rngs, nnx.initializers.normal(0.01), (embed_dim, EXPERTS), ("embed", "expert"))


class Routed(nnx.Module):
  def __init__(self, decoder, embed_dim: int, rngs: nnx.Rngs):
    self.decoder = decoder
    self.router = Router(embed_dim, rngs)


def build_model(config, rngs: nnx.Rngs) -> Routed:
  return Routed(lm.build_model(config, rngs), config.model.embed_dim, rngs)


def _router_penalty(model: Routed, batch):
  """Per token, the squares of the router's logits summed over experts: [B, L]. The hidden states are
  held fixed (stop_gradient), so the router is the only parameter the penalty moves."""
  h = jax.lax.stop_gradient(model.decoder.hidden(batch["inputs"]))  # [B, L, D]
  logits = h.astype(jnp.float32) @ model.router.kernel[...]  # [B, L, EXPERTS]
  return jnp.sum(logits**2, axis=-1)


def loss_sums(model: Routed, batch, rng):
  """The LM's sums plus AUX_WEIGHT x the penalty summed over valid tokens (= aux_mean x count): its
  weight per token is AUX_WEIGHT whatever the batch size."""
  loss_sum, count, metrics = lm.loss_sums(model.decoder, batch, rng)
  aux_sum = jnp.sum(batch["weights"] * _router_penalty(model, batch))
  return loss_sum + AUX_WEIGHT * aux_sum, count, {**metrics, "router_aux": aux_sum}


def loss_sums_batch_mean(model: Routed, batch, rng):
  """The mistake: the penalty's mean over the batch added to a sum over the batch."""
  loss_sum, count, metrics = lm.loss_sums(model.decoder, batch, rng)
  aux_sum = jnp.sum(batch["weights"] * _router_penalty(model, batch))
  aux_mean = aux_sum / jnp.maximum(count, 1.0)
  return loss_sum + AUX_WEIGHT * aux_mean, count, {**metrics, "router_aux": aux_sum}


EXPERIMENT = Experiment(
  UNIT=UNIT,
  LOGICAL_AXES=LOGICAL_AXES,
  check_config=check_config,
  build_model=build_model,
  data_sources=data_sources,
  loss_sums=loss_sums,
  example_batch=example_batch,
)


def install() -> None:
  """Registers this module as experiments.routed (with experiments/lm_keys.py's keys)."""
  sys.modules["experiments.routed"] = sys.modules[__name__]
  sys.modules["experiments.routed_keys"] = lm_keys
