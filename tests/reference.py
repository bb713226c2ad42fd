"""An independent reference for the objective: the decoder's loss and gradient over only the valid
examples of a global batch, and AdamW, written from scratch with jax.numpy and numpy.

No trainer code, no mesh, no weights or masks: padding rows are simply left out. If the sharded
trainer agrees with this, it optimizes the objective a single device would.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def _rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _rope(x, base):  # x: [B, L, H, K]
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None, None] * freq  # [L, 1, K/2]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate(
    [x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1
  )


def _blocks(params) -> list:
  """Each layer's params: unrolled ({'blocks': {0: ..., 1: ...}}) or scanned (stacked {'layers': ...})."""
  if "layers" in params:
    depth = len(params["layers"]["attn_norm"]["scale"])
    return [jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(depth)]
  return [params["blocks"][i] for i in range(len(params["blocks"]))]


def logits(params, tokens, rope_base=10_000.0):
  tied = "unembed" not in params  # Tied: the table unembeds too, and lookups are scaled by sqrt(D).
  x = params["embed"][tokens]  # [B, L, D]
  if tied:
    x = x * math.sqrt(x.shape[-1])
  n = tokens.shape[1]
  causal = jnp.tril(jnp.ones((n, n), bool))
  for blk in _blocks(params):
    h = _rms_norm(x, blk["attn_norm"]["scale"])
    a = blk["attn"]
    q = _rope(jnp.einsum("bld,dhk->blhk", h, a["wq"]), rope_base)
    k = _rope(jnp.einsum("bld,dhk->blhk", h, a["wk"]), rope_base)
    v = jnp.einsum("bld,dhk->blhk", h, a["wv"])
    group = q.shape[2] // k.shape[2]  # Grouped-query attention: each K/V head serves `group` query heads.
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("blhk,bmhk->bhlm", q, k) / math.sqrt(q.shape[-1])
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    x = x + jnp.einsum("blhk,hkd->bld", jnp.einsum("bhlm,bmhk->blhk", p, v), a["wo"])
    h = _rms_norm(x, blk["mlp_norm"]["scale"])
    m = blk["mlp"]
    x = x + (jax.nn.silu(h @ m["gate"]) * (h @ m["up"])) @ m["down"]
  return _rms_norm(x, params["final_norm"]["scale"]) @ (params["embed"].T if tied else params["unembed"])


def mean_loss(params, tokens, z_loss=0.0):
  """Mean next-token cross-entropy over all tokens of `tokens` [N, L+1] (valid examples only), plus
  z_loss times the mean squared log-normalizer."""
  out = logits(params, tokens[:, :-1])
  logp = jax.nn.log_softmax(out)
  xent = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
  return xent + z_loss * jnp.mean(jax.nn.logsumexp(out, axis=-1) ** 2)


loss_and_grad = jax.jit(jax.value_and_grad(mean_loss), static_argnums=2)


@jax.jit
def _document_loss(params, rows, lengths):
  """Mean next-token cross-entropy of documents, one per row [N, n] from position 0, each `lengths`
  long: a row's tail beyond its document is never attended to (causal) and never predicted."""
  logp = jax.nn.log_softmax(logits(params, rows[:, :-1]))
  xent = -jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]
  inside = jnp.arange(rows.shape[1] - 1)[None, :] < (lengths[:, None] - 1)
  return jnp.sum(jnp.where(inside, xent, 0.0)) / jnp.sum(lengths - 1)


def documents(row: np.ndarray, pad_id: int, eos_id: int | None) -> list[np.ndarray]:
  """A stored record's documents: the tokens before its first pad, cut after each end-of-document
  token when packed. How a reader of the corpus would see it; no masks, segment ids or positions."""
  pads = np.flatnonzero(row == pad_id)
  row = row[: pads[0]] if len(pads) else row
  if eos_id is None:
    return [row]
  cuts = np.flatnonzero(row == eos_id) + 1
  return [d for d in np.split(row, cuts) if len(d)]


