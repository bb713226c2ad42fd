"""The second experiment, not a language model: a ViT on gratings trains, keeps dropout independent
of how the batch is split, and resumes bitwise. (Several processes run the trainer, whatever the
experiment: the LM's runs in tests/test_local_launcher_main.py stand for both.)"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.vit import ViT
from tests.conftest import REPO, read_jsonl, run_python, train_losses

STEPS = 16
FLAGS = [
  "--config=configs/vit_smoke_cpu.py:tiny,batch=32",
  f"--config.steps={STEPS}",
  "--config.checkpoint.every=4",
  "--config.eval_steps=2",
  "--config.data.noise=0.3",  # Learnable within 16 steps of 32 images.
]


def test_dropout_masks_depend_on_the_example_only():
  """An example's output is the same alone or in a batch: its random bits come from its own key, so
  they cannot depend on which device or microbatch holds it."""
  with nnx.use_eager_sharding(False):
    model = ViT(
      image_size=8,
      channels=1,
      patch_size=4,
      num_classes=4,
      embed_dim=16,
      num_layers=1,
      num_heads=2,
      mlp_dim=32,
      dropout=0.5,
      compute_dtype="float32",
      rngs=nnx.Rngs(0),
    )
  images = jax.random.normal(jax.random.PRNGKey(1), (3, 8, 8, 1))
  keys = jax.random.split(jax.random.PRNGKey(2), 3)
  together = model(images, keys)
  alone = model(images[1:2], keys[1:2])
  np.testing.assert_allclose(together[1], alone[0], rtol=1e-6, atol=1e-6)
  assert not np.allclose(together[1], model(images[1:2])[0], atol=1e-4)  # Dropout is on.
  np.testing.assert_array_equal(model(images), model(images))  # None: deterministic evaluation.


def _main(*argv, main="main.py"):
  cmd = [sys.executable, *([main] if isinstance(main, str) else main), *argv]
  return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=240):
  try:
    return proc.communicate(timeout=timeout)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("vit_one")
  proc = _main("--cpu_devices=8", *FLAGS, f"--workdir={workdir}")
  out = _finish(proc)
  assert proc.returncode == 0, out
  return str(workdir), out


def test_vit_trains_and_closes_without_a_loss_floor(straight):
  workdir, out = straight
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert rows[0]["valid_images"] == 32 and rows[0]["images_per_s"] > 0  # Named by the experiment's unit.
  assert np.mean([r["loss"] for r in rows[-4:]]) < np.mean([r["loss"] for r in rows[:4]])
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["eval_accuracy"] > 0.3 and summary["eval_examples"] == 64  # 8 classes: chance is 0.125.
  closing = out.strip().splitlines()[-1]
  assert (
    closing.startswith(f"final step {STEPS}: loss ") and "eval_loss" in closing and "floor" not in closing
  )
  # An experiment without a Hugging Face layout: one error line, nothing written.
  out = f"--out={workdir}/hf"
  export = run_python("-m", "trainer.modes.export", f"--workdir={workdir}", "--format=hf", out)
  assert export.returncode == 2 and not os.path.exists(f"{workdir}/hf")
  assert export.stderr.strip().splitlines() == [
    "error: --format=hf: experiments/vit.py cannot write it (it declares no EXPORT_FORMATS)"
  ]


@pytest.mark.slow
def test_kill_and_resume_is_bitwise(straight, tmp_path):
  workdir = str(tmp_path)
  # Each save's background write is held open 1 s, so the run is still going when it is killed.
  proc = _main(
    "--cpu_devices=8", *FLAGS, f"--workdir={workdir}", main=["tests/main_with_pauses.py", "save=1"]
  )
  try:
    deadline = time.time() + 120
    while not os.path.isdir(os.path.join(workdir, "checkpoints", "8")) and time.time() < deadline:
      assert proc.poll() is None, proc.stdout.read()
      time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
  finally:
    _finish(proc)
  assert proc.returncode == -signal.SIGKILL
  proc = _main("--cpu_devices=8", *FLAGS, f"--workdir={workdir}")
  out = _finish(proc)
  assert proc.returncode == 0, out
  # From checkpoint 8 or, newer, the local tier's copy of a later step.
  resumed = re.search(r"resumed from checkpoint (\d+)|restored step (\d+) from the local tier", out)
  assert resumed and int(resumed.group(1) or resumed.group(2)) >= 8, out
  rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]
  assert [r["batch"] for r in rows] == list(range(STEPS))  # Each global batch exactly once.
  assert train_losses(workdir) == train_losses(straight[0])  # Bitwise, dropout included.


def test_a_rank_one_label_array_is_sharded_like_the_batch():
  """[B] arrays (labels, weights) take the batch sharding: rows over the batch axes."""
  from trainer import mesh as mesh_lib

  mesh = mesh_lib.make_mesh(_mesh_cfg(), jax.devices())
  sharding = mesh_lib.batch_sharding(mesh, (("batch", ("data", "fsdp")),))
  labels = jax.device_put(jnp.arange(8), sharding)
  assert {s.data.shape for s in labels.addressable_shards} == {(2,)}


def _mesh_cfg():
  import ml_collections

  return ml_collections.ConfigDict(
    {
      "data": 2,
      "fsdp": 2,
      "expert": 1,
      "context": 1,
      "tensor": 2,
      "dcn_data": 1,
      "dcn_fsdp": 1,
      "dcn_expert": 1,
    }
  )
