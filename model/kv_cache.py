"""Generation with a key/value cache for model/transformer.Decoder: the prompt runs through the blocks
once (prefill), each block keeping its keys and values for every position to come; then each new
token runs alone, attending to what the cache holds. A sequence of P + N tokens costs one pass over P
and N one-token passes, where model/sample.generate reruns the whole sequence for every new token.

The attention is the `einsum` implementation's (scores and softmax in float32), so in float32 the
logits equal the full forward pass's within rounding and greedy tokens are the same
(tests/test_sample.py). A mixture of experts routes dropless here whatever `model.moe.routing` trains
with (model/moe.py): capacity routing would count its capacity from the prompt's few tokens and drop
assignments, so an imported Mixtral or Qwen3-MoE gives transformers' greedy tokens with the default
routing (tests/test_hf_moe_parity.py); the full pass equals this one where it drops nothing (dropless,
`every`, or a capacity_factor of at least num_experts / top_k). For sampling and evaluation, not for
training: generate on one device; token_logprobs and greedy (evaluation) also on weights sharded over
a mesh, which jit partitions, the whole sequence on each device (no context axis).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from model import moe as moe_lib
from model.layers import rope, rope_frequencies


def blocks(decoder) -> list:
  """The decoder's blocks in order, one module each (a scanned stack sliced into its layers)."""
  if not decoder.scan_layers:
    return list(decoder.blocks)
  out = []
  for stack in (getattr(decoder, "dense_layers", None), decoder.layers):
    if stack is not None:
      graphdef, state = nnx.split(stack)
      n = jax.tree.leaves(state)[0].shape[0]
      out += [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(n)]
  return out


def _attend(attn, x, positions, cache: tuple, start):
  """The block's attention for x [B, T, D] at `positions` [B, T], its keys and values written into the
  cache ([B, S, G, K] each) at `start` (one slot for every row, or int32[B]: row b's); each query sees
  the cached positions up to its own."""
  dt = x.dtype
  q = jnp.einsum("bld,dhk->blhk", x, attn.wq[...].astype(dt))
  k = jnp.einsum("bld,dgk->blgk", x, attn.wk[...].astype(dt))
  v = jnp.einsum("bld,dgk->blgk", x, attn.wv[...].astype(dt))
  if attn.qk_norm:
    q, k = attn.q_norm(q), attn.k_norm(k)
  freq = rope_frequencies(q.shape[-1], attn.rope_base, attn.rope_scaling)
  q, k = rope(q, positions, freq), rope(k, positions, freq)
  keys, values = _write(cache[0], k, start), _write(cache[1], v, start)
  b, t, h, d = q.shape
  g = keys.shape[2]
  q = q.reshape(b, t, g, h // g, d)  # Query head i belongs to key/value group i // (h / g).
  scores = jnp.einsum("btgrk,bsgk->bgrts", q, keys.astype(dt), preferred_element_type=jnp.float32)
  scores = scores / jnp.sqrt(d)
  visible = jnp.arange(keys.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  out = jnp.einsum("bgrts,bsgk->btgrk", probs, values.astype(dt)).reshape(b, t, h, d)
  return jnp.einsum("blhk,hkd->bld", out, attn.wo[...].astype(dt)), (keys, values)


def _write(cache, update, start):
  """update [B, T, G, K] into cache [B, S, G, K] from slot `start`, or from slot start[b] in row b."""
  update = update.astype(cache.dtype)
  if jnp.ndim(start) == 0:
    return jax.lax.dynamic_update_slice(cache, update, (0, start, 0, 0))
  return jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice(c, u, (s, 0, 0)))(cache, update, start)


def forward(decoder, layers: list, tokens, positions, caches: list, start):
  """Logits [B, T, V] of `tokens` [B, T] at `positions`, and the caches with their keys and values."""
  x = decoder.embed_tokens(tokens)
  written = []
  for block, cache in zip(layers, caches, strict=True):
    a, cache = _attend(block.attn, block.attn_norm(x), positions, cache, start)
    x = x + a
    h = block.mlp_norm(x)
    # Dropless, never the training routing: the capacity of a prompt's few tokens drops (module docstring).
    x = x + (block.mlp(h, routing="dropless")[0] if isinstance(block.mlp, moe_lib.MoE) else block.mlp(h))
    written.append(cache)
  return decoder.logits(decoder.final_norm(x)), written


def empty_caches(layers: list, batch: int, length: int, dtype) -> list:
  """Zeroed keys and values [B, S, G, K] for each block."""
  shape = lambda a: (batch, length, a.wk.shape[1], a.wk.shape[2])
  return [(jnp.zeros(shape(b.attn), dtype), jnp.zeros(shape(b.attn), dtype)) for b in layers]


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 6, 7))
def _generate(graphdef, state, prompt, new_tokens: int, temperature: float, key, vocab_size: int, banned):
  model = nnx.merge(graphdef, state)
  layers = blocks(model)
  b, p = prompt.shape
  total = p + new_tokens
  caches = empty_caches(layers, b, total, model.compute_dtype)
  positions = jnp.broadcast_to(jnp.arange(p), (b, p))
  logits, caches = forward(model, layers, prompt, positions, caches, 0)
  allowed = jnp.arange(logits.shape[-1]) < vocab_size
  for i in banned:
    allowed = allowed.at[i].set(False)
  tokens = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt)

  def body(t, carry):
    tokens, last, caches, key = carry
    logits = jnp.where(allowed, last, -jnp.inf)
    key, draw = jax.random.split(key)
    if temperature > 0:
      nxt = jax.random.categorical(draw, logits / temperature, axis=-1)
    else:
      nxt = jnp.argmax(logits, axis=-1)
    tokens = tokens.at[:, t].set(nxt.astype(jnp.int32))
    token = jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)
    step_logits, caches = forward(model, layers, token, jnp.full((b, 1), t), caches, t)
    return tokens, step_logits[:, 0], caches, key

  return jax.lax.fori_loop(p, total, body, (tokens, logits[:, -1], caches, key))[0]


