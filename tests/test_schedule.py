"""The learning-rate schedule: optax's warm-up and cosine (or constant) decay, with the run's length an
argument of the train step rather than a constant in it, so runs that differ only in `steps` (a longer
run, a resume with more) share one compiled program."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax
import pytest

from tests.conftest import tiny_config
from trainer import components
from trainer import state as state_lib
from trainer.optimizer import learning_rate
from trainer.step import make_train_step


def _optax_schedule(opt, steps):
  """What optax builds with `steps` fixed, shifted as the trainer's: update count c completes step c + 1."""
  warmup = min(opt.warmup_steps, steps)
  if opt.schedule == "cosine":
    end = opt.learning_rate * opt.end_factor
    base = optax.warmup_cosine_decay_schedule(0.0, opt.learning_rate, warmup, max(steps, warmup + 1), end)
  else:
    rising = optax.linear_schedule(0.0, opt.learning_rate, warmup)
    base = optax.join_schedules([rising, optax.constant_schedule(opt.learning_rate)], [warmup])
  return lambda count: base(count + 1)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_the_rate_is_optaxs_at_every_step_of_every_length(schedule):
  for warmup in (0, 2, 10):
    for steps in (1, 3, 6, 20, 100):
      opt = SimpleNamespace(schedule=schedule, warmup_steps=warmup, learning_rate=3e-3, end_factor=0.1)
      reference = _optax_schedule(opt, steps)
      for count in range(steps + 2):
        ours = learning_rate(opt, jnp.int32(count), jnp.int32(steps))
        assert float(ours) == pytest.approx(float(reference(jnp.int32(count))), rel=1e-6), (
          warmup,
          steps,
          count,
        )


def test_runs_that_differ_only_in_steps_lower_to_one_program():
  def lowered(steps):
    comp, batch = components.build_for_compile(tiny_config(steps=steps))
    target = state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx)
    with jax.set_mesh(comp.mesh):
      return make_train_step(comp, 1).lower(target, batch).as_text()

  assert lowered(6) == lowered(1000)
