"""A mixture-of-experts feed-forward layer in Flax NNX: a float32 router picks `top_k` of `num_experts`
SwiGLU experts per token (softmax or sigmoid scores, the top-k weights optionally renormalized), plus
optional shared experts every token passes through (one SwiGLU of their summed width).

Three routings compute the same function where nothing is dropped:
  capacity  each sequence sends each expert at most C = ceil(capacity_factor x L x top_k / E) tokens
            (earlier tokens first: causal, unlike GShard's first-choices-first); fixed shapes [B, E, C, D], so
            the expert axis is split by GSPMD with one all-to-all there and one back (`moe_batch` ->
            `act_experts`); a token an expert has no room for gets nothing from it (counted as
            `moe_dropped`). The expert-parallel path and XLA:CPU's fast one.
  dropless  every assignment, sorted by expert, through grouped matmuls (jax.lax.ragged_dot). Exact;
            on XLA:CPU ragged_dot computes every group densely, so it is the GPU path. Under an expert
            axis > 1 XLA gathers the sorted tokens instead of exchanging them (no ragged all-to-all on
            CPU): use capacity there.
  every     every expert on every token, the top-k kept: the reference the others are tested against,
            and the fork a user would write first (E / top_k times the FLOPs).
Inference (model/kv_cache.py: sampling and the task evaluators) routes dropless whatever the module's
routing: a capacity counted from a prompt's few tokens drops assignments a training sequence's would
hold, and an imported Mixtral or Qwen3-MoE computes its function with none dropped.

Routing groups are single sequences: which tokens an expert takes depends on that sequence alone, so
the layer computes the same on any mesh, with any microbatch count, and verify's additivity holds.

The auxiliary losses are sums over valid tokens (`mask`), like the cross-entropy they are added to
(experiments/lm.py), so that their weights mean the same at any batch size, mesh or microbatch count:
  balance   Switch's E x sum_e f_e P_e per sequence (f_e: the share of the sequence's top-k assignments
            that go to e; P_e: its mean router probability), weighed by the sequence's valid tokens.
            1.0 when balanced; additive over sequences, unlike the global-batch form.
  router_z  logsumexp of the router logits, squared, per token (ST-MoE's router z-loss).
Per layer, also: each expert's share of the assignments (`load`, sums to 1 per token), the router's
entropy and the share of assignments dropped.

Shapes: B batch, L sequence, D embed, E experts, C capacity, F expert hidden, K top_k.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import SwiGLU, param
from model.partitioning import constrain

_init = nnx.initializers
ROUTINGS = ("capacity", "dropless", "every")
SCORES = ("softmax", "sigmoid")
AUX_SUMS = ("balance", "router_z", "router_entropy", "dropped")  # Scalars; `load` is [E].


def capacity(seq_len: int, top_k: int, num_experts: int, factor: float) -> int:
  """Slots per expert per sequence: at most seq_len (an expert takes each token at most once)."""
  return max(1, min(seq_len, math.ceil(factor * seq_len * top_k / num_experts)))


def top_k(scores, k: int):
  """jax.lax.top_k's (values, indices) over the last axis, ties to the lower index, by a stable sort:
  XLA's SPMD partitioner gathers top_k's operand whole onto every device (the router's [B, L, E] scores
  of the global batch: 0.5 GB per layer and pass on Qwen3-30B-A3B's shapes over 64 devices), while a
  sort along an unsplit axis stays on each device's own rows."""
  chosen = jnp.argsort(-scores, axis=-1, stable=True)[..., :k]
  return jnp.take_along_axis(scores, chosen, axis=-1), chosen


def zero_aux(num_experts: int) -> dict:
  return {**{k: jnp.zeros((), jnp.float32) for k in AUX_SUMS}, "load": jnp.zeros(num_experts, jnp.float32)}


class MoE(nnx.Module):
  def __init__(
    self,
    dim: int,
    expert_dim: int,
    num_experts: int,
    top_k: int,
    *,
    shared_dim: int = 0,
    score: str = "softmax",
    renormalize: bool = True,
    routing: str = "capacity",
    capacity_factor: float = 1.25,
    rngs: nnx.Rngs,
  ):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    if routing not in ROUTINGS or score not in SCORES:
      raise ValueError(f"routing {routing!r} / score {score!r}: use one of {ROUTINGS} / {SCORES}")
    self.router = param(rngs, _init.lecun_normal(), (dim, num_experts), ("embed", None))
    w = _init.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.gate = param(rngs, w, (num_experts, dim, expert_dim), ("experts", "embed", "mlp"))
    self.up = param(rngs, w, (num_experts, dim, expert_dim), ("experts", "embed", "mlp"))
    self.down = param(rngs, w, (num_experts, expert_dim, dim), ("experts", "mlp", "embed"))
    self.shared = SwiGLU(dim, shared_dim, rngs=rngs) if shared_dim else None
    self.num_experts, self.top_k = num_experts, top_k
    self.score, self.renormalize = score, renormalize
    self.routing, self.capacity_factor = routing, capacity_factor

  def __call__(self, x, mask=None, routing: str | None = None):
    """x [B, L, D], mask [B, L] (1: a token whose loss counts; None: all) -> (y [B, L, D], aux sums).
    `routing`: this call's, in place of the module's (inference's dropless: model/kv_cache.py)."""
    b, n, _ = x.shape
    mask = jnp.ones((b, n), jnp.float32) if mask is None else mask.astype(jnp.float32)
    logits = jnp.einsum("bld,de->ble", x.astype(jnp.float32), self.router[...])  # The router in float32.
    probs = jax.nn.softmax(logits, axis=-1) if self.score == "softmax" else jax.nn.sigmoid(logits)
    weights, chosen = top_k(probs, self.top_k)  # [B, L, K]
    if self.renormalize:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    routes = {"capacity": self._capacity, "dropless": self._dropless, "every": self._every}
    y, kept = routes[routing or self.routing](x, chosen, weights.astype(x.dtype))
    if self.shared is not None:
      y = y + self.shared(x)
    return y, self._aux(logits, probs, chosen, kept, mask)

  def _experts(self, x, experts, rows):
    """SwiGLU of each expert on its own rows: x [B, E, C, D] -> [B, E, C, D], computed as [E, B x C, D]
    (one batched matmul per expert: with the batch ahead of the experts XLA:CPU's matmuls took several
    times as long, benchmarks/maxtext_peer.py --moe). `experts` and `rows` name the E and merged B x C
    axes."""
    b, e, c, d = x.shape
    dt = x.dtype
    xe = jnp.swapaxes(x, 0, 1).reshape(e, b * c, d)
    h = jax.nn.silu(jnp.einsum("end,edf->enf", xe, self.gate[...].astype(dt)))
    h = h * jnp.einsum("end,edf->enf", xe, self.up[...].astype(dt))
    h = constrain(h, (experts, rows, "act_mlp"))
    out = jnp.einsum("enf,efd->end", h, self.down[...].astype(dt))
    return jnp.swapaxes(out.reshape(e, b, c, d), 0, 1)

  def _every(self, x, chosen, weights):
    out = self._experts(jnp.broadcast_to(x[:, None], (x.shape[0], self.num_experts, *x.shape[1:])), *_EXPERT)
    gates = jnp.sum(jax.nn.one_hot(chosen, self.num_experts, dtype=x.dtype) * weights[..., None], axis=2)
    return jnp.einsum("beld,ble->bld", out, gates), jnp.ones(chosen.shape, bool)

  def _capacity(self, x, chosen, weights):
    b, n, d = x.shape
    e, k = self.num_experts, self.top_k
    c = capacity(n, k, e, self.capacity_factor)
    # Each assignment's place in its expert's queue, in token order (a token's choices in rank order):
    # causal, so which slots position t gets depends on positions <= t alone (generation sees what
    # training saw), and right padding never takes a valid token's slot.
    onehot = jax.nn.one_hot(chosen.reshape(b, n * k), e, dtype=jnp.int32)  # [B, LK, E]
    place = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1).reshape(b, n, k)
    kept = place < c
    # Which token fills each slot of each expert (n: none, a zero row); a slot index past the end drops.
    slot = chosen * c + jnp.where(kept, place, e * c)
    tokens = jnp.repeat(jnp.arange(n), k)  # Each assignment's token, in slot.ravel()'s order.
    table = jax.vmap(lambda s: jnp.full(e * c, n).at[s.ravel()].set(tokens, mode="drop"))(slot)
    rows = jnp.take_along_axis(jnp.pad(x, ((0, 0), (0, 1), (0, 0))), table[..., None], axis=1)
    rows = constrain(rows.reshape(b, e, c, d), ("batch", None, None, "act_embed"))
    out = self._experts(constrain(rows, _DISPATCHED), *_EXPERT_ROWS)  # The all-to-all there ...
    out = constrain(constrain(out, _DISPATCHED), ("batch", None, None, "act_embed"))  # ... and back.
    picked = jnp.take_along_axis(out.reshape(b, e * c, d), jnp.minimum(slot, e * c - 1).reshape(b, -1, 1), 1)
    picked = picked.reshape(b, n, k, d) * (weights * kept)[..., None]
    return jnp.sum(picked, axis=2), kept

  def _dropless(self, x, chosen, weights):
    b, n, d = x.shape
    k, dt = self.top_k, x.dtype
    experts = chosen.reshape(-1)  # [BLK]
    order = jnp.argsort(experts, stable=True)
    rows = jnp.take(x.reshape(b * n, d), order // k, axis=0)
    sizes = jnp.bincount(experts, length=self.num_experts).astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(rows, self.gate[...].astype(dt), sizes))
    h = h * jax.lax.ragged_dot(rows, self.up[...].astype(dt), sizes)
    out = jax.lax.ragged_dot(h, self.down[...].astype(dt), sizes)
    out = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(b, n, k, d)
    return jnp.sum(out * weights[..., None], axis=2), jnp.ones(chosen.shape, bool)

  def _aux(self, logits, probs, chosen, kept, mask) -> dict:
    """This layer's auxiliary sums over the tokens of `mask` (module docstring)."""
    e, k = self.num_experts, self.top_k
    assigned = jnp.sum(jax.nn.one_hot(chosen, e, dtype=jnp.float32), axis=2) / k  # [B, L, E], rows sum 1
    dist = probs / jnp.sum(probs, axis=-1, keepdims=True)  # Sigmoid scores as a distribution too.
    tokens = jnp.maximum(jnp.sum(mask, axis=1), 1.0)  # [B]
    share = jnp.einsum("ble,bl->be", assigned, mask) / tokens[:, None]
    mean_prob = jnp.einsum("ble,bl->be", dist, mask) / tokens[:, None]
    per_sequence = e * jnp.sum(share * mean_prob, axis=-1)  # [B]; 1.0 when balanced.
    entropy = -jnp.sum(dist * jnp.log(jnp.maximum(dist, 1e-30)), axis=-1)
    return {
      "balance": jnp.sum(per_sequence * jnp.sum(mask, axis=1)),
      "router_z": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * mask),
      "router_entropy": jnp.sum(entropy * mask),
      "dropped": jnp.sum(jnp.sum(~kept, axis=-1) / k * mask),
      "load": jnp.einsum("ble,bl->e", assigned, mask),
    }


# Dispatched rows [B, E, C, D]: the batch over data x fsdp only, the experts over `expert`.
_DISPATCHED = ("moe_batch", "act_experts", None, "act_embed")
# The experts' hidden activations [E, B x C, F]: capacity's routed rows, the experts split; `every`'s
# (every token, C = L), split as the tokens are.
_EXPERT_ROWS = ("act_experts", "moe_batch")
_EXPERT = (None, "batch")
