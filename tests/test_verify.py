"""--mode=verify passes in two processes (the ViT on one: tests/test_configs.py), and FAILs,
naming the broken property, for the classic mistakes a fork makes in its loss."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import lm
from tests import router_aux_fork
from tests.conftest import patch_experiment, run_main, tiny_config
from trainer.modes.verify import verify

PROPERTIES = ("additivity", "padding_inert", "one_division", "rows_separate", "device_count")


def _xent(model, batch):
  logits = model(batch["inputs"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), batch["weights"]


def _counts_padding(model, batch, rng):
  xent, _ = _xent(model, batch)
  return jnp.sum(xent), xent.size, {}


def _local_mean(model, batch, rng):
  xent, w = _xent(model, batch)
  return jnp.mean(xent * w), jnp.float32(1.0), {}


def _scaled_by_devices(model, batch, rng):  # What summing per-device means does.
  xent, w = _xent(model, batch)
  return jnp.sum(xent * w) * jax.sharding.get_abstract_mesh().size, jnp.sum(w), {}


@pytest.mark.parametrize(
  "loss, broken",
  [
    (_counts_padding, "padding_inert"),
    (_local_mean, "additivity"),
    (_scaled_by_devices, "device_count"),
  ],
  ids=lambda x: getattr(x, "__name__", x),
)
def test_verify_fails_for_a_classic_fork_mistake_and_names_it(tmp_path, monkeypatch, capsys, loss, broken):
  patch_experiment(monkeypatch, lm, loss_sums=loss)
  assert not verify(tiny_config(microbatches=2), str(tmp_path), steps=2)
  lines = capsys.readouterr().out.splitlines()
  assert any(line.startswith(broken) and "FAIL" in line for line in lines), "\n".join(lines)
  assert any("what it usually means" in line for line in lines)
  assert lines[-1].startswith("verify: FAIL (") and broken in lines[-1]


_LM_LOSS = lm.loss_sums


def _pairs_of_rows(model, batch, rng):
  """The LM's loss with a metric over the whole batch: pairs of distinct valid rows, 0 for one row."""
  loss_sum, count, metrics = _LM_LOSS(model, batch, rng)
  rows = jnp.max(batch["weights"], axis=1)
  return loss_sum, count, {**metrics, "pairs": jnp.sum(rows) ** 2 - jnp.sum(rows**2)}


def test_an_additivity_fail_names_the_quantity_and_the_causes_and_no_figure_from_a_zero_sum(
  tmp_path, monkeypatch, capsys
):
  """A metric over the whole batch is 0 for each example alone: the FAIL names it, says what a
  coupled term is and what else breaks additivity, and prints no figure divided by that 0 (2e+30)."""
  patch_experiment(monkeypatch, lm, loss_sums=_pairs_of_rows)
  assert not verify(tiny_config(), str(tmp_path), steps=1)
  lines = capsys.readouterr().out.splitlines()
  at = next(i for i, line in enumerate(lines) if line.startswith("additivity"))
  fail, meaning = lines[at], lines[at + 1]
  assert (
    "FAIL" in fail
    and "broken: metric pairs" in fail
    and "relative n/a: zero over the examples; absolute 2.4e+02" in fail
  ), fail
  assert "loss_sum" not in fail.split("broken:")[1].split("; gradient")[0]  # The loss and count add up.
  for cause in ("metric pairs", "a mean", "COUPLES_EXAMPLES", "randomness", "key per example"):
    assert cause in meaning, meaning
  figures = [float(x) for x in re.findall(r"\d\.\de[+-]\d+", fail)]
  assert figures and max(figures) < 1e6, fail  # The absolute difference: the rows' pairs, 240 for 16.


@pytest.mark.slow
def test_a_batch_mean_auxiliary_term_fails_additivity_by_its_gradient_and_its_sum_form_passes(
  tmp_path, monkeypatch, capsys
):
  """tests/router_aux_fork.py: `xent_sum + 0.01 * aux_mean` shifts the loss by about 1e-6 (below the
  loss tolerance, 1e-5) but its router's gradient over the whole batch is half the sum over the two
  halves; verify FAILs it naming the router. `xent_sum + 0.01 * aux_sum` passes."""
  router_aux_fork.install()
  config = tiny_config()
  config.unlock()
  config.experiment = "routed"
  config.lock()
  patch_experiment(monkeypatch, router_aux_fork, loss_sums=router_aux_fork.loss_sums_batch_mean)
  assert not verify(config, str(tmp_path / "mean"), steps=1)
  lines = capsys.readouterr().out.splitlines()
  at = next(i for i, line in enumerate(lines) if line.startswith("additivity"))
  fail, meaning = lines[at], lines[at + 1]
  shift = float(re.search(r"loss_sum \S+ vs \S+ \((\S+) relative\)", fail).group(1))
  assert shift < 1e-5, fail  # The loss alone would pass.
  assert "FAIL" in fail and "two halves: broken: router 1.0e+00" in fail, fail
  assert "loss_sum's gradient for router" in meaning and "decoder" not in meaning, meaning
  assert lines[-1] == "verify: FAIL (additivity)"
  monkeypatch.undo()
  assert verify(config, str(tmp_path / "sum"), steps=1)
  lines = capsys.readouterr().out.splitlines()
  assert any(line.startswith("additivity") and "PASS" in line for line in lines), lines


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


