"""optax AdamW with linear warm-up, cosine (or constant) decay and global-norm clipping; its two
moments kept in float32 (optax's scale_by_adam) or in bfloat16 (half their memory, `scale_by_adam`).
The run's length is an argument of each update, so the compiled step does not depend on it."""

import jax
import jax.numpy as jnp
import optax

from errors import UserError

SCHEDULES = ("cosine", "constant")


def _check_schedule(opt) -> None:
  if opt.schedule not in SCHEDULES:
    raise UserError(f"optimizer.schedule={opt.schedule!r}: use 'cosine' or 'constant'")


def learning_rate(opt, count, steps):
  """The rate of the update that completes step count + 1 of a run of `steps` steps (the first step
  already moves): linear warm-up from 0, then cosine decay to end_factor (or constant). Both may be
  traced: `steps` is an argument of the train step, not a constant in it, so a run with another
  `steps` (longer, or resumed with more) runs the programs compiled before."""
  _check_schedule(opt)
  t = jnp.asarray(count, jnp.float32) + 1
  steps = jnp.asarray(steps, jnp.float32)
  peak = opt.learning_rate
  warmup = jnp.minimum(float(opt.warmup_steps), steps)
  rising = peak * (jnp.clip(t, 0, warmup) / jnp.maximum(warmup, 1.0))
  if opt.schedule == "constant":
    return jnp.where(t < warmup, rising, peak)
  alpha = opt.end_factor if peak else 0.0
  decay = jnp.maximum(steps, warmup + 1) - warmup
  done = jnp.minimum(t - warmup, decay) / decay
  return jnp.where(t < warmup, rising, peak * ((1 - alpha) * 0.5 * (1 + jnp.cos(jnp.pi * done)) + alpha))


def scale_by_learning_rate(opt) -> optax.GradientTransformationExtraArgs:
  """optax.scale_by_learning_rate(schedule), the run's `steps` given to each update
  (`tx.update(..., steps=S)`) instead of built into the schedule. Its state is optax's
  ScaleByScheduleState, as optax.adamw's, so checkpoints keep one layout."""

  def init(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, steps, **extra_args):
    del params, extra_args
    step_size = -learning_rate(opt, state.count, steps)
    updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init, update)


def decays(shape, logical_axes=()) -> bool:
  """Weight decay on matrices only: norms' scales and biases (rank 1) keep their value. Rank counts
  without a leading `layers` axis, so a scanned model's stacked scales [layers, D] are not decayed."""
  return len(shape) - sum(name == "layers" for name in logical_axes) > 1


def make_optimizer(opt, logical_specs=None) -> optax.GradientTransformationExtraArgs:
  """`logical_specs`: the params' logical axis names (a tree like params), for `decays`. Its update
  takes the run's length: `tx.update(grads, state, params, steps=S)`."""
  if opt.name != "adamw":
    raise UserError(f"optimizer.name={opt.name!r}: only 'adamw' is available")
  _check_schedule(opt)  # An unknown schedule is one error line here, not one inside the step.

  def decay_mask(params):
    if logical_specs is None:
      return jax.tree.map(lambda p: decays(p.shape), params)
    return jax.tree.map(lambda p, names: decays(p.shape, tuple(names)), params, logical_specs)

  # optax.adamw's chain; float32 moments are optax's scale_by_adam, narrower ones ours.
  if opt.moments_dtype == "float32":
    adam = optax.scale_by_adam(opt.b1, opt.b2)
  else:
    adam = scale_by_adam(opt.b1, opt.b2, jnp.dtype(opt.moments_dtype))
  adamw = optax.chain(
    adam, optax.add_decayed_weights(opt.weight_decay, decay_mask), scale_by_learning_rate(opt)
  )
  clip = optax.clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm > 0 else optax.identity()
  return optax.chain(clip, adamw)


def scale_by_adam(b1: float, b2: float, dtype, eps: float = 1e-8) -> optax.GradientTransformation:
  """optax.scale_by_adam with both moments stored in `dtype` (optax's mu_dtype narrows only the first):
  each update computes in float32 from the stored moments and rounds them back. The state is
  optax.ScaleByAdamState, as optax's, so checkpoints keep one layout."""

  def init(params):
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)

  def update(grads, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    mu = jax.tree.map(lambda m, g: b1 * f32(m) + (1 - b1) * f32(g), state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * f32(v) + (1 - b2) * jnp.square(f32(g)), state.nu, grads)
    c1, c2 = 1 - b1 ** f32(count), 1 - b2 ** f32(count)  # Bias corrections.
    step = lambda m, v, g: ((m / c1) / (jnp.sqrt(v / c2) + eps)).astype(g.dtype)  # noqa: E731
    updates = jax.tree.map(step, mu, nu, grads)
    narrow = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)  # noqa: E731
    return updates, optax.ScaleByAdamState(count=count, mu=narrow(mu), nu=narrow(nu))

  return optax.GradientTransformation(init, update)
