"""JAX's Pallas splash kernel (model/splash.py), run here in Pallas interpret mode: it equals plain
attention with packed documents and grouped heads, forward and backward, alone and split over a mesh's
batch and heads, and pair by pair over a context axis (ring and all-gather); `model.attention=auto`
picks it on TPUs for long sequences only; a sharded LM step with it equals one device (verify); a
sequence or chunk its tiles cannot cover gets one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from errors import UserError
from experiments import lm
from model import layers, splash
from tests.conftest import run_main, tiny_config
from tests.test_context import _close, _inputs, _loss, _packed, _plain, split_equals_plain

TOL = 1e-5  # float32, relative to the largest entry.


def test_splash_equals_plain_attention_with_packing_and_grouped_heads():
  rng = np.random.default_rng(0)
  b, n, h, g, d = 4, 256, 4, 2, 16
  q, k, v = (jnp.asarray(rng.normal(size=(b, n, heads, d)), jnp.float32) for heads in (h, g, g))
  pos, seg = _packed(rng, b, n)  # Positions restart with each document: index order within one.
  want = _plain(q, k, v, pos, seg)
  want_grads = jax.grad(_loss(lambda *a: _plain(*a, pos, seg)), argnums=(0, 1, 2))(q, k, v)

  def alone(q, k, v):  # Tiles of 128: a 2 x 2 grid, the upper one skipped by the causal mask.
    return splash.attention(q, k, v, seg, block=128)

  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  rules = (("batch", ("data", "fsdp")), ("act_seq", None), ("act_heads", "tensor"), ("act_kv", None))
  for attend in (alone, None):
    if attend is None:  # Batch over data x fsdp, heads (query and key/value) over tensor.
      with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        got = jax.jit(alone)(q, k, v)
        grads = jax.jit(jax.grad(_loss(alone), argnums=(0, 1, 2)))(q, k, v)
    else:
      got, grads = attend(q, k, v), jax.grad(_loss(attend), argnums=(0, 1, 2))(q, k, v)
    assert _close(got, want) <= TOL
    for a, w in zip(grads, want_grads, strict=True):
      assert _close(a, w) <= TOL


def test_tiles_follow_the_sequence_length():
  assert splash.block_sizes(2048).block_q == 1024
  assert splash.block_sizes(2048, 512).block_kv_dq == 512
  assert splash.block_sizes(640).block_q == 640 and splash.block_sizes(1536).block_q == 768
  assert splash.block_sizes(384, 256).block_q == 128  # 256 does not divide 384: the next multiple down.


@pytest.mark.parametrize(
  "backend, dtype, length, context_size, want",
  [
    ("tpu", jnp.bfloat16, 2048, 1, "splash"),
    ("tpu", jnp.float32, 512, 1, "splash"),
    ("tpu", jnp.bfloat16, 256, 1, "einsum"),  # Short: the explicit scores were faster on the chip.
    ("tpu", jnp.bfloat16, 1000, 1, "einsum"),  # Not a multiple of the kernel's 128-wide tiles.
    ("tpu", jnp.bfloat16, 2048, 4, "flash"),  # A context axis: only flash merges ring blocks.
    ("gpu", jnp.bfloat16, 2048, 1, "cudnn"),
    ("gpu", jnp.float32, 2048, 1, "xla"),
    ("cpu", jnp.bfloat16, 2048, 1, "einsum"),
  ],
)
def test_auto_picks_the_kernel_for_the_platform(monkeypatch, backend, dtype, length, context_size, want):
  monkeypatch.setattr(layers.jax, "default_backend", lambda: backend)
  assert layers.implementation("auto", dtype, context_size, length) == want
  assert layers.implementation("flash", dtype, context_size, length) == "flash"  # Named: as named.


def test_a_sharded_step_with_splash_equals_one_device(tmp_path):
  """--mode=verify on mesh (2, 2, 2) with the kernel in shard_map against one device."""
  result = run_main(
    "--mode=verify",
    "--config=configs/smoke_cpu.py:tiny",
    f"--workdir={tmp_path}",
    "--cpu_devices=8",
    "--config.model.attention=splash",
    "--config.data.seq_len=128",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2",
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "FAIL" not in result.stdout


def test_a_sequence_the_tiles_cannot_cover_gets_one_line(tmp_path):
  result = run_main(
    "--config=configs/smoke_cpu.py:tiny",
    f"--workdir={tmp_path}",
    "--cpu_devices=8",
    "--config.model.attention=splash",
    "--config.data.seq_len=200",
  )
  assert result.returncode != 0
  assert (
    result.stderr.strip()
    .splitlines()[-1]
    .startswith("error: model.attention='splash' needs data.seq_len a multiple of 128: got 200")
  )


def test_auto_keeps_bidirectional_attention_off_the_causal_kernels(monkeypatch):
  """A ViT's attention (causal=False) with 'auto' on a TPU: the einsum, not the causal splash kernel."""
  monkeypatch.setattr(layers.jax, "default_backend", lambda: "tpu")
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 512, 16))
  with nnx.use_eager_sharding(False):
    auto = layers.Attention(16, 2, impl="auto", rngs=nnx.Rngs(0))
    einsum = layers.Attention(16, 2, impl="einsum", rngs=nnx.Rngs(0))
  assert jnp.array_equal(auto(x), einsum(x))


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_splash_chunks_over_a_context_axis_equal_plain_attention(strategy):
  """The ring (and all-gather) with splash's pairs: each device's two chunks of 128 against every chunk
  not after them, causal or full by the chunks' order, merged by log-sum-exp; packed, grouped heads."""
  q, k, v, pos, seg = _inputs(1, 4, 512, 2, 1, 8)
  c, _ = split_equals_plain((4, 2), q, k, v, pos, seg, strategy=strategy, block=128, kernel="splash")
  assert c == 2


def test_context_chunks_the_tiles_cannot_cover_get_one_line():
  split = {"mesh.context": 2, "mesh.tensor": 1, "model.attention": "splash"}
  config = tiny_config(**split, **{"data.seq_len": 768})
  with pytest.raises(UserError, match="needs data.seq_len a multiple of 512: each device's two chunks"):
    lm.check_config(config)
  config.data.seq_len = 1024
  lm.check_config(config)
