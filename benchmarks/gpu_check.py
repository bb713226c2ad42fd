"""The first checks on an NVIDIA GPU or a TPU, one table: run by benchmarks/gpu_check.sh (which finds the
Python and the packages); `--allow_cpu` runs the same code on CPU at toy sizes (tests/test_gpu_check.py);
`--only=lm_125m,recompute` runs those checks alone (lm_125m's also gives the memory row).

  attention     the fused kernel `auto` picks (cuDNN's on GPUs, Pallas splash on TPUs) against XLA's,
                forward values, bf16 causal GQA
  bf16_vs_fp32  the same 50 training steps in bf16 and float32 compute: the final losses' gap
  memory        the step's peak device memory against inspect's compiled estimate
  transfer      the loop's transfer guard holds on the device (a host copy inside it raises)
  checkpoint    Orbax save and restore of the train state: GB/s each way, restored bitwise
  lm_125m       configs/lm_125m.py on one GPU (synthetic data): tokens/s and MFU
  recompute     lm_125m's real train step twice from the same state and batch: bitwise equal, as the
                recompute check (trainer/checks/recompute.py) and invariant 5 need, under the
                trainer's deterministic kernels; a child with XLA's defaults gives their cost in tokens/s
  flash         model/flash.py's blockwise attention (what a context axis's ring and all-gather run on
                GPUs too: cuDNN's fused attention returns no log-sum-exp to combine chunks by) against
                float32 attention, and its forward+backward time against cuDNN's and XLA's, bf16 causal GQA
  moe_dropless  the MoE layer's dropless routing (grouped matmuls, jax.lax.ragged_dot): gradients equal to
                every expert on every token in float32; bf16 tokens/s against capacity and every-expert

Each row says what was measured, the bound it is held to, and ok or FAIL; the exit code is 1 when a row
failed. Bounds: the fused kernel's largest error against float32 attention at most twice XLA's bf16 one;
bf16's final loss within 2% of float32's; peak memory within 1.25x of the estimate plus 256 MiB (cuDNN
and allocator buffers inspect does not see); restore bitwise.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import gpu_check_layers  # noqa: E402 - after the repository is on the path.

ROWS = []  # (check, figure, bound, ok)


def row(check: str, figure: str, bound: str, ok: bool) -> None:
  ROWS.append((check, figure, bound, ok))
  print(f"  {check}: {figure} ({'ok' if ok else 'FAIL'})", flush=True)


def check_attention(full: bool) -> None:
  """The fused kernel `model.attention=auto` picks on this platform against XLA's bf16 attention, both
  off XLA's float32 one: cuDNN's on GPUs, the Pallas splash kernel on TPUs (on CPU: interpreted, at
  toy sizes, so its path is exercised where no TPU is)."""
  import jax
  import jax.numpy as jnp

  b, t, heads, kv_heads, d = (4, 2048, 12, 4, 64) if full else (1, 128, 4, 2, 16)
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (b, t, heads, d), jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, kv_heads, d), jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, kv_heads, d), jnp.bfloat16)
  attend = lambda impl: jax.jit(
    lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  )
  # Both bf16 implementations against XLA's in float32 on the same inputs: the fused kernel's error may
  # be a few bf16 roundings, as XLA's own bf16 path is, not more.
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  exact = attend("xla")(*f32)
  error = lambda fn: float(jnp.max(jnp.abs(fn(q, k, v).astype(jnp.float32) - exact)))
  xla = error(attend("xla"))
  name, kernel = gpu_check_layers.fused_attention()
  fused = error(jax.jit(kernel))
  figure = f"max error vs float32: {name} {fused:.1e}, XLA bf16 {xla:.1e} ({b}x{t}x{heads}x{d}, causal, GQA)"
  row(
    "attention",
    figure + ("" if full else " (interpreted)"),
    f"{name} <= 2x XLA's + 1e-3",
    fused <= 2 * xla + 1e-3,
  )


def _smoke_config(full: bool, steps: int, dtype: str):
  """configs/smoke_cpu.py's LM (557k parameters) on one device; on CPU its `:tiny` sizes."""
  from configs import smoke_cpu

  config = smoke_cpu.get_config(None if full else "tiny")
  config.steps = steps
  config.log_every = 10
  config.eval_every = config.eval_steps = 0
  config.checkpoint.every = steps
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  config.model.compute_dtype = dtype
  return config


