"""Next-token cross-entropy as sums over valid tokens, optionally with z-loss, optionally in chunks.

Chunked: the sequence is cut into pieces of `chunk` positions and the logits of one piece exist at a
time, in the forward and (recomputed) in the backward pass: [B, chunk, V] float32 instead of
[B, L, V], which is what lets a 128k vocabulary fit. The sums are the same up to float rounding.
"""

import jax
import jax.numpy as jnp
import optax


def _sums(logits, targets, weights, z_loss: float):
  """Sums over [B, n] tokens: cross-entropy, correct predictions, and z_loss * logsumexp^2."""
  xent = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  # Correct: the target's logit is the largest (a tie counts). A max and a gather, not an argmax: XLA:CPU
  # lowers argmax to a two-operand reduction that cost 10-15% of lm_mt_peer.py's step.
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
  sums = {"xent": jnp.sum(xent * weights), "correct": jnp.sum(correct * weights)}
  if z_loss:  # PaLM's auxiliary loss: keeps the softmax normalizer near 1 (log Z near 0).
    sums["z_loss"] = z_loss * jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * weights)
  return sums


def token_sums(logits_of, hidden, targets, weights, *, chunk: int = 0, z_loss: float = 0.0) -> dict:
  """{'xent', 'correct'[, 'z_loss']} summed over tokens weighted by `weights` [B, L].

  `logits_of` maps hidden states [B, n, D] to float32 logits [B, n, V]; `chunk` (0: all L at once)
  must divide L.
  """
  n = hidden.shape[1]
  if not chunk or chunk >= n:
    return _sums(logits_of(hidden), targets, weights, z_loss)
  if n % chunk:
    raise ValueError(f"loss chunk {chunk} must divide the sequence length {n}")

  def pieces(x):  # [B, L, ...] -> [L / chunk, B, chunk, ...]: the batch dimension keeps its sharding.
    return jnp.swapaxes(x.reshape(x.shape[0], n // chunk, chunk, *x.shape[2:]), 0, 1)

  # Rematerialized: the backward pass recomputes each piece's logits instead of keeping them all.
  piece_sums = jax.checkpoint(lambda h, t, w: _sums(logits_of(h), t, w, z_loss))

  def add(total, piece):
    return jax.tree.map(jnp.add, total, piece_sums(*piece)), None

  zeros = jax.tree.map(
    jnp.zeros_like, jax.eval_shape(piece_sums, hidden[:, :chunk], targets[:, :chunk], weights[:, :chunk])
  )
  total, _ = jax.lax.scan(add, zeros, (pieces(hidden), pieces(targets), pieces(weights)))
  return total
