"""Every config in configs/ loads, is locked, sets only keys configs/base.py defines, and trains
(shrunk to a tiny model on synthetic data) through the real training function."""

import glob
import os
import runpy

import pytest

from configs import base
from tests.conftest import REPO, train_losses
from trainer.train import train

CONFIGS = sorted(
  p for p in glob.glob(os.path.join(REPO, "configs", "*.py")) if not p.endswith(("base.py", "__init__.py"))
)


def _keys(cfg, prefix=""):
  for k, v in cfg.items():
    yield from _keys(v, f"{prefix}{k}.") if hasattr(v, "items") else [f"{prefix}{k}"]


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_is_a_base_config_and_trains(path, tmp_path):
  cfg = runpy.run_path(path)["get_config"]()
  assert set(_keys(cfg)) == set(_keys(base.get_config()))
  assert runpy.run_path(path)["__doc__"].count("Recipe") == 1  # The docstring is the recipe.
  with pytest.raises(AttributeError):
    cfg.no_such_key = 1  # Locked, as main.py's --config flag makes it.
  cfg.update_from_flattened_dict(
    {
      "steps": 2,
      "global_batch_size": 16,
      "eval_steps": 1,
      "eval_every": 0,
      "log_every": 1,
      "data.source": "synthetic",
      "data.packing": False,
      "data.seq_len": 16,
      "data.vocab_size": 32,
      "data.read_threads": 0,
      "model.vocab_size": 32,
      "model.embed_dim": 32,
      "model.num_layers": 1,
      "model.num_heads": 2,
      "model.mlp_dim": 64,
    }
  )
  summary = train(cfg, str(tmp_path))
  assert summary["final_step"] == 2 and sorted(train_losses(str(tmp_path))) == [1, 2]