def _train(config) -> tuple[dict, list[dict]]:
  import json

  from trainer.train import train

  with tempfile.TemporaryDirectory() as workdir:
    summary = train(config, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [r for r in map(json.loads, f) if "loss" in r]
  return summary, rows


def check_bf16_vs_fp32(full: bool) -> None:
  steps = 50 if full else 4
  fp32, _ = _train(_smoke_config(full, steps, "float32"))
  bf16, _ = _train(_smoke_config(full, steps, "bfloat16"))
  gap = (bf16["final_loss"] - fp32["final_loss"]) / fp32["final_loss"]
  figure = (
    f"loss at step {steps}: bf16 {bf16['final_loss']:.4f}, fp32 {fp32['final_loss']:.4f} ({100 * gap:+.2f}%)"
  )
  row("bf16_vs_fp32", figure, "gap within 2%", abs(gap) <= 0.02)


def check_transfer(full: bool) -> None:
  """The guard the loop steps under (trainer/train.py) must refuse a device-to-host copy on a GPU, or
  the loop's promise of no hidden syncs is unchecked there (XLA:CPU ignores the guard)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  x = jax.block_until_ready(jnp.arange(4.0) * 2)
  with jax.transfer_guard_device_to_host("disallow_explicit"):
    try:
      np.asarray(x)
      refused = False
    except Exception:  # noqa: BLE001 - JAX raises its runtime error type.
      refused = True
  figure = f"a host copy under the loop's guard is {'refused' if refused else 'allowed'}"
  row("transfer", figure + ("" if full else " (XLA:CPU)"), "refused" if full else "-", refused or not full)


def _lm_125m(full: bool):
  """configs/lm_125m.py on synthetic data, at one GPU's share of its batch (on CPU: its `:tiny`)."""
  from configs import lm_125m

  config = lm_125m.get_config(None if full else "tiny")
  config.data.source = "synthetic"  # Its 64-token chain: the model's 32k softmax still runs in full.
  config.data.packing = False  # Synthetic records are not documents.
  config.steps = 40 if full else 3
  config.log_every = 10 if full else 1
  config.eval_every = config.eval_steps = 0
  config.checkpoint.every = config.steps
  config.checks.replica_every = 0
  config.checks.recompute_every = 0  # 40 steps never reach it: the memory row's estimate is the step's.
  if full:
    config.global_batch_size = 16  # 32k tokens per step.
  return config


def check_checkpoint(full: bool) -> None:
  import jax
  import numpy as np

  from trainer import components
  from trainer import state as state_lib
  from trainer.checkpoint import store

  config = _lm_125m(full)
  comp = components.build(config)
  state = components.fresh_state(comp, config)
  jax.block_until_ready(state)
  gb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e9
  with tempfile.TemporaryDirectory(dir=os.getcwd()) as workdir:
    ckpt = store.Checkpoints(workdir, keep=2, keep_every=0)
    t0 = time.perf_counter()
    ckpt.save(1, state, store.data_position(1, 0, comp), config, store.run_metadata(comp, config))
    ckpt.wait()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    restored = ckpt.restore_latest(state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx))
    jax.block_until_ready(restored.state)
    restore_s = time.perf_counter() - t0
    ckpt.close()
  same = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored.state), strict=True)
  )
  figure = f"lm_125m state {gb:.2f} GB: save {gb / save_s:.2f} GB/s, restore {gb / restore_s:.2f} GB/s"
  row("checkpoint", figure, "restored bitwise", same)


