"""A loss that couples the examples of the global batch (tests/contrastive_fork.py, a sigmoid loss over
all pairs): it trains alike on any mesh, microbatches that would split its pairs are refused with one
error line, and verify passes with `additivity` reported as SKIP and everything else checked."""

import json
import os

import numpy as np
import pytest

from configs import vit_smoke_cpu
from errors import UserError
from tests import contrastive_fork
from tests.conftest import train_losses
from tests.test_local_launcher import _launch
from trainer.config import assemble
from trainer.train import train

contrastive_fork.install()


def _config(mesh=(2, 2, 2), **overrides):
  c = assemble.apply_args(vit_smoke_cpu.get_config(), "tiny")
  c.unlock()
  c.experiment = "contrastive"
  c.lock()
  c.steps, c.log_every = 4, 1
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  for key, value in overrides.items():
    assemble.set_key(c, key, value)
  return c


def test_a_coupled_loss_trains_alike_on_another_mesh_and_in_two_processes_and_refuses_microbatches(
  tmp_path,
):
  """1 x 8 devices on (2,2,2) and (8,1,1), and 2 processes x 4 on (2,2,2): each sees the whole global
  batch's pairs, so the losses agree."""
  a, b, two = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "two")
  train(_config((2, 2, 2)), a)
  train(_config((8, 1, 1), **{"sharding.strategy": "dp"}), b)
  flags = ["--config=configs/vit_smoke_cpu.py:tiny", "--config.experiment=contrastive", "--config.steps=4"]
  launcher = ["--processes=2", "--cpu_devices=4", "--main=tests/main_with_forks.py", "--"]
  result = _launch(*launcher, *flags, "--config.log_every=1", f"--workdir={two}", tag=two, timeout=240)
  assert result.returncode == 0, result.stdout + result.stderr
  la = train_losses(a)
  assert sorted(la) == [1, 2, 3, 4]
  for other in (b, two):
    lo = train_losses(other)
    np.testing.assert_allclose([la[s] for s in sorted(la)], [lo[s] for s in sorted(lo)], rtol=1e-5)
  with pytest.raises(
    UserError, match=r"microbatches=2: experiments/contrastive.py declares COUPLES_EXAMPLES"
  ):
    train(_config(microbatches=2), str(tmp_path / "c"))


def test_verify_skips_additivity_for_a_coupled_loss_and_checks_the_rest(tmp_path):
  from trainer.modes.verify import verify

  assert verify(_config(), str(tmp_path), steps=2)
  with open(os.path.join(tmp_path, "verify.json")) as f:
    report = json.load(f)
  assert report["rows"]  # The mesh against one device, per parameter group: passed, as verify did.
  results = {(p["name"], p["step"]): p["result"] for p in report["properties"]}
  assert results[("additivity", 0)] == "SKIP"
  assert not any(name == "additivity" and r != "SKIP" for (name, _), r in results.items())
  for name in ("padding_inert", "one_division", "device_count", "rows_separate"):
    assert any(n == name and r == "PASS" for (n, _), r in results.items()), (name, results)
