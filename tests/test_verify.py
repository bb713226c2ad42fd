"""--mode=verify prints a per-group table, passes for the real step and fails for a broken loss."""

import json
import os

import jax
import jax.numpy as jnp

from experiments import lm
from tests.conftest import TINY_FLAGS, run_main, tiny_config
from trainer.verify import verify


def test_verify_cli_prints_the_table_and_passes(tmp_path):
  result = run_main("--mode=verify", f"--workdir={tmp_path}", "--cpu_devices=8", *TINY_FLAGS)
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "logical CPU devices" in out and "mesh {'data': 2, 'fsdp': 2, 'tensor': 2}" in out
  assert "grad_ratio" in out and "param_ratio" in out and "verify: PASS" in out
  for group in ("blocks/0/attn", "blocks/0/mlp", "embed", "unembed"):
    assert f"   3  {group} " in out, group
  with open(os.path.join(tmp_path, "verify.json")) as f:
    rows = json.load(f)["rows"]
  assert {r["step"] for r in rows} == {1, 2, 3} and all(r["pass"] for r in rows)


def test_verify_fails_when_the_objective_depends_on_the_device_count(tmp_path, monkeypatch, capsys):
  """A loss scaled by the number of devices (what summing per-device means does) must FAIL."""

  real = lm.loss_sums

  def broken(model, batch, rng):
    loss_sum, count, metrics = real(model, batch, rng)
    devices = jax.sharding.get_abstract_mesh().size  # 8 on the mesh, 1 on the reference device.
    return loss_sum * jnp.float32(devices), count, metrics

  monkeypatch.setattr(lm, "loss_sums", broken)
  assert not verify(tiny_config(), str(tmp_path))
  assert "verify: FAIL" in capsys.readouterr().out


def test_a_globally_empty_data_set_is_refused(tmp_path):
  result = run_main(
    "--config=configs/smoke_cpu.py",
    f"--workdir={tmp_path}",
    "--cpu_devices=8",
    "--config.data.num_examples=0",
  )
  assert result.returncode != 0
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "empty" in errors[0], result.stderr