@pytest.mark.slow
def test_verify_in_two_processes_prints_every_property_and_passes(tmp_path):
  """The LM's smoke config on its (2, 2, 2) mesh with 2 microbatches, across two processes of four
  devices, through main.py: verify's multi-process path (it knows no experiment: the LM stands for
  every one) and its report."""
  import subprocess
  import sys

  from tests.conftest import REPO

  launcher = [sys.executable, os.path.join(REPO, "launch", "local.py"), "--processes=2", "--cpu_devices=4"]
  flags = [
    "--mode=verify",
    "--config=configs/smoke_cpu.py:tiny",
    "--config.microbatches=2",
    f"--workdir={tmp_path}",
  ]
  result = subprocess.run([*launcher, "--", *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  out = "\n".join(
    line.removeprefix("[p0] ") for line in result.stdout.splitlines() if line.startswith("[p0] ")
  )
  assert (
    "logical CPU devices" in out
    and "mesh {'data': 2, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 2}" in out
  )
  assert "step 2 with 5 valid" in out  # One device's rows partly padding, two devices' only padding.
  for prop in PROPERTIES:
    assert any(line.startswith(prop) and "PASS" in line for line in out.splitlines()), prop
  for group in ("blocks/0/attn", "blocks/0/mlp", "embed", "unembed"):
    assert f"mesh_vs_one       3  {group} " in out, group
  assert out.strip().endswith("verify: PASS")
  with open(os.path.join(tmp_path, "verify.json")) as f:
    report = json.load(f)
  assert report["verdict"] == "PASS" and report["mesh"] == {
    "data": 2,
    "fsdp": 2,
    "expert": 1,
    "context": 1,
    "tensor": 2,
  }
  assert report["microbatches"] == 2 and report["compute_dtype"] == "float32"
  assert report["tolerance"] == {"loss_relative": 1e-5, "norm_ratio": 1e-3}
  assert {p["name"] for p in report["properties"]} == set(PROPERTIES)
  assert {r["step"] for r in report["rows"]} == {1, 2, 3} and all(r["pass"] for r in report["rows"])


def test_a_make_batch_that_looks_across_rows_fails_rows_separate(tmp_path, monkeypatch, capsys):
  """Training applies make_batch to each process's rows alone: one that shifts rows (row i takes row
  i-1's inputs) feeds each topology different examples, and verify says so even in one process."""
  make_batch = lm.make_batch

  def shifts_rows(records, valid, **kw):
    batch = make_batch(records, valid, **kw)
    return {**batch, "inputs": np.roll(batch["inputs"], 1, axis=0)}

  monkeypatch.setattr(lm, "make_batch", shifts_rows)
  assert not verify(tiny_config(), str(tmp_path), steps=1)
  lines = capsys.readouterr().out.splitlines()
  assert any(line.startswith("rows_separate") and "FAIL" in line for line in lines), "\n".join(lines)
  assert lines[-1].startswith("verify: FAIL (") and "rows_separate" in lines[-1]


def test_on_one_device_verify_skips_what_it_cannot_compare_and_says_why(tmp_path):
  """One device and a batch of one row: no other device count, no mesh unlike the reference, no
  padding and no rows to split. Each is a SKIP line with its reason, never a PASS, and the verdict
  rests on what was checked."""
  result = run_main(
    "--mode=verify",
    "--config=configs/smoke_cpu.py:tiny",
    f"--workdir={tmp_path}",
    "--cpu_devices=1",
    "--config.global_batch_size=1",
    "--config.microbatches=1",
  )
  assert result.returncode == 0, result.stdout + result.stderr
  lines = result.stdout.splitlines()
  skips = {line.split()[0]: line for line in lines if " SKIP " in line}
  assert set(skips) == {"device_count", "mesh_vs_one", "padding_inert", "rows_separate"}, lines
  assert "several devices" in skips["device_count"] and "several devices" in skips["mesh_vs_one"]
  assert not any(line.startswith(("device_count", "mesh_vs_one")) and "PASS" in line for line in lines)
  assert any(line.startswith("additivity") and "PASS" in line for line in lines)
  assert lines[-1] == "verify: PASS"
  with open(os.path.join(tmp_path, "verify.json")) as f:
    results = {p["name"]: p["result"] for p in json.load(f)["properties"]}
  assert results["device_count"] == "SKIP" and results["additivity"] == "PASS"
