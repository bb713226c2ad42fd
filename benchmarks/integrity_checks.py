"""What the device-integrity checks cost (trainer/checks/integrity.py): per check, and per step at the
recipes' interval (checks.*_every = 500). Under pure FSDP over 8 logical CPU devices, for the smoke
model and a ~100M-parameter model, the median of a few of each:
  step        one train step
  recompute   the recompute check: copy the state and batch onto the rotated mesh, run the step
              there, checksum both results per device and compare
  replica     the replica check (checksums of every device's blocks, compared)
and the overhead at one check per 500 steps: (recompute + replica) / (500 x step).

  .venv/bin/python benchmarks/integrity_checks.py [--cpu_devices=8] [--repeats=3]

Logical CPU devices share this machine's cores: the ratio, not the seconds, carries over.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from checkpoint import LARGE, smoke_config  # noqa: E402

INTERVAL = 500  # configs/lm_125m.py and lm_1b.py check every 500 steps.


def _median(fn, repeats: int) -> float:
  fn()  # Compiles.
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--cpu_devices", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  from trainer.observe.metrics import device_label

  print(f"devices: {device_label()}; pure FSDP over {args.cpu_devices}")
  for name, overrides in (("smoke", {}), ("~100M", LARGE)):
    print(_measure(name, overrides, args.repeats))


def _measure(name: str, overrides: dict, repeats: int) -> str:
  import jax

  from data import pipeline
  from trainer import components
  from trainer import state as state_lib
  from trainer.checks import recompute, replicas
  from trainer.step import make_train_step

  config = smoke_config({**overrides, "mesh.data": 1, "mesh.fsdp": -1, "mesh.tensor": 1})
  config.sharding.strategy = "fsdp"
  comp = components.build(config)
  state = [components.fresh_state(comp, config)]
  local = components.local_batches(comp)(0)
  batch = pipeline.to_global(local, comp.batch_sharding, config.global_batch_size)
  step = make_train_step(comp, config.microbatches)
  check = recompute.RecomputeCheck(comp, config.microbatches, make_train_step, INTERVAL)

  def one_step():
    with jax.set_mesh(comp.mesh):
      state[0], metrics = step(state[0], batch)
    jax.block_until_ready(metrics)
    return metrics

  def recomputed():
    copied = check.copy(state[0], batch)
    metrics = one_step()
    t0 = time.perf_counter()
    check.check(copied, state[0], metrics, comp.mesh, 1)
    return time.perf_counter() - t0

  step_s = _median(one_step, repeats)
  recompute_s = statistics.median([recomputed() for _ in range(repeats + 1)][1:])  # The first compiles.
  replica_s = _median(lambda: replicas.check(state[0], comp.mesh, 1), repeats)
  overhead = (recompute_s + replica_s) / (INTERVAL * step_s)
  params = state_lib.param_count(state[0].params)
  return (
    f"{name:>6}: {params / 1e6:6.1f}M params | step {step_s:7.3f} s | recompute {recompute_s:7.3f} s "
    f"({recompute_s / step_s:4.2f} steps) | replica {replica_s:6.3f} s | every {INTERVAL} steps: "
    f"{100 * overhead:5.2f}% of step time"
  )


if __name__ == "__main__":
  main()
