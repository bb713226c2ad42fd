"""An interrupted run resumed from its checkpoint continues exactly (bitwise) as if never stopped."""

import collections
import logging
import re

import jax

from tests.conftest import tiny_config, train_losses
from trainer import metrics
from trainer.train import train


def _compiled(caplog, run) -> collections.Counter:
  """How many times each jitted function compiled during run()."""
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jax._src.dispatch"), jax.log_compiles(True):
    run()
  return collections.Counter(re.findall(r"Finished XLA compilation of jit\((\w+)\)", caplog.text))


def test_resume_is_bitwise_identical_and_each_run_compiles_its_step_once(tmp_path, caplog):
  config = tiny_config(steps=7, **{"checkpoint.every": 3, "eval_every": 2})
  train(config, str(tmp_path / "straight"))

  first = _compiled(caplog, lambda: train(config, str(tmp_path / "interrupted"), stop_after=4))
  assert max(train_losses(str(tmp_path / "interrupted"))) == 4
  resumed = _compiled(caplog, lambda: train(config, str(tmp_path / "interrupted")))
  # Over 4 steps, then 3 more after the restore (two evaluations each): nothing compiles twice.
  for run in (first, resumed):
    assert run["train_step"] == 1 and run["eval_step"] == 1 and max(run.values()) == 1, run

  straight = train_losses(str(tmp_path / "straight"))
  resumed = train_losses(str(tmp_path / "interrupted"))
  assert sorted(resumed) == list(range(1, 8))
  assert resumed == straight  # Exact equality, every step after the interruption included.


def _host_fetches_inside_steps(monkeypatch) -> list:
  """Records every device-to-host fetch of a jax.Array (all go through ArrayImpl._value) made while
  the loop's per-step guard is on. XLA:CPU ignores jax.transfer_guard (the arrays already live in
  host memory), so on CPU this count stands in for the error a GPU run would raise."""
  from jax._src import array as jax_array
  from jax._src import config as jax_config

  seen, value = [], jax_array.ArrayImpl._value

  def counting(self):
    if jax_config.transfer_guard_device_to_host.value == "disallow_explicit":
      seen.append(self.shape)
    return value.fget(self)

  monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counting))
  return seen


def test_steps_that_do_not_log_copy_nothing_to_the_host(tmp_path, monkeypatch):
  seen = _host_fetches_inside_steps(monkeypatch)
  train(tiny_config(steps=6, log_every=3, **{"checkpoint.every": 2}), str(tmp_path))
  assert seen == []
  # A hidden sync in every step (a float() of the loss, say) is seen.
  add_step = metrics.Window.add_step

  def syncing(self, step, *args, metrics, **kw):
    float(metrics["loss"])
    return add_step(self, step, *args, metrics=metrics, **kw)

  monkeypatch.setattr(metrics.Window, "add_step", syncing)
  train(tiny_config(steps=2), str(tmp_path / "syncing"))
  assert len(seen) == 2
