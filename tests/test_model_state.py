"""State beyond parameters (tests/batchnorm_fork.py, a convnet with nnx.BatchNorm written the natural
Flax way) and the params' moving average (ema.decay): what training writes to the variables is kept,
agrees across meshes and processes, is saved and restored bit for bit, is used in evaluation; the
average is the NumPy one; a checkpoint from before variables were kept apart is refused by name."""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file

from configs import vit_smoke_cpu
from data import pipeline
from errors import UserError
from tests import batchnorm_fork
from tests.conftest import patch_experiment, tiny_config
from tests.test_local_launcher import _launch
from trainer import components
from trainer import state as state_lib
from trainer.checkpoint import store
from trainer.checkpoint.read import load
from trainer.config import assemble
from trainer.evaluate import evaluate_checkpoint
from trainer.modes.export import export
from trainer.modes.verify import verify
from trainer.step import make_train_step
from trainer.train import train

batchnorm_fork.install()

STEPS, BATCH, EMA = 30, 32, 0.9
# The running statistics against the data's own: the mean within 3% of a standard deviation and the
# variance within 3% (momentum 0.8 over 30 steps leaves 0.8**30 = 1e-3 of the initial 0 and 1; the rest
# is the sampling noise of the last ~9 batches of 32 images of 64 pixels, about 1%).
MEAN_TOL, VAR_TOL = 0.03, 0.03


def _config(mesh=(2, 2, 2), **overrides):
  c = assemble.apply_args(vit_smoke_cpu.get_config(), "tiny")
  c.unlock()
  c.experiment = "batchnorm"
  c.lock()
  c.steps, c.global_batch_size, c.log_every, c.checkpoint.every = STEPS, BATCH, 10, 10
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  c.ema.decay = EMA
  for key, value in overrides.items():
    assemble.set_key(c, key, value)
  return c


FLAGS = [
  "--config=configs/vit_smoke_cpu.py:tiny",
  "--config.experiment=batchnorm",
  f"--config.steps={STEPS}",
  f"--config.global_batch_size={BATCH}",
  "--config.log_every=10",
  "--config.checkpoint.every=10",
  f"--config.ema.decay={EMA}",
  "--config.checks.first_step=true",  # Across processes too: the first gradients, resharded.
  "--config.checks.first_step_every_run=true",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The fork trained 30 steps on (2,2,2), on fsdp=8, and in 2 processes x 4 devices."""
  root = tmp_path_factory.mktemp("bn")
  mesh, fsdp, two = str(root / "mesh"), str(root / "fsdp"), str(root / "two")
  train(_config(), mesh)
  train(_config((1, 8, 1), **{"sharding.strategy": "fsdp"}), fsdp)
  launcher = ["--processes=2", "--cpu_devices=4", "--main=tests/main_with_forks.py", "--"]
  result = _launch(*launcher, *FLAGS, f"--workdir={two}", tag=two, timeout=240)
  assert result.returncode == 0, result.stdout + result.stderr
  return {name: load(path) for name, path in (("mesh", mesh), ("fsdp", fsdp), ("two", two))}


def _pixels(n: int) -> np.ndarray:
  comp = components.build(_config())
  return np.stack([comp.sources.train[i]["image"] for i in range(n)])


@pytest.mark.slow
def test_batchnorm_statistics_are_the_datas_and_agree_on_every_mesh_and_process_count(runs):
  mesh = runs["mesh"]
  assert set(mesh.variables) == {"pixel_norm", "norm"} and "mean" not in str(mesh.params.get("norm"))
  pixels = _pixels(4096)  # The data's own statistics, independently of the trainer.
  stats = mesh.variables["pixel_norm"]
  sd = pixels.std()
  assert abs(float(stats["mean"][0]) - pixels.mean()) <= MEAN_TOL * sd, (stats, pixels.mean())
  assert abs(float(stats["var"][0]) / pixels.var() - 1) <= VAR_TOL, (stats, pixels.var())
  for other in ("fsdp", "two"):
    for a, b in zip(jax.tree.leaves(runs[other].variables), jax.tree.leaves(mesh.variables), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=other)
    for a, b in zip(jax.tree.leaves(runs[other].ema), jax.tree.leaves(mesh.ema), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=other)


def test_variables_and_the_average_are_saved_and_restored_bit_for_bit_onto_another_mesh(tmp_path):
  config = _config()
  comp = components.build(config)
  state, step = components.fresh_state(comp, config), make_train_step(comp, 1)
  local = components.local_batches(comp)

  for t in range(3):
    with jax.set_mesh(comp.mesh):
      state, _ = step(state, pipeline.to_global(local(t), comp.batch_sharding, BATCH))
  assert state.variables and state.ema
  ckpt = store.Checkpoints(str(tmp_path), 3, 0)
  ckpt.save(3, state, store.data_position(3, 0, comp), config, store.run_metadata(comp, config))
  ckpt.wait()
  other = _config((1, 8, 1), **{"sharding.strategy": "fsdp"})
  comp8 = components.build(other)

  restored = ckpt.restore_latest(state_lib.abstract_state(comp8.shardings, comp8.mdef, comp8.tx))
  ckpt.close()
  saved, back = (
    jax.device_get((state.variables, state.ema)),
    jax.device_get((restored.state.variables, restored.state.ema)),
  )
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(back), strict=True):
    assert a.tobytes() == b.tobytes()
  # The running statistics moved in training: kept, not dropped (they start at 0 and 1).
  assert not np.allclose(saved[0]["pixel_norm"]["var"], 1.0)


def test_the_average_is_numpys_and_evaluation_and_export_report_it(tmp_path, monkeypatch):
  """ema = decay * ema + (1 - decay) * params after each step, from the initial params, not debiased;
  an experiment's eval_weights chooses what evaluation scores."""
  config = _config(**{"steps": 4, "checkpoint.every": 1, "checkpoint.keep": 5, "eval_steps": 1})
  summary = train(config, str(tmp_path))
  comp = components.build(config)
  average = jax.device_get(components.fresh_state(comp, config).params)
  for k in range(1, 5):
    params = load(str(tmp_path), step=k).params
    average = jax.tree.map(lambda e, p: EMA * e + (1 - EMA) * p, average, params)
  got = load(str(tmp_path)).ema
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(average), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert summary["eval_loss"] != summary["eval_ema_loss"], summary
  out = str(tmp_path / "ema.safetensors")
  export(str(tmp_path), out, ema=True)

  tensors = load_file(out)
  np.testing.assert_array_equal(tensors["head/kernel"], got["head"]["kernel"])
  assert "pixel_norm/mean" in tensors  # The variables travel with the weights.

  patch_experiment(monkeypatch, batchnorm_fork, eval_weights=lambda p, v, ema: {"only_ema": (ema, v)})
  row = evaluate_checkpoint(config, str(tmp_path))
  assert row["eval_only_ema_loss"] == pytest.approx(summary["eval_ema_loss"], rel=1e-6)
  assert "eval_loss" not in row, row


def test_verify_checks_the_variables_and_fails_naming_one_a_fork_would_lose(tmp_path, monkeypatch):
  assert verify(_config(steps=2), str(tmp_path / "ok"), steps=2)
  with open(os.path.join(tmp_path, "ok", "verify.json")) as f:
    results = {(p["name"], p["result"]) for p in json.load(f)["properties"]}
  assert ("variables", "PASS") in results and ("additivity", "SKIP") in results, results

  real = batchnorm_fork.loss_sums

  def counting(model, batch, rng):  # A counter made in the forward pass: the step cannot keep it.

    model.seen = nnx.BatchStat(batch["weights"].sum())
    return real(model, batch, rng)

  patch_experiment(monkeypatch, batchnorm_fork, loss_sums=counting)
  assert not verify(_config(steps=2), str(tmp_path / "lost"), steps=2)
  with open(os.path.join(tmp_path, "lost", "verify.json")) as f:
    failed = [p for p in json.load(f)["properties"] if p["result"] == "FAIL"]
  assert [p["name"] for p in failed] == ["variables"] and "variable seen (created" in failed[0]["detail"]


def _save_old_tree(tmp_path, step, old, comp, config) -> store.Checkpoints:
  """Saves `old` as checkpoint `step` the way the trainer did before it kept variables and an EMA."""
  ckpt = store.Checkpoints(str(tmp_path), 3, 0)
  ckpt.manager.save(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(old),
      data=ocp.args.JsonSave(store.data_position(step, 0, comp)),
      config=ocp.args.JsonSave(json.loads(config.to_json())),
      meta=ocp.args.JsonSave({}),
    ),
  )
  ckpt.manager.wait_until_finished()
  return ckpt


