"""Context parallelism: the sequence split over the `context` mesh axis. Flash, ring and all-gather
attention equal plain attention with packed documents and grouped heads, forward and backward; no
[L, L] array is compiled; context 4 trains the same losses as context 1 step by step; verify passes
across two processes; a checkpoint resumes onto another context size; bad configs get one line."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import context, flash
from tests.conftest import REPO, run_main, tiny_config
from tests.objective_harness import run_steps

TOL = 1e-5  # float32: relative to the largest entry, forward and gradients.


def _plain(q, k, v, pos, seg):
  """[B, H, L, L] scores, masked within segments by position: what the blocks must equal."""
  b, n, h, d = q.shape
  g = k.shape[2]
  s = jnp.einsum("blgrk,bmgk->bgrlm", q.reshape(b, n, g, h // g, d), k) / jnp.sqrt(d)
  mask = (pos[:, :, None] >= pos[:, None, :]) & (seg[:, :, None] == seg[:, None, :])
  p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -1e30), -1)
  return jnp.einsum("bgrlm,bmgk->blgrk", p, v).reshape(b, n, h, d)


def _packed(rng, b, n):
  seg = np.cumsum(rng.random((b, n)) < 0.08, axis=1).astype(np.int32)
  first = np.array([[np.argmax(row == s) for s in row] for row in seg])
  return jnp.asarray(np.arange(n) - first, jnp.int32), jnp.asarray(seg)


def _close(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _inputs(seed, b, n, h, g, d):
  """q [b, n, h, d], k and v [b, n, g, d] float32, and packed documents' positions and segment ids."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(b, n, heads, d)), jnp.float32) for heads in (h, g, g))
  return (q, k, v, *_packed(rng, b, n))


def _loss(attend):
  return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))


def split_equals_plain(mesh_shape, q, k, v, pos, seg, **options) -> tuple[int, np.ndarray]:
  """Asserts that context.attention(**options) over mesh (data, context) = `mesh_shape`, each device
  holding its balanced chunks, equals plain attention forward and backward within TOL; returns the
  context size and the order it saw."""
  want = _plain(q, k, v, pos, seg)
  want_grads = jax.grad(_loss(lambda *a: _plain(*a, pos, seg)), argnums=(0, 1, 2))(q, k, v)
  mesh = jax.make_mesh(mesh_shape, ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = (("batch", "data"), ("act_seq", "context"), ("act_heads", None), ("act_kv", None))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    c = context.context_size()
    order = context.balanced_order(q.shape[1], c)

    def split(q, k, v):  # Device i holds chunks i and 2c - 1 - i of 2c.
      t = lambda x: jnp.take(x, order, axis=1)  # noqa: E731
      out = context.attention(t(q), t(k), t(v), t(pos), t(seg), **options)
      return jnp.take(out, np.argsort(order), axis=1)

    got = jax.jit(split)(q, k, v)
    grads = jax.jit(jax.grad(_loss(split), argnums=(0, 1, 2)))(q, k, v)
  assert _close(got, want) <= TOL
  for a, w in zip(grads, want_grads, strict=True):
    assert _close(a, w) <= TOL
  return c, order


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_split_attention_equals_plain_attention_with_packing_and_grouped_heads(strategy):
  q, k, v, pos, seg = _inputs(0, 2, 64, 4, 2, 8)
  # Blocks of 16 on one device (no mesh): 4 x 4 tiles.
  got = flash.attend(q, k, v, pos, pos, seg, seg, block=16)[0]
  assert _close(got, _plain(q, k, v, pos, seg)) <= TOL
  # Context 4: device i holds chunks i and 7 - i of 8, attends by `strategy` in blocks of 4.
  c, order = split_equals_plain((2, 4), q, k, v, pos, seg, strategy=strategy, block=4)
  assert c == 4 and list(order[:16]) == [*range(8), *range(56, 64)]


def test_no_sequence_by_sequence_array_is_compiled():
  """A 1,024-token step of the LM with flash attention, forward and backward: no array in the
  compiled program has two dimensions of 1,024 (einsum's [B, H, L, L] scores do, as the control)."""

  def compiled_text(attention):
    config = tiny_config(
      **{"data.seq_len": 1024, "model.attention": attention, "model.attention_block": 128}
      | {"mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1}
    )
    from trainer.modes import inspect

    return inspect.compile_train_step(config)[2].as_text()

  assert "1024,1024]" in compiled_text("einsum")
  text = compiled_text("flash")
  assert "1024,1024]" not in text and "128,128]" in text


def test_context_4_trains_the_losses_of_context_1_step_by_step():
  """20 steps of the tiny LM at 64 tokens: data 8 (einsum) against data 2 x context 4 (ring), with
  microbatches; every step's loss within 1e-5 relative."""
  common = {"steps": 20, "data.seq_len": 64, "microbatches": 2, "mesh.fsdp": 1, "mesh.tensor": 1}
  one = tiny_config(**common, **{"mesh.data": 8})
  four = tiny_config(**common, **{"mesh.data": 2, "mesh.context": 4, "model.attention": "flash"})
  a = [float(m["loss"]) for m in run_steps(one, jax.devices(), 20)[1]]
  b = [float(m["loss"]) for m in run_steps(four, jax.devices(), 20)[1]]
  assert max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)) <= TOL, (a, b)
  assert a[-1] < a[0] - 0.5  # It learns: the comparison is over a moving trajectory.


def test_bad_context_configs_get_one_line(tmp_path):
  flags = ["--config=configs/long_smoke_cpu.py:tiny", "--cpu_devices=8", f"--workdir={tmp_path}"]
  result = run_main(*flags, "--config.model.attention=einsum")
  assert result.returncode == 2 and "error: mesh.context=4 splits the sequence" in result.stderr
  result = run_main(*flags, "--config.data.seq_len=20")
  assert result.returncode == 2 and "error: data.seq_len=20 must be a multiple of 2 x mesh.context=8" in (
    result.stderr
  )


@pytest.mark.slow
def test_verify_in_two_processes_passes_on_a_context_axis(tmp_path):
  """verify: one device against 2 processes x (data 1, context 4), padding rows included. (Restoring
  onto another context size is restoring onto another mesh: the checkpoint holds no sequence order,
  and tests/test_checkpoint_recovery.py restores onto other meshes.)"""
  flags = ["--config=configs/long_smoke_cpu.py:tiny", "--config.data.seq_len=64", "--config.microbatches=2"]
  launcher = [sys.executable, os.path.join(REPO, "launch", "local.py"), "--processes=2", "--cpu_devices=4"]
  verify = [*launcher, "--", "--mode=verify", *flags, f"--workdir={tmp_path / 'verify'}"]
  result = subprocess.run(verify, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "'context': 4" in result.stdout and result.stdout.strip().endswith("verify: PASS"), result.stdout
