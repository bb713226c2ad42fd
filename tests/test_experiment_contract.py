"""The experiment contract is checked, not assumed, and the trainer knows no experiment's concepts."""

import dataclasses
import functools
import glob
import os
import re
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

import experiments
from data.pipeline import PAD, BatchPlan, LocalBatches
from errors import UserError
from experiments import lm
from tests.conftest import REPO, patch_experiment, run_main, tiny_config
from trainer import components
from trainer import experiment as experiment_lib
from trainer.train import train

LM_WORDS = re.compile(r"token|seq_len|vocab|\bpad\b|pad_id|\beos", re.IGNORECASE)


def test_the_trainer_knows_no_language_model_concept():
  hits = []
  for path in glob.glob(os.path.join(REPO, "trainer", "**", "*.py"), recursive=True):
    with open(path) as f:
      hits += [
        f"{os.path.relpath(path, REPO)}:{i}: {line.strip()}"
        for i, line in enumerate(f, 1)
        if LM_WORDS.search(line)
      ]
  assert not hits, "\n".join(hits)


def test_no_python_file_is_over_400_lines():
  # The project's own files: not what git ignores (.venv, runs, build/ with a peer's sources in it).
  git = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"]
  listed = subprocess.run(git, cwd=REPO, capture_output=True, text=True)
  paths = [os.path.join(REPO, p) for p in listed.stdout.split()] if listed.returncode == 0 else []
  paths = paths or glob.glob(os.path.join(REPO, "**", "*.py"), recursive=True)
  long = [p for p in paths if ".venv" not in p and "/runs/" not in p and sum(1 for _ in open(p)) > 400]
  assert not long, long


def test_an_experiment_is_named_by_module_or_path():
  for name in (
    "lm",
    "experiments.lm",
    "experiments/lm.py",
    "experiments/lm/",
    os.path.join(REPO, "experiments/lm.py"),
  ):
    assert experiments.module_name(name) == "lm", name
  with pytest.raises(
    UserError, match=r"no experiments/no_such_experiment.py \(available: [^)]*\blm\b[^)]*\bvit\b"
  ) as e:
    experiment_lib.load("experiments/no_such_experiment.py")
  assert "new" not in str(e.value)  # The fork command is not an experiment.
  with pytest.raises(UserError, match="lives in experiments/"):
    experiment_lib.load("elsewhere/mine.py")


def test_a_missing_part_of_the_contract_is_named_and_an_old_style_module_is_told_what_to_change(monkeypatch):
  with pytest.raises(
    UserError, match="Experiment\\(...\\) lacks LOGICAL_AXES, check_config, data_sources of the"
  ):
    experiment_lib.Experiment(UNIT="images", build_model=print, loss_sums=print)
  with pytest.raises(UserError, match="UNIT must be a lower-case word"):
    dataclasses.replace(lm.EXPERIMENT, UNIT="Tokens")
  monkeypatch.delattr(lm, "EXPERIMENT")  # The names alone, as the contract was before.
  with pytest.raises(
    UserError, match=r"experiments/lm.py defines no EXPERIMENT = trainer.experiment.Experiment"
  ):
    experiment_lib.load("lm")


def test_a_config_built_for_another_experiment_is_refused():
  with pytest.raises(
    UserError, match=r"experiment='vit' needs config keys data.image_size.*get_config\('vit'\)"
  ):
    components.build(tiny_config(experiment="vit"))


@pytest.mark.parametrize(
  "returns, fragment",
  [
    (lambda xent, w: (jnp.mean(xent * w), jnp.float32(1.0)), "a tuple of 2"),
    (lambda xent, w: jnp.sum(xent * w), "array of shape ()"),
    (lambda xent, w: (jnp.sum(xent * w, axis=1), jnp.sum(w), {}), "a tuple of 3"),
  ],
)
def test_loss_sums_that_breaks_the_contract_is_one_user_error(tmp_path, monkeypatch, returns, fragment):
  def broken(model, batch, rng):
    logits = model(batch["inputs"])
    xent = -jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return returns(xent, batch["weights"])

  patch_experiment(monkeypatch, lm, loss_sums=broken)
  with pytest.raises(
    UserError, match=rf"loss_sums must return \(loss_sum, count, \{{metric: sum\}}\).*{re.escape(fragment)}"
  ):
    train(tiny_config(steps=1), str(tmp_path))


