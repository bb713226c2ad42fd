"""benchmarks/gpu_check.py's checks of single layers, each returning its table row (check, figure, bound,
ok): the MoE layer's dropless routing and model/flash.py's blockwise attention."""

import time


def _seconds(step, *args, runs: int = 10) -> float:
  """Mean seconds of `step(*args)` over `runs` calls, after one untimed (compiling) call."""
  import jax

  jax.block_until_ready(step(*args))
  t0 = time.perf_counter()
  for _ in range(runs):
    out = step(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / runs


def moe_dropless(full: bool) -> tuple:
  """The dropless routing's grouped matmuls (jax.lax.ragged_dot): equal to every expert on every token
  in float32, and its forward and backward in bfloat16 timed against capacity routing (factor 1.25)
  and every-expert on the same layer and tokens. XLA:CPU computes ragged_dot densely over every group:
  its speed is a GPU figure only."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from model.moe import MoE

  b, n, d, f, e, k = (8, 1024, 1024, 2048, 8, 2) if full else (2, 16, 32, 64, 8, 2)

  def layer(routing, dtype):
    with nnx.use_eager_sharding(False):
      moe = MoE(d, f, e, k, routing=routing, capacity_factor=1.25, rngs=nnx.Rngs(0))
    graph, params = nnx.split(moe)
    x = jax.random.normal(jax.random.key(1), (b, n, d), dtype)

    def loss(params, x):
      y, aux = nnx.merge(graph, params)(x)
      return jnp.sum(y.astype(jnp.float32) ** 2) + aux["balance"]

    return jax.jit(jax.value_and_grad(loss)), params, x

  outputs = {}
  for routing in ("dropless", "every"):
    step, params, x = layer(routing, jnp.float32)
    outputs[routing] = np.asarray(step(params, x)[1]["up"][...])
  scale = float(np.max(np.abs(outputs["every"])))
  gap = float(np.max(np.abs(outputs["dropless"] - outputs["every"]))) / scale
  if not full:
    figure = (
      f"dropless's gradients off every-expert's by {gap:.1e} of the largest; speed needs a GPU: not run"
    )
    return ("moe_dropless", figure, "<= 1e-5", gap <= 1e-5)
  times = {}
  for routing in ("dropless", "capacity", "every"):
    times[routing] = _seconds(*layer(routing, jnp.bfloat16))
  tokens = lambda r: b * n / times[r]
  figure = (
    f"gradients off every-expert's by {gap:.1e}; forward+backward {b}x{n} tokens, {e} experts top {k}, "
    f"d {d}, f {f}, bf16: dropless {tokens('dropless'):,.0f} tokens/s, "
    f"{times['capacity'] / times['dropless']:.2f}x capacity's, "
    f"{times['every'] / times['dropless']:.2f}x every's"
  )
  return (
    "moe_dropless",
    figure,
    "<= 1e-5; faster than every-expert",
    gap <= 1e-5 and times["dropless"] < times["every"],
  )


def fused_attention():
  """(name, fn) of the fused kernel `auto` picks without a context axis: cuDNN's on GPUs, splash on
  TPUs (and interpreted on CPU); fn(q, k, v) is causal attention over [B, L, H, K]."""
  import jax
  import jax.numpy as jnp

  from model import splash

  if jax.default_backend() == "gpu":
    return "cuDNN", lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"
    )
  return "splash", lambda q, k, v: splash.attention(q, k, v, jnp.zeros(q.shape[:2], jnp.int32))


def flash(full: bool) -> tuple:
  import jax
  import jax.numpy as jnp

  from model import flash as flash_lib

  b, t, heads, kv_heads, d = (4, 4096, 12, 4, 64) if full else (1, 64, 4, 2, 16)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (
    jax.random.normal(r, (b, t, h, d), jnp.bfloat16)
    for r, h in zip(keys, (heads, kv_heads, kv_heads), strict=True)
  )
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  seg = jnp.zeros_like(pos)
  ours = lambda q, k, v: flash_lib.attend(q, k, v, pos, pos, seg, seg, block=512)[0].astype(q.dtype)
  theirs = lambda impl: (
    lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  )
  exact = jax.jit(theirs("xla"))(*(x.astype(jnp.float32) for x in (q, k, v)))
  error = float(jnp.max(jnp.abs(jax.jit(ours)(q, k, v).astype(jnp.float32) - exact)))
  if not full:
    return (
      "flash",
      f"bf16 off float32 attention by {error:.1e}; speed needs a GPU or TPU: not run",
      "<= 0.05",
      error <= 0.05,
    )

  def seconds(fn):
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    return _seconds(step, q, k, v)

  fused = fused_attention()
  ms = {name: 1e3 * seconds(fn) for name, fn in (("flash", ours), fused, ("xla", theirs("xla")))}
  name = fused[0]
  figure = (
    f"max error vs float32 {error:.1e}; forward+backward {b}x{t}x{heads}x{d}: flash {ms['flash']:.2f} ms, "
    f"{name} {ms[name]:.2f} ms ({ms['flash'] / ms[name]:.2f}x), XLA {ms['xla']:.2f} ms"
  )
  return ("flash", figure, "error <= 0.05", error <= 0.05)
