"""One attention layer (model/layers.Attention: projections, RoPE, the kernel), forward and backward,
causal, by implementation and tile size, on whatever devices JAX has: which kernel `model.attention=auto`
should pick here, and which tile model/splash.py should use.

  .venv/bin/python benchmarks/attention_kernels.py [--shape=16,2048,768,12,4] [--dtype=bfloat16]
    [--impls=einsum,xla,flash,splash] [--blocks=256,512,1024] [--repeat=10] [--json=FILE]

--shape is batch, sequence, embed, query heads, key/value heads (lm_125m's layer at 16 x 2048 tokens by
default; on CPU devices pass a smaller one, e.g. --shape=8,128,128,4,4). Each row: the median of
--repeat timed calls after one compiling call, and the largest difference of the output from einsum's
(the explicit reference). 'splash' runs in Pallas interpret mode off TPUs: slow, for correctness only.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from model.layers import Attention  # noqa: E402


def measure(impl: str, block: int, x, positions, repeat: int, heads: tuple[int, int]):
  """(median seconds of forward + backward, output) for one implementation and tile size."""
  with nnx.use_eager_sharding(False):
    layer = Attention(x.shape[-1], heads[0], num_kv_heads=heads[1], impl=impl, block=block, rngs=nnx.Rngs(0))
  graph, params = nnx.split(layer)

  def loss(params, x):
    out = nnx.merge(graph, params)(x, positions, causal=True)
    return jnp.sum(out.astype(jnp.float32) ** 2), out

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  (_, out), grads = step(params, x)
  jax.block_until_ready(grads)
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, x))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="16,2048,768,12,4")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--impls", default="einsum,xla,flash,splash")
  parser.add_argument("--blocks", default="512", help="tile sizes tried for flash and splash")
  parser.add_argument("--repeat", type=int, default=10)
  parser.add_argument("--json", default="", help="also append one JSON line per row to this file")
  args = parser.parse_args()
  b, n, d, h, g = map(int, args.shape.split(","))
  x = jax.random.normal(jax.random.PRNGKey(1), (b, n, d), jnp.dtype(args.dtype))
  positions = jnp.broadcast_to(jnp.arange(n), (b, n))
  device = jax.devices()[0].device_kind
  print(f"{device}: batch {b}, sequence {n}, embed {d}, heads {h}/{g}, {args.dtype}; forward + backward")
  reference = None
  for impl in args.impls.split(","):
    for block in map(int, args.blocks.split(",")) if impl in ("flash", "splash") else [0]:
      if impl == "splash" and n % block:
        continue
      try:
        seconds, out = measure(impl, block or 512, x, positions, args.repeat, (h, g))
      except Exception as e:  # noqa: BLE001  (a kernel this backend lacks: say so, measure the rest)
        print(f"{impl:<7} block {block:>5}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        continue
      reference = out if reference is None else reference
      diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
      row = {"impl": impl, "block": block, "ms": round(seconds * 1e3, 3), "max_diff": diff, "device": device}
      row.update(shape=[b, n, d, h, g], dtype=args.dtype)
      print(f"{impl:<7} block {block:>5}: {seconds * 1e3:9.3f} ms  max |out - first| {diff:.3g}")
      if args.json:
        with open(args.json, "a") as f:
          f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
