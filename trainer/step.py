"""The jitted train and eval steps.

Invariant 1 lives here: the experiment returns (loss_sum, valid_count, metric sums) over the
global batch; microbatches add sums and counts; the gradient of the sum is divided by the global
count once. No local mean is ever taken, so padding and empty shards do not move the objective.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from trainer import state as state_lib
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


class StateLost(UserError):
  """A variable loss_sums wrote in training that the train state cannot keep."""


def kept_variables(model, before: dict) -> dict:
  """While tracing: the model's variables after loss_sums ran, to be kept in the train state. One it
  created, or whose shape or dtype it changed, has no place there: an error naming it, never a silent
  drop."""
  after = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
  was = {"/".join(state_lib.path_keys(p)): x for p, x in jax.tree_util.tree_flatten_with_path(before)[0]}
  bad = []
  for path, x in jax.tree_util.tree_flatten_with_path(after)[0]:
    name = "/".join(state_lib.path_keys(path))
    old = was.get(name)
    if old is None:
      bad.append(f"{name} (created in loss_sums: create it in build_model, or do not store it)")
    elif (jnp.shape(x), jnp.result_type(x)) != (jnp.shape(old), jnp.result_type(old)):
      shaped = lambda v: f"{jnp.result_type(v)}{list(jnp.shape(v))}"
      bad.append(f"{name} (now {shaped(x)}, built {shaped(old)})")
  if bad or jax.tree.structure(after) != jax.tree.structure(before):
    bad = bad or ["a variable of the built model is gone"]
    raise StateLost(
      f"loss_sums changed the model's variable {'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} in "
      "training: the train state keeps the variables the model was built with, as they were built, so "
      "the change would be lost after the step"
    )
  return after


def sums_and_grads(loss_sums, mdef: ModelDef, params, variables, batch, rng, rules):
  """(loss_sum, count, metric sums, gradient sums, the variables as the forward pass left them)."""

  def f(p):
    with nnx.logical_axis_rules(rules):
      model = mdef.merge(p, variables)
      loss_sum, count, metric_sums = loss_sums_checked(loss_sums, model, batch, rng)
      written = kept_variables(model, variables)
    return loss_sum, (count, metric_sums, written)

  (loss_sum, (count, metric_sums, written)), grad_sums = jax.value_and_grad(f, has_aux=True)(params)
  return loss_sum, count, metric_sums, grad_sums, jax.lax.stop_gradient(written)


def example_keys(base_key, step, batch_size: int):
  """uint32[B, 2]: one key per row of the global batch, from (seed, step, row): the same bits for an
  example whatever the mesh, process count or microbatch split."""
  step_key = jax.random.fold_in(base_key, step)
  return jax.vmap(lambda i: jax.random.fold_in(step_key, i))(jnp.arange(batch_size))


def _split_microbatches(batch, m: int):
  """[B, ...] -> [m, B/m, ...] with microbatch i = rows i, i+m, ...: every shard keeps rows in all."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)


class _StepsBound:
  """A jitted train step, its lowering or its compiled program, with the run's length given as its
  last argument: called, lowered and compiled as `(state, batch)`; anything else is the wrapped one's."""

  def __init__(self, wrapped, steps):
    self._wrapped, self._steps = wrapped, steps

  def __call__(self, state, batch):
    return self._wrapped(state, batch, self._steps)

  def lower(self, state, batch):
    return _StepsBound(self._wrapped.lower(state, batch, self._steps), self._steps)

  def compile(self):
    return _StepsBound(self._wrapped.compile(), self._steps)

  def __getattr__(self, name):
    return getattr(self._wrapped, name)


