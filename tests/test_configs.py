"""Every config in configs/ has a pulse: loaded with `:tiny` it trains 2 steps through the real
training function on 8 logical CPU devices. Every config is locked, sets only keys that
configs/base.py and its experiment define, and its docstring is the recipe."""

import glob
import os
import runpy

import pytest

from configs import base
from errors import UserError
from tests.conftest import REPO, train_losses
from trainer.config import assemble
from trainer.train import train

CONFIGS = sorted(
  p for p in glob.glob(os.path.join(REPO, "configs", "*.py")) if not p.endswith(("base.py", "__init__.py"))
)


def _load(path, arg=None):
  return runpy.run_path(path)["get_config"](arg)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_has_a_pulse(path, tmp_path):
  cfg = _load(path, "tiny")
  assert assemble.dotted_keys(cfg) == assemble.dotted_keys(base.get_config(cfg.experiment))
  doc = runpy.run_path(path)["__doc__"]
  assert doc.count("Recipe") == 1 and ":tiny" in doc  # The docstring is the recipe and says how to shrink.
  with pytest.raises(AttributeError):
    cfg.no_such_key = 1  # Locked, as main.py's --config flag makes it.
  cfg.eval_steps = 0  # The pulse is the config's: evaluation is the same code for every config,
  # and so are the integrity checks (tests/test_xla_partitioner.py, test_replicas.py, and per axis
  # test_moe_parallel.py and test_context.py): each would compile the step once more.
  cfg.checks.first_step, cfg.checks.recompute_every = False, 0
  summary = train(cfg, str(tmp_path))
  assert summary["final_step"] == 2 and sorted(train_losses(str(tmp_path))) == [1, 2]


def test_short_arguments_combine():
  path = os.path.join(REPO, "configs", "smoke_cpu.py")
  cfg = _load(path, "tiny,fsdp=8,steps=5")
  assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (-1, 8, 1)
  assert cfg.steps == 5 and cfg.model.num_layers == 1 and cfg.global_batch_size == 16
  cfg = _load(path, "data=2,tensor=4,batch=64,strategy=dp")
  assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 1, 4)
  assert cfg.global_batch_size == 64 and cfg.sharding.strategy == "dp" and cfg.model.num_layers == 2
  for bad in ("tiyn", "fsdp=x", "mesh=8"):
    with pytest.raises(UserError, match="config argument"):
      _load(path, bad)


def test_an_experiment_may_not_redefine_a_trainer_key(monkeypatch):
  from experiments import lm_keys
  from trainer.config import trainer_keys

  monkeypatch.setitem(lm_keys.KEYS, "data.prefetch", trainer_keys.KEYS["data.prefetch"])
  with pytest.raises(UserError, match="redefines data.prefetch"):
    base.get_config("lm")


def _one_config_per_experiment():
  """Each experiment's smoke config (float32: bfloat16's tolerance is checked in test_objective.py).
  The LM's runs through main.py in two processes (tests/test_verify.py)."""
  seen = {}
  for path in sorted(CONFIGS, key=lambda p: "smoke" not in os.path.basename(p)):
    seen.setdefault(_load(path).experiment, path)
  return sorted((name, path) for name, path in seen.items() if name != "lm")


@pytest.mark.parametrize("experiment, path", _one_config_per_experiment(), ids=lambda x: os.path.basename(x))
def test_every_experiment_passes_verify(experiment, path, tmp_path):
  """--mode=verify on each experiment's tiny config, on its (2, 2, 2) mesh with 2 microbatches (the ViT
  with dropout on); tests/test_verify.py covers the (8, 1, 1) and (1, 8, 1) meshes."""
  from trainer import experiment as experiment_lib
  from trainer.modes.verify import verify

  cfg = _load(path, "tiny")
  # A loss coupling the whole batch refuses microbatches.
  cfg.microbatches = 1 if experiment_lib.load(experiment).microbatches_change_objective else 2
  assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 2, 2)
  assert verify(cfg, str(tmp_path), steps=2), experiment
