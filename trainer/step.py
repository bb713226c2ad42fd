"""The jitted train and eval steps.

Invariant 1 lives here: the experiment returns (loss_sum, valid_count, metric sums) over the
global batch; microbatches add sums and counts; the gradient of the sum is divided by the global
count once. No local mean is ever taken, so padding and empty shards do not move the objective.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from trainer.state import ModelDef, TrainState


def loss_sums_checked(loss_sums, model, batch, rng):
  """The experiment's loss_sums, with its result checked against the contract while tracing."""
  out = loss_sums(model, batch, rng)
  scalar = lambda x: isinstance(x, jax.Array | float | int) and jnp.shape(x) == ()
  ok = isinstance(out, tuple) and len(out) == 3 and scalar(out[0]) and scalar(out[1])
  ok = ok and isinstance(out[2], dict) and all(scalar(v) for v in out[2].values())
  if not ok:
    got = type(out).__name__ if not isinstance(out, tuple) else f"a tuple of {len(out)}"
    if isinstance(out, jax.Array):
      got = f"an array of shape {out.shape}"
    raise UserError(
      f"loss_sums must return (loss_sum, count, {{metric: sum}}) with scalar sums over the batch, "
      f"got {got}: return sums and the valid count, never a mean (experiments/__init__.py)"
    )
  return out


def _variables(model) -> dict:
  """{path: (variable type, value)} of every variable the model holds beyond its parameters (nnx
  transforms such as nnx.remat hand parameters back as new values: those are not updates)."""
  return {
    "/".join(map(str, path)): (type(v).__name__, v.get_value())
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param)))
  }


def check_nothing_lost(before: dict, model) -> None:
  """While tracing: a variable loss_sums wrote (a BatchNorm's running statistics, an EMA kept in the
  model) would be dropped with the model after the step, silently. The train state keeps only what
  the optimizer updates, so it is an error."""
  after = _variables(model)
  changed = [
    f"{p} ({kind})" for p, (kind, value) in after.items() if p not in before or before[p][1] is not value
  ]
  if changed:
    raise UserError(
      f"loss_sums changed the model's variable {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''} "
      "in training: the trainer keeps only what the optimizer updates, so the change would be lost after "
      "the step; compute it from the batch instead of storing it (a BatchNorm: use_running_average=True)"
    )


def _sums_and_grads(loss_sums, mdef: ModelDef, params, batch, rng, rules):
  def f(p):
    with nnx.logical_axis_rules(rules):
      model = mdef.merge(p)
      before = _variables(model)
      loss_sum, count, metric_sums = loss_sums_checked(loss_sums, model, batch, rng)
      check_nothing_lost(before, model)
    return loss_sum, (count, metric_sums)

  (loss_sum, (count, metric_sums)), grad_sums = jax.value_and_grad(f, has_aux=True)(params)
  return loss_sum, count, metric_sums, grad_sums


def example_keys(base_key, step, batch_size: int):
  """uint32[B, 2]: one key per row of the global batch, from (seed, step, row): the same bits for an
  example whatever the mesh, process count or microbatch split."""
  step_key = jax.random.fold_in(base_key, step)
  return jax.vmap(lambda i: jax.random.fold_in(step_key, i))(jnp.arange(batch_size))


def _split_microbatches(batch, m: int):
  """[B, ...] -> [m, B/m, ...] with microbatch i = rows i, i+m, ...: every shard keeps rows in all."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)


def make_train_step(comp, microbatches: int, with_grads: bool = False):
  """jit(train_step) on comp's shardings; the state is donated. `with_grads` also returns the
  divided gradients (for --mode=verify)."""
  loss_sums, mdef, tx, rules = comp.loss_sums, comp.mdef, comp.tx, comp.rules
  # [m, B/m, ...]: each microbatch is split over the batch axes like a whole batch.
  micro_sharding = NamedSharding(comp.mesh, P(None, *comp.batch_sharding.spec))

  def train_step(state: TrainState, batch):
    b = jax.tree.leaves(batch)[0].shape[0]
    rng = jax.lax.with_sharding_constraint(example_keys(state.rng, state.step, b), comp.batch_sharding)
    grads_of = lambda mb, r: _sums_and_grads(loss_sums, mdef, state.params, mb, r, rules)
    if microbatches == 1:
      loss_sum, count, metric_sums, grad_sums = grads_of(batch, rng)
    else:
      micro = jax.lax.with_sharding_constraint(
        _split_microbatches((batch, rng), microbatches), micro_sharding
      )
      first = jax.tree.map(lambda x: x[0], micro)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grads_of, *first))
      add = lambda carry, mb: (jax.tree.map(jnp.add, carry, grads_of(*mb)), None)
      (loss_sum, count, metric_sums, grad_sums), _ = jax.lax.scan(add, zeros, micro)
    # Divide once, by the global count (the host has rejected a globally empty batch).
    grads = jax.tree.map(lambda g: g / count, grad_sums)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    metrics = {
      "loss": loss_sum / count,
      "count": count,
      "grad_norm": grad_norm,
      # The divided gradients' norm is finite only if every summed gradient is and the count is not 0
      # (0 divides 0 by 0: the parameters would turn NaN while the sums stay finite).
      "finite": jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm) & (count > 0),
      "learning_rate": comp.schedule(state.step),
      **{k: v / count for k, v in metric_sums.items()},
    }
    if with_grads:
      metrics["grads"] = grads
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  return jax.jit(
    train_step,
    in_shardings=(comp.shardings, comp.batch_sharding),
    out_shardings=(comp.shardings, None),
    donate_argnums=0,
  )


def make_eval_step(comp):
  """Returns sums and counts; the caller adds them over eval batches and divides once."""
  loss_sums, mdef, rules = comp.loss_sums, comp.mdef, comp.rules

  def eval_step(params, batch):
    with nnx.logical_axis_rules(rules):
      loss_sum, count, metric_sums = loss_sums_checked(loss_sums, mdef.merge(params), batch, None)
    return {"loss": loss_sum, "count": count, **metric_sums}

  return jax.jit(eval_step, in_shardings=(comp.shardings.params, comp.batch_sharding))
