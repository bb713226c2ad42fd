"""Scaling efficiency of the train step over 1, 2, 4, 8 devices: weak (fixed batch per device) and
strong (fixed global batch), for each strategy asked, measured in one run per point. Prints a table
and writes OUT/scaling.json and OUT/scaling.png (throughput and efficiency against devices):

  .venv/bin/python -m benchmarks.scaling --config=configs/smoke_cpu.py --devices=1,2,4,8 \
      --strategies=dp,fsdp --modes=weak,strong [--steps=10] [--out=runs/scaling]

efficiency = throughput_W / (W x throughput_1), the same for both modes: 1.0 is perfect. Strong
scaling keeps the config's global batch; weak scaling gives each device the config's batch divided
by the largest W, so the largest point is the config itself.

On logical CPU devices every "device" shares the same few cores: the figures measure the template's
overhead and XLA:CPU's, never an interconnect, and the plot says so in its title.

`--bandwidth_gbps=B` adds a prediction beside the measured points, labelled as one: each point's
compute time (one device's time, divided by W under strong scaling) plus the bytes each device sends
per step (the compiled step's collectives, as inspect counts them) over B GB/s, plus
`--straggler_s` per step. It is a model of a declared interconnect, not a measurement.
"""

import argparse
import json
import os
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STRATEGY_MESH = {
  "dp": lambda w: (w, 1, 1),
  "zero1": lambda w: (w, 1, 1),
  "fsdp": lambda w: (1, w, 1),
  "fsdp_tp": lambda w: (1, max(w // 2, 1), 2 if w > 1 else 1),
}


def load_config(spec: str):
  path, _, arg = spec.partition(":")
  return runpy.run_path(path)["get_config"](arg or None)


def measure(config, devices, steps: int) -> dict:
  """One point: compile, one warm-up step, `steps` timed steps on the same batch."""
  import jax

  from data import pipeline
  from trainer import components
  from trainer.observe.collectives import collectives
  from trainer.step import make_train_step

  comp = components.build(config, devices)
  state = components.fresh_state(comp, config)
  batch = pipeline.to_global(components.local_batches(comp)(0), comp.batch_sharding, config.global_batch_size)
  with jax.set_mesh(comp.mesh):
    step = make_train_step(comp, config.microbatches).lower(state, batch).compile()
  state, m = step(state, batch)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, m = step(state, batch)
  jax.block_until_ready(m)
  seconds = (time.perf_counter() - t0) / steps
  sent = sum(e["sent_bytes_per_device"] for e in collectives(step.as_text(), comp.mesh))
  return {"step_s": seconds, "units_per_s": float(m["count"]) / seconds, "sent_bytes_per_device": sent}


def points(args):
  import jax

  base = load_config(args.config)
  largest = max(args.devices)
  measured = {}  # (strategy, W, global batch) -> figures: weak and strong share their largest point.
  for strategy in args.strategies:
    for mode in args.modes:
      for w in args.devices:
        config = load_config(args.config)
        config.sharding.strategy = strategy
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = STRATEGY_MESH[strategy](w)
        config.mesh.dcn_data = config.mesh.dcn_fsdp = 1
        if mode == "weak":
          config.global_batch_size = max(base.global_batch_size // largest, 1) * w
        key = (strategy, w, config.global_batch_size)
        if key not in measured:
          measured[key] = measure(config, jax.devices()[:w], args.steps)
        yield strategy, mode, w, config.global_batch_size, measured[key]


def with_efficiency(rows: list[dict]) -> list[dict]:
  for row in rows:
    one = next(
      r for r in rows if (r["strategy"], r["mode"], r["devices"]) == (row["strategy"], row["mode"], 1)
    )
    row["speedup"] = row["units_per_s"] / one["units_per_s"]
    row["efficiency"] = row["speedup"] / row["devices"]
  return rows


def predict(rows: list[dict], bandwidth_gbps: float, straggler_s: float) -> None:
  """Adds predicted_step_s and predicted_efficiency to every row (see the module docstring)."""
  for row in rows:
    one = next(
      r for r in rows if (r["strategy"], r["mode"], r["devices"]) == (row["strategy"], row["mode"], 1)
    )
    compute = one["step_s"] / (row["devices"] if row["mode"] == "strong" else 1)
    step_s = compute + row["sent_bytes_per_device"] / (bandwidth_gbps * 1e9) + straggler_s
    units = row["units_per_s"] * row["step_s"]  # Per step.
    row["predicted_step_s"] = step_s
    row["predicted_efficiency"] = units / step_s / (row["devices"] * one["units_per_s"])


def plot(rows: list[dict], label: str, unit: str, path: str, predicted: str | None) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for key in sorted({(r["strategy"], r["mode"]) for r in rows}):
    mine = [r for r in rows if (r["strategy"], r["mode"]) == key]
    w = [r["devices"] for r in mine]
    (line,) = left.plot(w, [r["units_per_s"] for r in mine], "o-", label=f"{key[0]}, {key[1]}")
    right.plot(w, [r["efficiency"] for r in mine], "o-", color=line.get_color(), label=f"{key[0]}, {key[1]}")
    if predicted:
      right.plot(w, [r["predicted_efficiency"] for r in mine], "--", color=line.get_color(), alpha=0.7)
  if predicted:
    right.plot([], [], "k--", alpha=0.7, label=f"PREDICTED, not measured:\n{predicted}")
  left.set(xlabel="devices (W)", ylabel=f"{unit}/s", title="throughput (measured)", xscale="log")
  left.set_yscale("log")
  right.set(xlabel="devices (W)", ylabel="efficiency", title="efficiency = thr_W / (W x thr_1)", xscale="log")
  right.set_ylim(0, 1.2)
  right.axhline(1.0, color="grey", lw=0.8)
  ticks = sorted({r["devices"] for r in rows})
  for ax in (left, right):
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(ticks, labels=[str(x) for x in ticks])
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  fig.suptitle(label, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="configs/smoke_cpu.py", help="FILE[:ARG], as main.py takes it")
  parser.add_argument("--devices", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
  parser.add_argument("--strategies", default="dp,fsdp", type=lambda s: s.split(","))
  parser.add_argument("--modes", default="weak,strong", type=lambda s: s.split(","))
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--out", default="runs/scaling")
  parser.add_argument(
    "--cpu_devices",
    type=int,
    default=None,
    help="logical CPU devices (default: the largest --devices); 0 on GPUs/TPUs (or set JAX_PLATFORMS)",
  )
  parser.add_argument("--bandwidth_gbps", type=float, default=None, help="predict for this per-device GB/s")
  parser.add_argument("--straggler_s", type=float, default=0.0, help="prediction: seconds lost per step")
  args = parser.parse_args(argv)
  bad = [s for s in args.strategies if s not in STRATEGY_MESH] + [
    m for m in args.modes if m not in ("weak", "strong")
  ]
  if bad or 1 not in args.devices:
    parser.error(f"unknown {bad}" if bad else "--devices must include 1: efficiency is against one device")

  import jax
  from jax._src import xla_bridge

  from trainer.cluster import runtime

  # Logical CPU devices unless asked for an accelerator (JAX_PLATFORMS=cuda, or --cpu_devices=0); called
  # from a test, JAX may be up already.
  accelerator = args.cpu_devices == 0 or os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] != "cpu"
  if not accelerator and not xla_bridge.backends_are_initialized():
    runtime.configure_cpu_devices(args.cpu_devices or max(args.devices))
  from absl import logging

  from trainer.observe.metrics import device_label

  logging.set_verbosity(logging.WARNING)
  devices = jax.devices()
  if max(args.devices) > len(devices):
    parser.error(f"--devices up to {max(args.devices)}, but this machine has {len(devices)}")
  cpu = devices[0].platform == "cpu"
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  label = (
    f"logical CPU devices on {cores} cores: not an interconnect figure" if cpu else device_label(devices)
  )
  from trainer import experiment

  unit = experiment.load(load_config(args.config).experiment).UNIT
  rows = []
  print(f"{label}; {args.steps} timed steps per point after one warm-up")
  print(
    f"{'strategy':>8} {'mode':>6} {'W':>3} {'batch':>6} {'step ms':>9} {unit + '/s':>12} "
    f"{'speed-up':>8} {'effic.':>7}"
  )
  for strategy, mode, w, batch, m in points(args):
    rows.append({"strategy": strategy, "mode": mode, "devices": w, "global_batch": batch, **m})
  with_efficiency(rows)
  predicted = None
  if args.bandwidth_gbps:
    predict(rows, args.bandwidth_gbps, args.straggler_s)
    predicted = f"{args.bandwidth_gbps:g} GB/s per device" + (
      f", +{args.straggler_s:g} s straggler" if args.straggler_s else ""
    )
  for r in rows:
    pred = f"  predicted {100 * r['predicted_efficiency']:.0f}%" if predicted else ""
    print(
      f"{r['strategy']:>8} {r['mode']:>6} {r['devices']:>3} {r['global_batch']:>6} {1e3 * r['step_s']:>9.1f} "
      f"{r['units_per_s']:>12,.0f} {r['speedup']:>7.2f}x {100 * r['efficiency']:>6.1f}%{pred}"
    )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "scaling.json"), "w") as f:
    json.dump({"label": label, "unit": unit, "predicted_for": predicted, "points": rows}, f, indent=1)
  plot(rows, label, unit, os.path.join(args.out, "scaling.png"), predicted)
  print(f"wrote {os.path.join(args.out, 'scaling.json')} and scaling.png")
  return rows


if __name__ == "__main__":
  main()
