"""A checkpoint saved on 8 devices opens on one with one call, and exports to safetensors exactly."""

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from errors import UserError
from model import hf_llama
from tests.conftest import tiny_config
from trainer import components
from trainer import state as state_lib
from trainer.checkpoint.store import Checkpoints
from trainer.modes.export import load, main, named_tensors
from trainer.train import train


def test_load_and_export_give_the_checkpoints_params_exactly(tmp_path, capsys):
  workdir = str(tmp_path / "run")
  cfg = tiny_config(steps=2, **{"model.scan_layers": True, "model.num_layers": 2})  # On (2, 2, 2).
  train(cfg, workdir)
  run = load(workdir, with_optimizer=True)
  assert run.step == 2 and run.config.to_json() == cfg.to_json()
  # The trainer's own restore onto its 8-device mesh holds the same values.
  comp = components.build(cfg)
  target = state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx)
  sharded = Checkpoints(workdir, keep=3, keep_every=0).restore_latest(target, set_aside=False).state
  for mine, theirs in zip(jax.tree.leaves(run.params), jax.tree.leaves(sharded.params), strict=True):
    assert isinstance(mine, np.ndarray)
    np.testing.assert_array_equal(mine, np.asarray(theirs))
  assert len(jax.tree.leaves(run.opt_state)) == len(jax.tree.leaves(sharded.opt_state))

  out = tmp_path / "w.safetensors"
  main([f"--workdir={workdir}", f"--out={out}"])
  assert "checkpoint 2" in capsys.readouterr().out
  tensors = load_file(str(out))
  expected = named_tensors(run.params)
  assert sorted(tensors) == sorted(expected) and "layers/attn/wq" in tensors
  for name, value in expected.items():
    np.testing.assert_array_equal(tensors[name], value)
  with open(out, "rb") as f:  # The header: 8 bytes of length, then JSON with the metadata.
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  assert json.loads(header["__metadata__"]["config"]) == json.loads(cfg.to_json())

  with pytest.raises(UserError, match="no checkpoint 1; it has \\[2\\]"):
    load(workdir, step=1)
  with pytest.raises(UserError, match="has no checkpoints"):
    load(str(tmp_path / "never_trained"))

  # init_from this run's workdir: its newest params, placed on another mesh; the step starts at 0.
  from trainer import init_from

  other = tiny_config(steps=2, **{"model.scan_layers": True, "model.num_layers": 2, "init_from": workdir})
  other.mesh.data, other.mesh.fsdp, other.mesh.tensor = 1, 8, 1
  init_from.configure(other, str(tmp_path / "second"))
  comp = components.build(other)
  state = components.fresh_state(comp, other)
  assert int(state.step) == 0
  for mine, theirs in zip(jax.tree.leaves(state.params), jax.tree.leaves(run.params), strict=True):
    np.testing.assert_array_equal(np.asarray(mine), theirs)
  other.model.mlp_dim = 48
  with pytest.raises(
    UserError, match=r"params are not this model's: layers/mlp/down \[2, 64, 32\] -> \[2, 48, 32\]"
  ):
    components.fresh_state(components.build(other), other)


def test_a_re_export_replaces_the_earlier_one_whole(tmp_path, capsys):
  """--format=hf into a directory holding an earlier sharded export: afterwards it holds exactly the
  new export's files (a stale index beside model.safetensors would make our reader and transformers
  load different weights), and nothing is left beside it. A directory with a file an export does not
  write is refused with one error line and left as it was."""
  workdir = str(tmp_path / "run")
  train(tiny_config(steps=2), workdir)
  out = tmp_path / "hf"
  out.mkdir()
  for stale in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"):
    (out / stale).write_text("an earlier export")
  main([f"--workdir={workdir}", "--format=hf", f"--out={out}"])
  assert "1 safetensors file" in capsys.readouterr().out
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
  assert sorted(os.listdir(tmp_path)) == ["hf", "run"]  # No staged or old directory left behind.
  assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
  run = load(workdir)
  assert sorted(load_file(str(out / "model.safetensors"))) == sorted(
    hf_llama.hf_tensors(run.params, run.config.model)
  )

  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("not an export")
  (mine / "model.safetensors").write_text("kept")
  with pytest.raises(SystemExit) as exit_info:
    main([f"--workdir={workdir}", "--format=hf", f"--out={mine}"])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == (
    f"error: --out={mine} holds 'notes.txt', which an export does not write; give a new or empty "
    "directory (an earlier export there is replaced whole)\n"
  )
  assert sorted(os.listdir(mine)) == ["model.safetensors", "notes.txt"]
  assert sorted(os.listdir(tmp_path)) == ["hf", "mine", "run"]
