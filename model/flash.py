"""Blockwise ("flash") attention in plain JAX: softmax(q k^T / sqrt(K)) v over key/value blocks with a
running maximum and sum, returning the output and the log-sum-exp of each query's scores, so that
results over separate key/value sets (the chunks of a sequence split over the `context` mesh axis,
model/context.py) combine exactly (`merge`).

No [L, L] array exists, forward or backward: scores live one [block, block] tile at a time, the mask of
a tile is built from the positions and segment ids of its queries and keys (causal within a segment:
same segment and key position <= query position), and the backward pass (custom VJP) recomputes each
tile's probabilities from the saved log-sum-exp instead of keeping them. Scores, softmax and the
accumulators are float32 whatever the compute dtype.

Shapes: B batch, Q queries, S keys, H query heads, G key/value heads (H = G x R), K head dim.
"""

import functools

import jax
import jax.numpy as jnp

BLOCK = 512  # Queries and keys per tile unless the caller says (model.attention_block 0); TPUs: 256.
NEG = -1e30  # The log-sum-exp of a query that sees no key in a set: its weight in `merge` is 0.


def default_block() -> int:
  """The tile model.attention_block 0 means: 256 on TPUs (the fastest of 256-2,048 at 2,048 tokens on
  the v5e, benchmarks/attention_kernels.py), else BLOCK."""
  return 256 if jax.default_backend() == "tpu" else BLOCK


def block_size(length: int, block: int) -> int:
  """The largest divisor of `length` that is at most `block` (tiles must cover the sequence exactly)."""
  return max(d for d in range(1, min(length, block) + 1) if length % d == 0)


