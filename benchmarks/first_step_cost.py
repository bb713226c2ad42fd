"""What checks.first_step costs (trainer/checks/first_step.py), from the ahead-of-time estimate alone:
nothing is allocated or run. For a config on N logical CPU devices (default: lm_1b on 64), compiles
the train step, the same step with the check's outputs (gradients and updates) under the configured
layout, and under each other layout the check may choose, and prints per device the memory XLA plans
(arguments + outputs + temporaries - aliased), the compiled FLOPs as a multiple of the train step's,
and whether the program is another than the configured one (the check skips a layout that compiles
alike). The configured program is the run's real first step; the check adds the first other layout
that is distinct and fits: one more step, a copy of the state, and two compiles. A layout fits a
device of --device_gib (80: H100/H200 class) when its plan does.

  .venv/bin/python benchmarks/first_step_cost.py [--config=configs/lm_1b.py] [--cpu_devices=64]

Logical CPU devices stand in for GPUs: memory and FLOPs per device carry over, compile times do not.
"""

import argparse
import os
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(compiled) -> tuple[float, float]:
  """(GiB per device, compiled FLOPs per device)."""
  m = compiled.memory_analysis()
  held = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return held / 2**30, float(cost.get("flops", 0.0))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="configs/lm_1b.py")
  parser.add_argument("--cpu_devices", type=int, default=64)
  parser.add_argument("--device_gib", type=float, default=80.0)
  args = parser.parse_args()
  import jax

  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  from errors import UserError
  from trainer import components
  from trainer import state as state_lib
  from trainer.checks import first_step
  from trainer.modes.inspect import compile_train_step
  from trainer.step import make_train_step

  config = runpy.run_path(args.config)["get_config"]()
  devices = jax.devices()
  rows = []
  t0 = time.time()
  comp, target, step = compile_train_step(config, devices)
  rows.append(("train step", dict(comp.mesh.shape), config.sharding.strategy, *_plan(step), time.time() - t0))
  _, batch = components.build_for_compile(config, devices)
  mine = None
  for label, sizes, strategy in [("configured", None, None)] + [
    ("candidate", s, k) for s, k in first_step.candidates(devices)
  ]:
    cfg = config if sizes is None else first_step.other_config(config, sizes, strategy)
    try:
      c = comp if sizes is None else components.build(cfg, devices, with_data=False)
    except UserError as e:
      print(f"skipped {sizes} {strategy}: {e}")
      continue
    t = state_lib.abstract_state(c.shardings, c.mdef, c.tx)
    t0 = time.time()
    with jax.set_mesh(c.mesh):
      shapes = first_step._on(t, c.shardings), first_step._on(batch, c.batch_sharding)
      compiled = make_train_step(c, cfg.microbatches, with_grads=True).lower(*shapes).compile()
    mine = mine or first_step.fingerprint(compiled)
    distinct = "configured" if sizes is None else str(first_step.fingerprint(compiled) != mine).lower()
    plan = (*_plan(compiled), time.time() - t0)
    name = f"{label} ({distinct})" if sizes else label
    rows.append((name, dict(c.mesh.shape), cfg.sharding.strategy, *plan))
  step_flops = rows[0][4]
  print(
    f"{args.config} on {args.cpu_devices} logical CPU devices (per device; fits: <= {args.device_gib:g} GiB)"
  )
  head = f"{'program':<18} {'mesh':<36} {'strategy':<8} {'GiB':>8} {'TFLOPs':>8} {'x step':>7}"
  print(f"{head} {'compile_s':>9}  fits")
  for label, mesh, strategy, gib, flops, seconds in rows:
    fits = "yes" if gib <= args.device_gib else "no"
    ratio = flops / step_flops if step_flops else float("nan")
    row = f"{label:<18} {str(mesh):<36} {strategy:<8} {gib:>8.2f} {flops / 1e12:>8.2f} {ratio:>7.2f}"
    print(f"{row} {seconds:>9.1f}  {fits}")


if __name__ == "__main__":
  main()