def test_make_batch_must_zero_the_weights_of_padding_rows():
  source = [{"tokens": np.arange(5, dtype=np.int32)} for _ in range(3)]
  plan = BatchPlan(3, 4, seed=0)  # 3 records in a batch of 4: the last row is padding.
  assert plan.record_ids(0)[-1] == PAD
  good = LocalBatches(source, plan, (0, 4), functools.partial(lm.make_batch, pad_id=None, eos_id=None))
  np.testing.assert_array_equal(good(0)["weights"].sum(axis=1), [4, 4, 4, 0])

  def counts_padding(records, valid):
    return {"inputs": records["tokens"], "weights": np.ones((len(valid), 5), np.float32)}

  with pytest.raises(UserError, match="non-zero weights on padding rows"):
    LocalBatches(source, plan, (0, 4), counts_padding)(0)
  with pytest.raises(UserError, match="includes 'weights'"):
    LocalBatches(source, plan, (0, 4), lambda records, valid: {"inputs": records["tokens"]})(0)


def test_an_experiment_given_as_a_path_trains(tmp_path):
  summary = train(tiny_config(steps=1, experiment="experiments/lm.py"), str(tmp_path))
  assert summary["final_step"] == 1 and summary["tokens_trained_this_run"] == 16 * 16


def test_a_missing_experiment_is_one_error_line(tmp_path):
  result = run_main(
    "--config=configs/smoke_cpu.py:tiny",
    f"--workdir={tmp_path}",
    "--config.experiment=experiments/no_such.py",
  )
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert result.returncode == 2 and len(errors) == 1, result.stderr
  assert "no experiments/no_such.py" in errors[0] and "Traceback" not in result.stderr


def test_a_loss_sums_that_asks_for_the_config_is_given_it(tmp_path, monkeypatch):
  real, seen = lm.loss_sums, []

  def weighted(model, batch, rng, config):
    seen.append(config.model.z_loss)
    loss_sum, count, metrics = real(model, batch, rng)
    return loss_sum * (1.0 + config.model.z_loss), count, metrics

  patch_experiment(monkeypatch, lm, loss_sums=weighted)
  summary = train(tiny_config(steps=1, **{"model.z_loss": 0.5}), str(tmp_path))
  assert summary["final_step"] == 1 and seen and set(seen) == {0.5}


def test_a_variable_loss_sums_creates_in_training_is_an_error_naming_it_not_lost_silently(
  tmp_path, monkeypatch
):
  """A variable made in the forward pass has no place in the train state: its value would be dropped
  with the model after the step."""
  from flax import nnx

  real = lm.loss_sums

  def updating(model, batch, rng):
    model.seen = nnx.BatchStat(jnp.sum(batch["weights"]))  # A statistic the built model does not have.
    return real(model, batch, rng)

  patch_experiment(monkeypatch, lm, loss_sums=updating)
  with pytest.raises(UserError, match=r"loss_sums changed the model's variable seen \(created in loss_sums"):
    train(tiny_config(steps=1), str(tmp_path))


def test_what_a_batchnorm_writes_in_training_is_kept_and_a_changed_shape_is_an_error():
  from flax import nnx

  from trainer import state as state_lib
  from trainer import step

  norm = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
  _, before = state_lib.split(norm)
  norm(jnp.arange(12.0).reshape(4, 3))
  kept = step.kept_variables(norm, before)
  assert jnp.allclose(kept["mean"], 0.01 * jnp.array([4.5, 5.5, 6.5]))  # momentum 0.99, from 0.
  norm.mean.set_value(jnp.zeros((2, 3)))
  with pytest.raises(UserError, match=r"variable mean \(now float32\[2, 3\], built float32\[3\]\)"):
    step.kept_variables(norm, before)


def test_a_variable_written_in_every_microbatch_keeps_every_write(tmp_path, monkeypatch):
  """A counter of the valid tokens seen, kept as a variable: with 2 microbatches the second starts
  from what the first left, so after the run it holds every valid token of every step."""
  from flax import nnx

  from trainer.checkpoint.read import load

  real_build, real_loss = lm.build_model, lm.loss_sums

  def build(config, rngs):
    model = real_build(config, rngs)
    model.seen = nnx.BatchStat(jnp.zeros((), jnp.float32))
    return model

  def counting(model, batch, rng):
    if rng is not None:
      model.seen.set_value(model.seen.get_value() + jnp.sum(batch["weights"]))
    return real_loss(model, batch, rng)

  patch_experiment(monkeypatch, lm, build_model=build, loss_sums=counting)
  summary = train(tiny_config(steps=2, microbatches=2, **{"checkpoint.every": 2}), str(tmp_path))
  run = load(str(tmp_path))
  assert "seen" in run.variables and "seen" not in run.params
  assert float(run.variables["seen"]) == summary["tokens_trained_this_run"] > 0, summary
