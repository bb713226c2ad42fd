"""optax AdamW with linear warm-up, cosine (or constant) decay and global-norm clipping; its two
moments kept in float32 (optax.adamw itself) or in bfloat16 (half their memory, `scale_by_adam`)."""

import jax
import jax.numpy as jnp
import optax

from errors import UserError


def make_schedule(opt, steps: int) -> optax.Schedule:
  """Learning rate of the update that completes step count + 1: the first step already moves."""
  base = _base_schedule(opt, steps)
  return lambda count: base(count + 1)


def _base_schedule(opt, steps: int) -> optax.Schedule:
  warmup = min(opt.warmup_steps, steps)
  if opt.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=opt.learning_rate,
      warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1),
      end_value=opt.learning_rate * opt.end_factor,
    )
  if opt.schedule == "constant":
    return optax.join_schedules(
      [
        optax.linear_schedule(0.0, opt.learning_rate, warmup),
        optax.constant_schedule(opt.learning_rate),
      ],
      [warmup],
    )
  raise UserError(f"optimizer.schedule={opt.schedule!r}: use 'cosine' or 'constant'")


def decays(shape, logical_axes=()) -> bool:
  """Weight decay on matrices only: norms' scales and biases (rank 1) keep their value. Rank counts
  without a leading `layers` axis, so a scanned model's stacked scales [layers, D] are not decayed."""
  return len(shape) - sum(name == "layers" for name in logical_axes) > 1


def make_optimizer(
  opt, steps: int, logical_specs=None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """`logical_specs`: the params' logical axis names (a tree like params), for `decays`."""
  if opt.name != "adamw":
    raise UserError(f"optimizer.name={opt.name!r}: only 'adamw' is available")
  schedule = make_schedule(opt, steps)

  def decay_mask(params):
    if logical_specs is None:
      return jax.tree.map(lambda p: decays(p.shape), params)
    return jax.tree.map(lambda p, names: decays(p.shape, tuple(names)), params, logical_specs)

  if opt.moments_dtype == "float32":
    adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask)
  else:  # optax.adamw's chain with both moments stored in the narrower dtype.
    adamw = optax.chain(
      scale_by_adam(opt.b1, opt.b2, jnp.dtype(opt.moments_dtype)),
      optax.add_decayed_weights(opt.weight_decay, decay_mask),
      optax.scale_by_learning_rate(schedule),
    )
  clip = optax.clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm > 0 else optax.identity()
  return optax.chain(clip, adamw), schedule


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