def make_train_step(comp, microbatches: int, with_grads: bool = False):
  """jit(train_step) on comp's shardings; the state is donated. `with_grads` also returns the
  divided, unclipped gradients and the params' update (for --mode=verify and checks.first_step).
  The run's length (comp.steps) is an argument of the program, not a constant in it: runs that differ
  only in `steps` share their compiled programs (and the persistent cache's).

  The variables (BatchNorm's running statistics, say) go through the microbatches in order: each
  microbatch's forward pass starts from what the one before it left, as consecutive steps would."""
  loss_sums, mdef, tx, rules, decay = comp.loss_sums, comp.mdef, comp.tx, comp.rules, comp.ema_decay
  # [m, B/m, ...]: each microbatch is split over the batch axes like a whole batch.
  micro_sharding = NamedSharding(comp.mesh, P(None, *comp.batch_sharding.spec))

  def train_step(state: TrainState, batch, steps):
    b = jax.tree.leaves(batch)[0].shape[0]
    rng = jax.lax.with_sharding_constraint(example_keys(state.rng, state.step, b), comp.batch_sharding)
    grads_of = lambda v, mb, r: sums_and_grads(loss_sums, mdef, state.params, v, mb, r, rules)
    if microbatches == 1:
      loss_sum, count, metric_sums, grad_sums, variables = grads_of(state.variables, batch, rng)
    else:
      micro = jax.lax.with_sharding_constraint(
        _split_microbatches((batch, rng), microbatches), micro_sharding
      )
      first = jax.tree.map(lambda x: x[0], micro)
      sums = jax.eval_shape(grads_of, state.variables, *first)[:4]
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums)

      def add(carry, mb):
        *out, variables = grads_of(carry[1], *mb)
        return (jax.tree.map(jnp.add, carry[0], tuple(out)), variables), None

      ((loss_sum, count, metric_sums, grad_sums), variables), _ = jax.lax.scan(
        add, (zeros, state.variables), micro
      )
    # Divide once, by the global count (the host has rejected a globally empty batch).
    grads = jax.tree.map(lambda g: g / count, grad_sums)
    updates, opt_state = tx.update(grads, state.opt_state, state.params, steps=steps)
    params = optax.apply_updates(state.params, updates)
    # Not debiased: the average starts at the initial params (trainer/state.py).
    average = lambda e, p: decay * e + (1 - decay) * p.astype(e.dtype)
    ema = jax.tree.map(average, state.ema, params) if state.ema else {}
    grad_norm = optax.tree.norm(grads)
    metrics = {
      "loss": loss_sum / count,
      "count": count,
      "grad_norm": grad_norm,
      # The divided gradients' norm is finite only if every summed gradient is and the count is not 0
      # (0 divides 0 by 0: the parameters would turn NaN while the sums stay finite).
      "finite": jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm) & (count > 0),
      "learning_rate": comp.learning_rate(state.step, steps),
      **{k: v / count for k, v in metric_sums.items()},
    }
    if with_grads:
      metrics["grads"] = grads
      metrics["updates"] = jax.tree.map(jnp.subtract, params, state.params)
    new_state = state.replace(
      step=state.step + 1, params=params, variables=variables, opt_state=opt_state, ema=ema
    )
    return new_state, metrics

  jitted = jax.jit(
    train_step,
    in_shardings=(comp.shardings, comp.batch_sharding, NamedSharding(comp.mesh, P())),
    out_shardings=(comp.shardings, None),
    donate_argnums=0,
  )
  return _StepsBound(jitted, jax.device_put(np.int32(comp.steps), NamedSharding(comp.mesh, P())))


def make_eval_step(comp):
  """Returns sums and counts; the caller adds them over eval batches and divides once."""
  loss_sums, mdef, rules = comp.loss_sums, comp.mdef, comp.rules

  def eval_step(params, variables, batch):
    with nnx.logical_axis_rules(rules):
      model = mdef.merge(params, variables)
      loss_sum, count, metric_sums = loss_sums_checked(loss_sums, model, batch, None)
    return {"loss": loss_sum, "count": count, **metric_sums}

  sh = comp.shardings
  return jax.jit(eval_step, in_shardings=(sh.params, sh.variables, comp.batch_sharding))
