"""Greedy or temperature sampling from any function of tokens to logits, rerunning the whole sequence
for every new token: what samples a model given only as such a function (the Hugging Face parity
tests). The decoder's own, with a key/value cache: model/kv_cache.py; reading a trained run and its
tokenizer: experiments/sample.py.
"""

import jax
import jax.numpy as jnp


def generate(logits_of, prompt, new_tokens: int, temperature: float, key, vocab_size: int, banned=()):
  """prompt int32[B, P] -> int32[B, P + new_tokens]. `logits_of` maps tokens [B, L] to logits
  [B, L, V]; ids from `vocab_size` on and `banned` (padding) are never drawn."""
  b, p = prompt.shape
  total = p + new_tokens
  tokens = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt)
  allowed = jnp.arange(logits_of(tokens[:, :1]).shape[-1]) < vocab_size
  for i in banned:
    allowed = allowed.at[i].set(False)

  def body(t, carry):
    tokens, key = carry
    logits = jnp.where(allowed, logits_of(tokens)[:, t - 1], -jnp.inf)  # Causal: later slots unseen.
    key, draw = jax.random.split(key)
    if temperature > 0:
      nxt = jax.random.categorical(draw, logits / temperature, axis=-1)
    else:
      nxt = jnp.argmax(logits, axis=-1)
    return tokens.at[:, t].set(nxt.astype(jnp.int32)), key

  return jax.lax.fori_loop(p, total, body, (tokens, key))[0]
