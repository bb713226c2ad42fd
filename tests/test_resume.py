"""An interrupted run resumed from its checkpoint continues exactly (bitwise) as if never stopped."""

import collections
import logging
import re

import jax

from tests.conftest import tiny_config, train_losses
from trainer.observe import metrics
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


def test_resume_on_changed_data_is_refused_unless_allowed(tmp_path):
  import pytest

  from errors import UserError

  train(tiny_config(steps=4), str(tmp_path), stop_after=2)
  changed = tiny_config(steps=4, **{"data.num_examples": 5000})
  with pytest.raises(UserError, match="data changed since checkpoint 2.*allow_changed_data"):
    train(changed, str(tmp_path))
  changed.data.allow_changed_data = True
  assert train(changed, str(tmp_path))["final_step"] == 4


def test_a_metrics_line_torn_by_a_kill_is_dropped_on_resume(tmp_path):
  import os

  config = tiny_config(steps=4)
  train(config, str(tmp_path), stop_after=2)
  with open(os.path.join(tmp_path, "metrics.jsonl"), "a") as f:
    f.write('{"step": 3, "loss": 1.2')  # A kill in the middle of writing step 3's row.
  train(config, str(tmp_path))
  assert sorted(train_losses(str(tmp_path))) == [1, 2, 3, 4]


def test_resuming_with_another_seed_or_batch_is_refused_unless_allowed_and_steps_warns(tmp_path, capsys):
  import pytest

  from errors import UserError

  train(tiny_config(steps=4), str(tmp_path), stop_after=2)
  for key, value in (("seed", 7), ("global_batch_size", 32)):
    with pytest.raises(UserError, match=rf"{key} changed .* since checkpoint 2: .*allow_changed_keys={key}"):
      train(tiny_config(steps=4, **{key: value}), str(tmp_path))
  capsys.readouterr()
  # The synthetic source is drawn from the seed: its data changed too, and is allowed separately.
  allowed = tiny_config(
    steps=6, seed=7, **{"checkpoint.allow_changed_keys": "seed", "data.allow_changed_data": True}
  )
  assert train(allowed, str(tmp_path))["final_step"] == 6
  out = capsys.readouterr().out
  assert "warning: seed changed 0 -> 7 since checkpoint 2 (accepted)" in out
  assert "warning: steps changed 4 -> 6 since checkpoint 2: the learning-rate schedule" in out


def test_the_resume_policy_judges_every_kind_of_key():
  import pytest

  from errors import UserError
  from trainer.config import assemble, resume

  declared = assemble.declared("lm")

  saved = {"seed": 0, "steps": 4, "mesh": {"data": 2}, "data": {"path": "a"}, "optimizer": {"b1": 0.9}}
  now = {"seed": 0, "steps": 4, "mesh": {"data": 4}, "data": {"path": "b"}, "optimizer": {"b1": 0.8}}
  (warning,) = resume.check(saved, now, 2, "", declared)  # mesh: free; data: the fingerprint decides.
  assert warning.startswith("warning: optimizer.b1 changed 0.9 -> 0.8 since checkpoint 2")
  with pytest.raises(UserError, match="experiment changed 'lm' -> 'vit'"):
    resume.check({"experiment": "lm"}, {"experiment": "vit"}, 2, "seed", declared)