def generate(model, prompt, new_tokens: int, temperature: float, key, vocab_size: int, banned=()):
  """prompt int32[B, P] -> int32[B, P + new_tokens], as model/sample.generate draws them (the same
  greedy tokens), with a key/value cache."""
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, prompt, new_tokens, temperature, key, vocab_size, tuple(banned))


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, state, tokens):
  model = nnx.merge(graphdef, state)
  layers = blocks(model)
  b, length = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  logits, _ = forward(
    model, layers, tokens, positions, empty_caches(layers, b, length, model.compute_dtype), 0
  )
  logits = logits[:, :-1].astype(jnp.float32)
  targets = tokens[:, 1:]
  picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
  return picked, jnp.argmax(logits, axis=-1) == targets


def token_logprobs(model, tokens):
  """tokens int32[B, L] -> (log p(tokens[:, t + 1] | tokens[:, :t + 1]) float32[B, L - 1], whether each
  is the greedy choice bool[B, L - 1]). Causal: what follows a row's last real token never changes its
  earlier entries, so rows may be padded on the right. The weights may be sharded (under jit: the
  compiler partitions it); the results may be too (multihost_utils.process_allgather reads them)."""
  graphdef, state = nnx.split(model)
  return _token_logprobs(graphdef, state, tokens)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _greedy(graphdef, state, prompts, lengths, new_tokens: int):
  # The rows in one batch, not one vmapped row each: ragged_dot (dropless routing) has no vmap rule for
  # weights shared across the mapped rows.
  model = nnx.merge(graphdef, state)
  layers = blocks(model)
  b, p = prompts.shape
  caches = empty_caches(layers, b, p + new_tokens, model.compute_dtype)
  logits, caches = forward(model, layers, prompts, jnp.broadcast_to(jnp.arange(p), (b, p)), caches, 0)

  def body(t, carry):
    # Row b's slots from lengths[b] on hold its padding's keys until generation overwrites them, one per
    # step, before any query can see them (each sees the slots up to its own position).
    out, last, caches = carry
    nxt = jnp.argmax(last, axis=-1).astype(jnp.int32)  # [B]
    at = lengths + t  # [B]
    logits, caches = forward(model, layers, nxt[:, None], at[:, None], caches, at)
    return out.at[:, t].set(nxt), logits[:, 0], caches

  first = logits[jnp.arange(b), lengths - 1]  # [B, V]: each row's last prompt token's.
  return jax.lax.fori_loop(0, new_tokens, body, (jnp.zeros((b, new_tokens), jnp.int32), first, caches))[0]


def greedy(model, prompts, lengths, new_tokens: int):
  """Greedy continuations int32[B, new_tokens] of prompts int32[B, P] padded on the right, row b's
  prompt being its first lengths[b] tokens: prompts of different lengths in one batch (for evaluation,
  where transformers' generate(do_sample=False) is the reference: no token is banned)."""
  graphdef, state = nnx.split(model)
  return _greedy(graphdef, state, prompts, lengths, new_tokens)