def _tiles(x, size):  # [B, L, ...] -> [L / size, B, size, ...]
  return jnp.swapaxes(x.reshape(x.shape[0], x.shape[1] // size, size, *x.shape[2:]), 0, 1)


def _untile(x):  # [n, B, size, ...] -> [B, n x size, ...]
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _scores(q, k, qp, kp, qs, ks):
  """One tile: float32 scores [B, G, R, q, s] and its mask (same segment, key not after the query)."""
  s = jnp.einsum("bqgrd,bsgd->bgrqs", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(q.shape[-1])
  mask = (qs[:, :, None] == ks[:, None, :]) & (qp[:, :, None] >= kp[:, None, :])  # [B, q, s]
  return s, mask[:, None, None]


def _forward(q, k, v, qp, kp, qs, ks, block):
  """(out [B, Q, G, R, K], lse [B, G, R, Q]), both float32 (`merge` combines them unrounded)."""
  bq, bs = block_size(q.shape[1], block), block_size(k.shape[1], block)
  kv = (_tiles(k, bs), _tiles(v, bs), _tiles(kp, bs), _tiles(ks, bs))

  def one_query_tile(tile):
    qt, qpt, qst = tile
    b, n, g, r, d = qt.shape
    init = (
      jnp.zeros((b, g, r, n, d), jnp.float32),
      jnp.full((b, g, r, n), NEG, jnp.float32),
      jnp.zeros((b, g, r, n), jnp.float32),
    )

    def add_key_tile(carry, kv_tile):
      acc, m, total = carry
      kt, vt, kpt, kst = kv_tile
      s, mask = _scores(qt, kt, qpt, kpt, qst, kst)
      m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, NEG), axis=-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      scale = jnp.exp(m - m_new)
      pv = jnp.einsum("bgrqs,bsgd->bgrqd", p.astype(vt.dtype), vt, preferred_element_type=jnp.float32)
      return (acc * scale[..., None] + pv, m_new, total * scale + jnp.sum(p, axis=-1)), None

    (acc, m, total), _ = jax.lax.scan(add_key_tile, init, kv)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / total[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(total), NEG)
    return jnp.einsum("bgrqd->bqgrd", out), lse

  out, lse = jax.lax.map(one_query_tile, (_tiles(q, bq), _tiles(qp, bq), _tiles(qs, bq)))
  # out [n, B, bq, G, R, K] -> [B, Q, G, R, K]; lse [n, B, G, R, bq] -> [B, G, R, Q].
  lse = jnp.moveaxis(lse, 0, -2)
  return _untile(out), lse.reshape(*lse.shape[:-2], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attend(q, k, v, qp, kp, qs, ks, block):
  return _forward(q, k, v, qp, kp, qs, ks, block)


def _attend_fwd(q, k, v, qp, kp, qs, ks, block):
  out, lse = _forward(q, k, v, qp, kp, qs, ks, block)
  return (out, lse), (q, k, v, qp, kp, qs, ks, out, lse)


def _attend_bwd(block, res, grads):
  """Flash attention's backward pass, with the log-sum-exp's own cotangent: d lse / d s = p, so a tile's
  score gradient is p (dp - rowsum(dout * out) + dlse)."""
  q, k, v, qp, kp, qs, ks, out, lse = res
  dout, dlse = grads
  bq, bs = block_size(q.shape[1], block), block_size(k.shape[1], block)
  delta = jnp.einsum("bqgrd,bqgrd->bgrq", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse
  q_side = [_tiles(x, bq) for x in (q, qp, qs, dout)] + [
    _tiles(jnp.moveaxis(y, -1, 1), bq) for y in (lse, delta)
  ]
  scale = 1.0 / jnp.sqrt(q.shape[-1]).astype(jnp.float32)

  def one_key_tile(dq, kv_tile):
    kt, vt, kpt, kst = kv_tile

    def add_query_tile(carry, q_tile):
      dk, dv = carry
      qt, qpt, qst, dot, lset, deltat = q_tile
      lset, deltat = jnp.moveaxis(lset, 1, -1), jnp.moveaxis(deltat, 1, -1)  # [B, G, R, bq]
      s, mask = _scores(qt, kt, qpt, kpt, qst, kst)
      p = jnp.where(mask, jnp.exp(s - lset[..., None]), 0.0)
      dv = dv + jnp.einsum("bgrqs,bqgrd->bsgd", p, dot.astype(jnp.float32))
      dp = jnp.einsum("bqgrd,bsgd->bgrqs", dot, vt, preferred_element_type=jnp.float32)
      ds = p * (dp - deltat[..., None]) * scale
      dk = dk + jnp.einsum("bgrqs,bqgrd->bsgd", ds, qt.astype(jnp.float32))
      dqt = jnp.einsum("bgrqs,bsgd->bqgrd", ds, kt.astype(jnp.float32))
      return (dk, dv), dqt

    zeros = jnp.zeros(kt.shape, jnp.float32)
    (dk, dv), dq_tiles = jax.lax.scan(add_query_tile, (zeros, zeros), q_side)
    return dq + dq_tiles, (dk, dv)

  kv = (_tiles(k, bs), _tiles(v, bs), _tiles(kp, bs), _tiles(ks, bs))
  dq0 = jnp.zeros((q.shape[1] // bq, q.shape[0], bq, *q.shape[2:]), jnp.float32)
  dq, (dk, dv) = jax.lax.scan(one_key_tile, dq0, kv)
  return (
    _untile(dq).astype(q.dtype),
    _untile(dk).astype(k.dtype),
    _untile(dv).astype(v.dtype),
    None,
    None,
    None,
    None,
  )


_attend.defvjp(_attend_fwd, _attend_bwd)


def attend(q, k, v, q_pos, k_pos, q_seg, k_seg, *, block: int = BLOCK):
  """Causal attention of queries q [B, Q, H, K] on keys and values [B, S, G, K] within segments:
  (out [B, Q, H, K], lse [B, Q, H]), float32. Positions and segment ids are int [B, Q] / [B, S]."""
  b, n, h, d = q.shape
  g = k.shape[2]
  out, lse = _attend(q.reshape(b, n, g, h // g, d), k, v, q_pos, k_pos, q_seg, k_seg, block)
  return out.reshape(b, n, h, d), jnp.einsum("bgrq->bqgr", lse).reshape(b, n, h)


def merge(out_a, lse_a, out_b, lse_b):
  """Attention over the union of two disjoint key sets from each set's (out, lse): exact in float32."""
  lse = jnp.logaddexp(lse_a, lse_b)
  wa, wb = jnp.exp(lse_a - lse)[..., None], jnp.exp(lse_b - lse)[..., None]
  out = wa * out_a.astype(jnp.float32) + wb * out_b.astype(jnp.float32)
  return out, lse