def test_a_checkpoint_from_before_variables_were_kept_apart_is_refused_and_left_in_place(tmp_path):
  """The old trainer saved every nnx variable under params, with no variables or ema in its tree."""

  config = _config(**{"ema.decay": 0.0})
  comp = components.build(config)
  state = components.fresh_state(comp, config)
  merged = comp.mdef.merge(state.params, state.variables)
  old = {
    "step": state.step,
    "params": nnx.to_pure_dict(nnx.state(merged)),
    "opt_state": state.opt_state,
    "rng": state.rng,
  }
  ckpt = _save_old_tree(tmp_path, 7, old, comp, config)

  with pytest.raises(UserError, match=r"checkpoint 7 was written before the train state kept variables"):
    ckpt.restore_latest(state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx))
  ckpt.close()
  assert os.listdir(os.path.join(tmp_path, "checkpoints")) == ["7"]


def test_an_old_checkpoint_of_a_model_without_variables_restores_and_its_shapes_are_still_checked(tmp_path):
  """The LM has neither variables nor an average: its old tree is all a restore needs; a changed
  parameter shape is still the error naming it, not damage."""

  config = tiny_config()
  comp = components.build(config)
  state = components.fresh_state(comp, config)
  old = {"step": state.step, "params": state.params, "opt_state": state.opt_state, "rng": state.rng}
  ckpt = _save_old_tree(tmp_path, 2, old, comp, config)
  restored = ckpt.restore_latest(state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx))
  assert restored.step == 2 and restored.state.variables == {} and restored.state.ema == {}
  for a, b in zip(jax.tree.leaves(restored.state.params), jax.tree.leaves(state.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  wider = components.build(tiny_config(**{"model.mlp_dim": 96}))
  with pytest.raises(UserError, match=r"checkpoint 2: parameter .* has shape .* but the model now has"):
    ckpt.restore_latest(state_lib.abstract_state(wider.shardings, wider.mdef, wider.tx))
  ckpt.close()