def document_loss_and_grad(params, docs: list[np.ndarray]):
  """Mean next-token cross-entropy over every prediction inside every document, each document run
  alone in a row of its own (positions from 0), and its gradient: the objective of a packed, padded
  batch. Returns (loss, grads, predictions counted)."""
  docs = [d for d in docs if len(d) > 1]
  width = max(len(d) for d in docs)
  rows = np.stack([np.pad(d, (0, width - len(d))) for d in docs])
  lengths = np.asarray([len(d) for d in docs])
  loss, grads = jax.value_and_grad(_document_loss)(params, rows, lengths)
  return loss, grads, int(np.sum(lengths - 1))


@jax.jit
def _weighted_document_loss(params, rows, weights):
  """Mean next-token cross-entropy over the targets of weight 1 ([N, n] rows, one document each from
  position 0, `weights` [N, n] per token as a target; 0 beyond a document)."""
  logp = jax.nn.log_softmax(logits(params, rows[:, :-1]))
  xent = -jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(xent * weights[:, 1:]) / jnp.sum(weights[:, 1:])


def weighted_documents(tokens: np.ndarray, weights: np.ndarray, pad_id: int, eos_id: int) -> list:
  """A stored record of prompt/response examples as (tokens, weights) per example, cut after each
  eos, before the first pad."""
  pads = np.flatnonzero(tokens == pad_id)
  end = pads[0] if len(pads) else len(tokens)
  cuts = np.flatnonzero(tokens[:end] == eos_id) + 1
  pieces = zip(np.split(tokens[:end], cuts), np.split(weights[:end], cuts), strict=True)
  return [(t, w) for t, w in pieces if len(t)]


def weighted_document_loss_and_grad(params, docs: list):
  """The fine-tuning objective: each (tokens, weights) example run alone, the loss the mean over its
  targets of weight 1 only. Returns (loss, grads, targets counted)."""
  width = max(len(t) for t, _ in docs)
  rows = np.stack([np.pad(t, (0, width - len(t))) for t, _ in docs])
  weights = np.stack([np.pad(w, (0, width - len(w))) for _, w in docs]).astype(np.float32)
  loss, grads = jax.value_and_grad(_weighted_document_loss)(params, rows, weights)
  return loss, grads, int(np.sum(weights[:, 1:]))


def learning_rate(count, peak, warmup, total, end_factor):
  """Linear warm-up then cosine decay, for the update of step count + 1."""
  step = count + 1
  if step < warmup:
    return peak * step / warmup
  frac = min(1.0, (step - warmup) / max(total - warmup, 1))
  end = peak * end_factor
  return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac))


class AdamW:
  """optax-free AdamW with global-norm clipping and weight decay on matrices only (float64)."""

  def __init__(self, params, opt):
    self.opt = opt
    self.mu = jax.tree.map(lambda p: np.zeros(p.shape), params)
    self.nu = jax.tree.map(lambda p: np.zeros(p.shape), params)
    self.count = 0

  def update(self, params, grads, total_steps):
    o = self.opt
    grads = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * min(1.0, o.grad_clip_norm / norm), grads)
    lr = learning_rate(self.count, o.learning_rate, o.warmup_steps, total_steps, o.end_factor)
    self.count += 1
    self.mu = jax.tree.map(lambda m, g: o.b1 * m + (1 - o.b1) * g, self.mu, grads)
    self.nu = jax.tree.map(lambda v, g: o.b2 * v + (1 - o.b2) * g * g, self.nu, grads)
    c1, c2 = 1 - o.b1**self.count, 1 - o.b2**self.count

    def step(path, p, m, v):
      p = np.asarray(p, np.float64)
      is_scale = getattr(path[-1], "key", None) == "scale"  # RMSNorm scales, stacked or not: no decay.
      u = (m / c1) / (np.sqrt(v / c2) + 1e-8) + (0.0 if is_scale else o.weight_decay * p)
      return (p - lr * u).astype(np.float32)

    return jax.tree_util.tree_map_with_path(step, params, self.mu, self.nu)