def _step_twice(full: bool) -> tuple[int, int, str]:
  """(differing leaves, leaves, the first that differs) of lm_125m's real train step (the loop's:
  microbatches, optimizer update, donation) run twice from copies of one state and batch."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from data import pipeline
  from trainer import components
  from trainer.checks import replicas
  from trainer.step import make_train_step

  config = _lm_125m(full)
  comp = components.build(config)
  state = components.fresh_state(comp, config)
  b = config.global_batch_size
  batch = pipeline.to_global(components.local_batches(comp)(0), comp.batch_sharding, b)
  step = make_train_step(comp, config.microbatches)
  runs = []
  with jax.set_mesh(comp.mesh):
    for _ in range(2):
      new, metrics = step(jax.tree.map(jnp.copy, state), batch)  # The step donates its state.
      # On the host at once: a third state on the device ran a 16 GiB TPU v5e out of memory.
      runs.append(jax.device_get([("loss", metrics["loss"]), *replicas.named_leaves(new)]))
      del new, metrics
  same = lambda x, y: np.array_equal(np.asarray(x), np.asarray(y))
  differ = [n for (n, x), (_, y) in zip(*runs, strict=True) if not same(x, y)]
  return len(differ), len(runs[0]), (differ or [""])[0]


CHILD = []  # The recompute row's child's result: {"differ", "tokens_per_s"}, or {"failed": its error}.


def _run_child(allow_cpu: bool) -> None:
  """lm_125m's step twice and its training without the trainer's deterministic kernels, in a child run
  before this process takes the devices (a TPU takes one process at a time)."""
  import subprocess

  r = subprocess.run(
    [sys.executable, __file__, "--nondeterministic_child"] + (["--allow_cpu"] if allow_cpu else []),
    env={**os.environ, "XLA_FLAGS": XLA_FLAGS_GIVEN},  # XLA's defaults.
    capture_output=True,
    text=True,
    timeout=300,
  )
  try:
    CHILD.append(json.loads(r.stdout.strip().splitlines()[-1]))
  except (IndexError, ValueError):
    CHILD.append({"failed": r.stderr.strip()[-160:]})


def check_recompute(full: bool) -> None:
  """The recompute check rotates shards between a host's devices and asks for equal bits; one GPU
  has nothing to rotate, but the bits must first be equal on the same device. The trainer's default
  is deterministic kernels (trainer/cluster/runtime.py); a child without them says what they cost."""
  differ, leaves, first = _step_twice(full)
  figure = f"lm_125m's step twice on one device: {differ} of {leaves} leaves differ"
  figure += f" (first: {first})" if differ else ""
  child = CHILD[0] if CHILD else {"failed": "not run"}
  if "failed" in child:
    figure += f"; the child without the flag failed: {child['failed']}"
  else:
    tokens = child["tokens_per_s"]
    ratio = f", {TOKENS[0] / tokens:.3f}x its {tokens:,.0f} tokens/s" if TOKENS else ""
    figure += f"; with XLA's defaults: {child['differ']} differ{ratio}"
  row("recompute", figure, "bitwise", differ == 0)


def check_moe_dropless(full: bool) -> None:
  row(*gpu_check_layers.moe_dropless(full))


def check_flash(full: bool) -> None:
  row(*gpu_check_layers.flash(full))


XLA_FLAGS_GIVEN = os.environ.get("XLA_FLAGS", "")  # Before the trainer's own are added.
TOKENS = []  # lm_125m's tokens/s in this process (deterministic kernels), for the recompute row's ratio.


def check_lm_125m(full: bool) -> None:
  """Tokens/s and MFU of lm_125m, and the process's peak device memory against inspect's estimate of
  the same step (run last: the peak is the process's, and this step is its largest)."""
  import jax

  from trainer.modes import inspect

  config = _lm_125m(full)
  memory = inspect.report(config)["compiled"]["memory_per_device"]
  estimate = memory["total"]
  _, rows = _train(config)
  steady = rows[1:] or rows  # The first window compiles.
  tokens = statistics.median(r["tokens_per_s"] for r in steady)
  TOKENS.append(tokens)
  mfus = [r["mfu"] for r in steady if isinstance(r.get("mfu"), float)]  # None where no peak is known.
  mfu_text = f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a"
  row(
    "lm_125m",
    f"{tokens:,.0f} tokens/s, MFU {mfu_text} (batch {config.global_batch_size} x {config.data.seq_len})",
    "runs",
    True,
  )
  # The allocator's buffers and, on a TPU, the scratch it reserves for a program's temporaries (not in
  # peak_bytes_in_use: the step's 14.6 GB showed there as 1.5 GB).
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" not in stats:
    return row(
      "memory",
      f"inspect's estimate {estimate / 2**30:.2f} GiB; no peak on {jax.default_backend()}",
      "-",
      not full,
    )
  peak = stats["peak_bytes_in_use"] + stats.get("peak_bytes_reserved", 0)
  ok = 0.75 * estimate - 2**28 <= peak <= 1.25 * estimate + 2**28  # Too high a guess wastes a user's chip.
  gib = lambda key: f"{memory[key] / 2**30:.2f}"  # noqa: E731
  parts = f"arguments {gib('argument')}, temporaries {gib('temp')}, XLA's peak {gib('peak')}"
  parts += f", a local copy {gib('local_copy')}"
  row(
    "memory",
    f"peak {peak / 2**30:.2f} GiB, inspect's estimate {estimate / 2**30:.2f} GiB ({parts})",
    "within 25% + 256 MiB",
    ok,
  )


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--allow_cpu", action="store_true", help="run at toy sizes on CPU (the suite's test)")
  parser.add_argument("--nondeterministic_child", action="store_true", help="the recompute row's child")
  parser.add_argument("--only", default="", help="the checks to run, e.g. --only=lm_125m,recompute")
  args = parser.parse_args()
  # cuDNN attention last: after it, lm_125m's training under the trainer's deterministic flags failed in
  # the same process (cuDNN graph capture: "capturing stream has unjoined work"); in a fresh process,
  # as training runs, it did not (docs/guides/first-gpu.md).
  checks = (
    check_bf16_vs_fp32,
    check_transfer,
    check_checkpoint,
    check_lm_125m,
    check_recompute,
    check_moe_dropless,
    check_flash,
    check_attention,
  )
  names = [c.__name__.removeprefix("check_") for c in checks]
  only = [n for n in args.only.split(",") if n]
  if unknown := sorted(set(only) - set(names)):
    print(
      f"error: --only={args.only}: no check {', '.join(unknown)}; the checks: {', '.join(names)}",
      file=sys.stderr,
    )
    return 2
  if not args.nondeterministic_child and (not only or "recompute" in only):
    _run_child(args.allow_cpu)  # Before this process takes the devices: a TPU has one owner.
  from trainer.cluster import runtime

  if not args.nondeterministic_child:
    runtime.use_deterministic_gpu_ops()  # As main.py does: what the trainer runs with.
  if args.allow_cpu:
    runtime.configure_cpu_devices(1)
  import jax
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  full = jax.default_backend() in ("gpu", "tpu")  # On CPU (--allow_cpu): toy sizes.
  if not full and not args.allow_cpu:
    print(f"gpu_check: no GPU or TPU here (JAX's backend is {jax.default_backend()}): nothing to check")
    return 0
  if args.nondeterministic_child:
    differ, _, _ = _step_twice(full)
    _, rows = _train(_lm_125m(full))
    tokens = statistics.median(r["tokens_per_s"] for r in rows[1:] or rows)
    print(json.dumps({"differ": differ, "tokens_per_s": tokens}))
    return 0
  device = jax.devices()[0]
  print(f"gpu_check on {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
  t0 = time.time()
  for check in checks:
    if only and check.__name__.removeprefix("check_") not in only:
      continue
    try:
      check(full)
    except Exception as e:  # noqa: BLE001 - one failed check is a FAIL row; the others still run.
      row(
        check.__name__.removeprefix("check_"),
        f"{type(e).__name__}: {str(e).splitlines()[0][:120]}",
        "-",
        False,
      )
  print("\n| check | figure | bound | result |\n|---|---|---|---|")
  for check, figure, bound, ok in ROWS:
    print(f"| {check} | {figure} | {bound} | {'ok' if ok else 'FAIL'} |")
  print(f"{device.device_kind}, jax {jax.__version__}, {time.time() - t0:.0f} s")
  return 0 if all(r[3] for r in ROWS) else 1


if __name__ == "__main__":
  sys.exit(main())
