"""The mixture-of-experts layer (model/moe.py) inside the decoder, on one device: every routing that
drops nothing computes what running every expert on every token and keeping the top k computes, and
the auxiliary sums add up over sequences (what microbatches, meshes and verify's additivity need)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import moe
from model.transformer import Decoder, DecoderConfig

E, K, L = 4, 2, 16


def decoder(routing: str, capacity_factor: float = 1.25, **kw) -> Decoder:
  moe_args = dict(num_experts=E, top_k=K, expert_dim=24, routing=routing, capacity_factor=capacity_factor)
  moe_args.update({k: kw.pop(k) for k in ("shared_dim", "score", "renormalize") if k in kw})
  with nnx.use_eager_sharding(False):
    shape = dict(vocab_size=32, embed_dim=32, num_layers=2, num_heads=2, mlp_dim=48, rope_base=1e4)
    return Decoder(DecoderConfig(**shape, compute_dtype="float32", moe=moe_args, **kw), rngs=nnx.Rngs(0))


@nnx.jit
def hidden_and_aux(model, tokens, mask):
  return model.hidden_and_aux(tokens, token_mask=mask)


TOKENS = jax.random.randint(jax.random.key(1), (3, L), 0, 32)
MASK = jnp.ones((3, L)).at[2, 10:].set(0)  # Padding at the end of the last row.
FEATURES = [
  dict(renormalize=False),
  dict(scan_layers=True, first_dense=1, shared_dim=16, score="sigmoid", remat="full"),
]


@pytest.mark.parametrize("features", FEATURES, ids=["unrolled", "scanned_dense_first_shared_sigmoid_remat"])
def test_dropless_and_roomy_capacity_equal_every_expert_on_every_token(features):
  """The same seed gives the same parameters whatever the routing; float32 agrees to 2e-6 of the
  largest hidden value (measured 8e-7), the auxiliary sums too, and capacity's gradients."""
  h_ref, aux_ref = hidden_and_aux(decoder("every", **features), TOKENS, MASK)
  scale = float(jnp.max(jnp.abs(h_ref)))
  for routing, factor in (("dropless", 1.25), ("capacity", E / K)):
    model = decoder(routing, factor, **features)
    h, aux = hidden_and_aux(model, TOKENS, MASK)
    assert float(jnp.max(jnp.abs(h - h_ref))) < 2e-6 * scale, routing
    assert float(aux["dropped"]) == 0.0
    for name in ("balance", "router_z", "load"):
      np.testing.assert_allclose(aux[name], aux_ref[name], rtol=1e-5, err_msg=f"{routing} {name}")

  def grads(routing, factor):
    model = decoder(routing, factor, **features)
    graph, params = nnx.split(model, nnx.Param)
    loss = lambda p: jnp.sum(nnx.merge(graph, p).hidden(TOKENS) ** 2)
    return jax.tree.leaves(jax.jit(jax.grad(loss))(params))

  for a, b in zip(grads("every", 1.0), grads("capacity", E / K), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(a))))


def test_a_small_capacity_drops_assignments_and_counts_them():
  """Capacity 1.0 on a 16-token sequence: C = 8 slots per expert; assignments past it are dropped,
  counted in `dropped`, and change the output; the output stays finite."""
  h_ref, _ = hidden_and_aux(decoder("every"), TOKENS, MASK)
  h, aux = hidden_and_aux(decoder("capacity", 0.5), TOKENS, MASK)
  assert moe.capacity(L, K, E, 0.5) == 4
  assert float(aux["dropped"]) > 0 and bool(jnp.all(jnp.isfinite(h)))
  assert float(jnp.max(jnp.abs(h - h_ref))) > 1e-3
  # Causal even when it drops: a later token changes no earlier position's output (a first-choices-
  # first queue would let it take a slot an earlier token's second choice had).
  for t in (4, 9, 13):
    changed = TOKENS.at[:, t].set((TOKENS[:, t] + 7) % 32)
    h_changed, _ = hidden_and_aux(decoder("capacity", 0.5), changed, MASK)
    np.testing.assert_array_equal(h_changed[:, :t], h[:, :t], err_msg=f"position {t}")


def test_the_auxiliary_sums_add_up_over_sequences_and_ignore_masked_tokens():
  """Sums over a batch equal the sums over its rows taken alone (routing groups are sequences); a
  masked token counts in none of them, and the load shares sum to one per valid token and layer."""
  model = decoder("capacity", 1.0)
  _, whole = hidden_and_aux(model, TOKENS, MASK)
  parts = [hidden_and_aux(model, TOKENS[i : i + 1], MASK[i : i + 1])[1] for i in range(3)]
  for name in moe.AUX_SUMS + ("load",):
    np.testing.assert_allclose(whole[name], sum(p[name] for p in parts), rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(float(jnp.sum(whole["load"])), 2 * float(jnp.sum(MASK)), rtol=1e-6)
  # A masked position after every valid one changes none of the sums, even where slots run out: the
  # queues are in token order, so right padding never takes a valid token's slot.
  dropping = decoder("capacity", 0.5)
  changed = TOKENS.at[2, 12].set((TOKENS[2, 12] + 1) % 32)
  before, after = (hidden_and_aux(dropping, t, MASK)[1] for t in (TOKENS, changed))
  assert float(before["dropped"]) > 0
  for name in moe.AUX_SUMS + ("load",):
    np.testing.assert_allclose(after[name], before[name], rtol=1e-6, err_msg=name)
