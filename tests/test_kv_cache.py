"""model/kv_cache.py: generation with a key/value cache draws what rerunning the whole sequence for
every token draws, and its logits equal the full pass's, for unrolled and
scanned blocks, grouped-query attention, Qwen3's q/k norm, Llama 3's RoPE scaling and a dropless
mixture of experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import kv_cache
from model.layers import RopeScaling
from model.transformer import Decoder, DecoderConfig

BASE = dict(vocab_size=48, embed_dim=32, num_layers=3, num_heads=4, mlp_dim=64, rope_base=500.0)
NEW = 8  # Tokens generated.
CASES = {
  "unrolled_llama3_rope_tied": dict(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16), tie_embeddings=True),
  "scanned_gqa_qknorm": dict(scan_layers=True, num_kv_heads=2, qk_norm=True),
  "moe_dropless": dict(
    moe=dict(num_experts=4, top_k=2, expert_dim=32, routing="dropless"), first_dense=1, scan_layers=True
  ),
}


@pytest.mark.parametrize("case", CASES)
def test_cached_generation_equals_rerunning_the_sequence(case):
  with nnx.use_eager_sharding(False):  # No mesh: one device, as sampling runs.
    model = Decoder(DecoderConfig(**BASE, **CASES[case], compute_dtype="float32"), rngs=nnx.Rngs(0))
  prompt = jnp.asarray(np.random.default_rng(1).integers(2, 48, (2, 5)), jnp.int32)
  key = jax.random.PRNGKey(3)
  cached = kv_cache.generate(model, prompt, NEW, 0.0, key, 48, banned=(0,))
  graphdef, state = nnx.split(model)
  full_pass = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  total = 5 + NEW
  full = np.zeros((2, total), np.int32)  # Causal: the zeros after position t never reach its logits.
  full[:, :5] = prompt
  for t in range(5, total):  # Greedy, the whole sequence through the model for every new token.
    logits = np.array(full_pass(state, jnp.asarray(full)))[:, t - 1]
    logits[:, 0] = -np.inf
    full[:, t] = logits.argmax(-1)
  np.testing.assert_array_equal(cached, full)

  # Each position's logits from the cache (prefill, then one token at a time) against one full pass.
  @jax.jit
  def cached_pass(s, tokens, positions, caches, start):
    m = nnx.merge(graphdef, s)
    return kv_cache.forward(m, kv_cache.blocks(m), tokens, positions, caches, start)

  caches = kv_cache.empty_caches(kv_cache.blocks(model), 2, total, jnp.float32)
  first, caches = cached_pass(state, cached[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), caches, 0)
  steps = [first]
  for t in range(5, total):
    logits, caches = cached_pass(state, cached[:, t : t + 1], jnp.full((2, 1), t), caches, t)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full_pass(state, cached), atol=2e-5, rtol=1e-5)
  sampled = kv_cache.generate(model, prompt, NEW, 1.0, key, 48, banned=(0,))
  assert sampled.shape == (2, total) and not (sampled[:, 5:] == 0).any()  # The banned id is never drawn.


def test_prompts_of_different_lengths_in_one_batch_and_their_log_likelihoods():
  """kv_cache.greedy on prompts padded on the right gives each prompt's own greedy continuation (as
  generate draws it alone, nothing banned), and token_logprobs equals log-softmax of the full pass."""
  with nnx.use_eager_sharding(False):
    model = Decoder(
      DecoderConfig(**BASE, **CASES["scanned_gqa_qknorm"], compute_dtype="float32"), rngs=nnx.Rngs(0)
    )
  rng = np.random.default_rng(4)
  prompts = [rng.integers(2, 48, n).astype(np.int32) for n in (3, 7, 1)]
  padded = np.zeros((3, 8), np.int32)
  for i, p in enumerate(prompts):
    padded[i, : len(p)] = p
  batched = np.asarray(kv_cache.greedy(model, padded, np.array([3, 7, 1], np.int32), NEW))
  for i, p in enumerate(prompts):
    alone = kv_cache.generate(model, jnp.asarray(p[None]), NEW, 0.0, jax.random.PRNGKey(0), 48)
    np.testing.assert_array_equal(batched[i], np.asarray(alone)[0, len(p) :])
  logp, greedy = kv_cache.token_logprobs(model, padded)
  full = jax.nn.log_softmax(np.asarray(model(jnp.asarray(padded)), np.float32)[:, :-1])
  expected = np.take_along_axis(full, padded[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(logp, expected, atol=2e-5)
  np.testing.assert_array_equal(greedy, full.argmax(-1) == padded[:, 1:])
