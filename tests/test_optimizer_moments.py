"""AdamW's moments in bfloat16 (optimizer.moments_dtype): the transform is optax's scale_by_adam in
float32 and its rounded moments in bfloat16; a sharded run keeps them in bfloat16, split as the
parameters, and trains the same losses as float32 moments within bfloat16's rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tests.conftest import tiny_config
from tests.objective_harness import run_steps
from trainer.optimizer import scale_by_adam


def _grads(rng, params):
  return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)


def test_float32_moments_are_optax_and_bfloat16_ones_their_rounding():
  params = {"w": jnp.ones((8, 4)), "b": jnp.arange(5.0)}
  rng = np.random.default_rng(0)
  ref, wide = optax.scale_by_adam(0.9, 0.95), scale_by_adam(0.9, 0.95, jnp.float32)
  narrow = scale_by_adam(0.9, 0.95, jnp.bfloat16)
  s_ref, s_wide, s_narrow = ref.init(params), wide.init(params), narrow.init(params)
  assert jax.tree.structure(s_ref) == jax.tree.structure(s_narrow)  # One checkpoint layout.
  for t in range(6):
    g = _grads(rng, params)
    u_ref, s_ref = ref.update(g, s_ref, params)
    u_wide, s_wide = wide.update(g, s_wide, params)
    mu_before = s_narrow.mu
    u_narrow, s_narrow = narrow.update(g, s_narrow, params)
    for a, b in zip(jax.tree.leaves(u_wide), jax.tree.leaves(u_ref), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(u_narrow), jax.tree.leaves(u_ref), strict=True):
      np.testing.assert_allclose(a, b, rtol=0.05, atol=0.02)  # bf16 keeps 8 bits of each moment.
    # Stored: the float32 update of the stored moment, rounded once.
    want = jax.tree.map(
      lambda m, x: (0.9 * m.astype(jnp.float32) + 0.1 * x).astype(jnp.bfloat16), mu_before, g
    )
    for a, b in zip(jax.tree.leaves(s_narrow.mu), jax.tree.leaves(want), strict=True):
      assert a.dtype == jnp.bfloat16 and bool(jnp.all(a == b)), t


def test_a_sharded_run_keeps_bfloat16_moments_split_as_the_parameters():
  kw = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "sharding.strategy": "fsdp_tp"}
  _, wide, _, _ = run_steps(tiny_config(**kw), jax.devices(), 4)
  _, narrow, state, _ = run_steps(
    tiny_config(**kw, **{"optimizer.moments_dtype": "bfloat16"}), jax.devices(), 4
  )
  adam = next(
    s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "nu")) if hasattr(s, "nu")
  )
  for moment in (adam.mu, adam.nu):
    for m, p in zip(jax.tree.leaves(moment), jax.tree.leaves(state.params), strict=True):
      assert m.dtype == jnp.bfloat16 and m.sharding.is_equivalent_to(p.sharding, p.ndim)
  for t in range(4):
    assert abs(narrow[t]["loss"] - wide[t]["loss"]) <= 1e-2 * abs(wide[t]["loss"]), t
