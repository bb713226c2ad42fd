"""optax AdamW with linear warm-up, cosine (or constant) decay and global-norm clipping."""

import jax
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

  adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=decay_mask)
  clip = optax.clip_by_global_norm(opt.grad_clip_norm) if opt.grad_clip_norm > 0 else optax.identity()
  return optax.chain(clip, adamw), schedule
