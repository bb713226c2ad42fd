"""--mode=inspect: where every shard lives and what the compiled step costs, without training.

Writes inspect.json (devices, mesh, per-parameter placement, totals, the compiled step's per-device
memory, FLOPs and collectives, the traffic against the strategy's ZeRO minimum, and the fit on a
target device) and prints a summary. Nothing is allocated: shapes and shardings are abstract, and the
step is compiled ahead of time.
"""

import json
import os

import jax
import numpy as np

from errors import UserError
from trainer import components, device_memory, rundir
from trainer import sharding as sharding_lib
from trainer import state as state_lib
from trainer.cadence import CopyPolicy
from trainer.checkpoint import local_room
from trainer.observe import flops, hardware
from trainer.observe.collectives import collectives, trip_multipliers
from trainer.observe.metrics import console, device_label
from trainer.step import make_train_step


def _index(idx, shape) -> list[list[int]]:
  return [[s.start or 0, d if s.stop is None else s.stop] for s, d in zip(idx, shape, strict=True)]


def _leaves(tree):
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    yield "/".join(state_lib.path_keys(path)), leaf


def compile_train_step(config, devices=None):
  """(components, the abstract train state, the train step compiled ahead of time for it): nothing is
  allocated, and with the experiment's example_batch no data is opened."""
  comp, batch = components.build_for_compile(config, devices)
  target = state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx)
  with jax.set_mesh(comp.mesh):
    compiled = make_train_step(comp, config.microbatches).lower(target, batch).compile()
  return comp, target, compiled


def zero_minimum(
  strategy: str, mesh_shape: dict, param_bytes: int, expert_bytes: int = 0
) -> tuple[float, str]:
  """(bytes each device must send per step, the formula) for the strategy's gradient and parameter
  traffic, whatever the backend: Ψ is the parameters' bytes (gradients alike), n an axis's size and
  (n-1)/n a ring's share. dp all-reduces gradients over the batch axes (2Ψ); zero1 reduce-scatters
  them and all-gathers the updated parameters (2Ψ); fsdp all-gathers parameters in the forward and
  backward passes and reduce-scatters gradients over fsdp (3Ψ), then all-reduces its shard of the
  gradients over the replicas (data x expert x context: context splits each example's positions, so
  its devices hold partial gradients too). Tensor parallelism splits Ψ first; its activation traffic
  is not counted, nor context's keys and values. Expert weights (`expert_bytes` of Ψ, split over the
  expert axis) count as one device's share Ψe/e, their replicas over data and context alone: the
  batch's split over expert is theirs."""
  d, f, e, c, t = (mesh_shape.get(a, 1) for a in ("data", "fsdp", "expert", "context", "tensor"))
  share = lambda n: (n - 1) / n
  dense, experts = param_bytes - expert_bytes, expert_bytes / e
  of = f", Ψe/e = {experts:,.0f} B of expert weights" if expert_bytes else ""
  ctx = " x context" if c > 1 else ""
  if strategy in ("dp", "zero1"):
    minimum = 2 * dense * share(d * f * e * c) + 2 * experts * share(d * f * c)
    return minimum, f"2Ψ(n-1)/n, n = data x fsdp x expert{ctx} = {d * f * e * c}" + (
      f" (n = data x fsdp{ctx} = {d * f * c} for experts{of})" if expert_bytes else ""
    )
  t = t if strategy == "fsdp_tp" else 1
  ring = lambda psi, r: 3 * psi * share(f) + 2 * (psi / f) * share(r)
  tp = f"Ψ/tensor({t}) " if t > 1 else ""
  formula = f"{tp}3Ψ(f-1)/f + 2(Ψ/f)(r-1)/r, f = fsdp = {f}, r = data x expert{ctx} = {d * e * c}"
  return ring(dense / t, d * e * c) + ring(experts / t, d * c), formula + (
    f" (r = data{ctx} = {d * c} for experts{of})" if expert_bytes else ""
  )


def exchange_minimum(experiment, config, mesh_shape: dict) -> tuple[float, str] | None:
  """(bytes each device must send per step by all-to-all, the formula) for the routed rows of a
  mixture of experts split over the expert axis, from the experiment's optional
  `routed_bytes_per_example` (the bytes of one example's routed activations there and back in one
  forward pass): each device's examples, all but their 1/e staying, forward and backward."""
  hook, e = experiment.routed_bytes_per_example, mesh_shape.get("expert", 1)
  if hook is None or e == 1:
    return None
  per_device = config.global_batch_size / int(np.prod(list(mesh_shape.values())))
  routed = float(hook(config))
  return 2 * routed * per_device * (e - 1) / e, (
    f"2 passes x {routed:,.0f} B routed per example x {per_device:g} examples/device x (e-1)/e, "
    f"e = expert = {e}"
  )


def expert_placement(params: list[dict], mesh_shape: dict) -> list[str]:
  """Which experts each device holds, from the first parameter with an `experts` dimension: one line
  per expert range, naming the devices that hold it."""
  p = next((p for p in params if "experts" in p["logical_axes"]), None)
  if p is None:
    return []
  dim = p["logical_axes"].index("experts")
  held: dict[tuple[int, int], list[int]] = {}
  for shard in p["shards"]:
    held.setdefault(tuple(shard["index"][dim]), []).append(shard["device_id"])
  n = p["shape"][dim]
  return [
    f"experts {lo}-{hi - 1} of {n} on devices {', '.join(map(str, ids))}"
    for (lo, hi), ids in sorted(held.items())
  ] + [f"(split over {p['spec'][dim] or 'nothing'}: mesh expert = {mesh_shape.get('expert', 1)})"]


def report(config, devices=None, target_device: str | None = None) -> dict:
  accelerator = None
  if target_device:
    accelerator = hardware.by_name(target_device)
    if accelerator is None:
      raise UserError(f"--target_device={target_device!r}: use one of {', '.join(hardware.TABLE)}")
  comp, target, compiled = compile_train_step(config, devices)
  logical = dict(_leaves(comp.mdef.logical_specs))
  devices = list(comp.mesh.devices.flat)
  params = []
  for path, leaf in _leaves(target.params):
    index_map = leaf.sharding.devices_indices_map(leaf.shape)
    params.append(
      {
        "path": path,
        "shape": list(leaf.shape),
        "dtype": str(leaf.dtype),
        "logical_axes": list(logical[path]),
        "spec": [list(a) if isinstance(a, tuple) else a for a in leaf.sharding.spec],
        "bytes_total": int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize,
        "bytes_per_device": device_memory.shard_bytes(leaf),
        "shards": [{"device_id": d.id, "index": _index(index_map[d], leaf.shape)} for d in devices],
        "notes": sharding_lib.unsplit_notes(logical[path], comp.rules, dict(comp.mesh.shape)),
      }
    )
  opt_leaves = [leaf for _, leaf in _leaves(target.opt_state)]

  max_per_device = lambda leaves: max(
    device_memory.bytes_per_device(leaves, addressable_only=False).values(), default=0
  )

  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost
  param_leaves = [leaf for _, leaf in _leaves(target.params)]
  hlo = compiled.as_text()
  table = collectives(hlo, comp.mesh)
  param_bytes = sum(p["bytes_total"] for p in params)
  expert_bytes = sum(p["bytes_total"] for p in params if "experts" in p["logical_axes"])
  minimum, formula = zero_minimum(config.sharding.strategy, dict(comp.mesh.shape), param_bytes, expert_bytes)
  # All-to-alls (routed rows) and collective-permutes (a context ring's keys and values) move
  # activations, not parameters: apart from the parameter traffic, the all-to-alls against their own
  # minimum.
  sent = sum(
    e["sent_bytes_per_device"] for e in table if e["kind"] not in ("all-to-all", "collective-permute")
  )
  exchanged = sum(e["sent_bytes_per_device"] for e in table if e["kind"] == "all-to-all")
  permuted = sum(e["sent_bytes_per_device"] for e in table if e["kind"] == "collective-permute")
  exchange = exchange_minimum(comp.experiment, config, dict(comp.mesh.shape))
  per_device = device_memory.step_bytes(compiled)
  param_max, opt_max = max_per_device(param_leaves), max_per_device(opt_leaves)
  if config.checks.recompute_every:  # A checked step keeps the step's own result while it runs again.
    per_device += param_max + opt_max
  # A local-tier copy taken on the devices holds one more state there while the next step runs.
  state_max = max_per_device(target)
  limit = accelerator.memory_bytes if accelerator else min(device_memory.limits().values(), default=None)
  step_only = per_device
  place = local_room.copy_place(config.checkpoint.local_copy_in, step_only, state_max, limit)
  local_copy = state_max if CopyPolicy.of(config.checkpoint.local_every).copies and place == "device" else 0
  per_device += local_copy
  loops = sum(1 for line in hlo.splitlines() if " while(" in line)
  model = flops.per_step(comp.experiment, config, state_lib.param_count(target.params))
  return {
    "devices": [
      {
        "id": d.id,
        "process_index": d.process_index,
        "kind": d.device_kind,
        "logical_cpu": d.platform == "cpu",
      }
      for d in devices
    ],
    "devices_label": device_label(devices),
    "mesh": dict(comp.mesh.shape),
    "strategy": config.sharding.strategy,
    "params": params,
    "totals": {
      "param_bytes": param_bytes,
      "opt_state_bytes": sum(
        int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in opt_leaves
      ),
      "param_bytes_per_device_max": param_max,
      "opt_state_bytes_per_device_max": opt_max,
    },
    "compiled": {
      "memory_per_device": {
        "argument": memory.argument_size_in_bytes,
        "output": memory.output_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
        "alias": memory.alias_size_in_bytes,
        "peak": getattr(memory, "peak_memory_in_bytes", 0),  # XLA's own; the total's on a TPU.
        "local_copy": local_copy,
        # device_memory.program_bytes (+ the state again with recompute checks, + a local-tier copy
        # taken on the devices).
        "total": per_device,
      },
      # XLA's cost analysis is of the partitioned program one device runs (8 devices: 1/8 of a matmul),
      # and counts a loop's body once: with `loops` > 0 (scanned layers, microbatches) it is low.
      "flops_per_device": float(cost.get("flops", 0.0)),
      "flops_all_devices": float(cost.get("flops", 0.0)) * comp.mesh.devices.size,
      "loops": loops,
      "model_flops_per_step": model,  # The experiment's analytic count (None without its hook).
      "collectives": table,  # Inside loops, multiplied by the trip counts.
      "loop_runs": {k: v for k, v in trip_multipliers(hlo).items() if v > 1},
    },
    "traffic": {
      "sent_bytes_per_device": sent,
      "zero_minimum_bytes_per_device": minimum,
      "minimum_formula": formula,
      "ratio": sent / minimum if minimum else None,
      "all_to_all_bytes_per_device": exchanged,
      "collective_permute_bytes_per_device": permuted,
      "all_to_all_minimum_bytes_per_device": None if exchange is None else exchange[0],
      "all_to_all_minimum_formula": None if exchange is None else exchange[1],
    },
    "local_tier": local_room.inspect_line(
      config, target, local_room.place_line(place, step_only, state_max, limit)
    ),
    "expert_placement": expert_placement(params, dict(comp.mesh.shape)),
    # The experiment's own account of what compiled (the LM: its attention implementation).
    "experiment_notes": list(notes(config, dict(comp.mesh.shape)))
    if (notes := comp.experiment.inspect_notes)
    else [],
    "target_device": None
    if accelerator is None
    else {
      "name": accelerator.name,
      "memory_bytes": accelerator.memory_bytes,
      "fraction": per_device / accelerator.memory_bytes,
      "fits": per_device <= accelerator.memory_bytes,
    },
  }


def inspect(config, workdir: str, target_device: str | None = None) -> dict:
  out = report(config, target_device=target_device)
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(rundir.mode_output(workdir, "inspect"), "w") as f:
      json.dump(out, f, indent=1)
  t, c = out["totals"], out["compiled"]
  console(f"devices: {out['devices_label']}; mesh {out['mesh']}; strategy {out['strategy']}")
  console(f"{'parameter':<28} {'shape':<16} {'logical axes':<24} {'spec':<28} {'bytes/device':>12}")
  for p in out["params"]:
    shape, axes, spec = (str(tuple(p[k])) for k in ("shape", "logical_axes", "spec"))
    console(f"{p['path']:<28} {shape:<16} {axes:<24} {spec:<28} {p['bytes_per_device']:>12,}")
    for note in p["notes"]:
      console(f"  note: {p['path']}: {note}")
  console(
    f"params {t['param_bytes']:,} B (max {t['param_bytes_per_device_max']:,} B/device); optimizer state "
    f"{t['opt_state_bytes']:,} B (max {t['opt_state_bytes_per_device_max']:,} B/device)"
  )
  m = c["memory_per_device"]
  console(
    f"compiled step per device: arguments {m['argument']:,} B, outputs {m['output']:,} B, "
    f"temporaries {m['temp']:,} B (donated {m['alias']:,} B), XLA's peak {m['peak']:,} B: {m['total']:,} B "
    "in all"
    + (" (with one more state: a step the recompute check repeats)" if config.checks.recompute_every else "")
    + (f" (with a local-tier copy on the devices, {m['local_copy']:,} B)" if m["local_copy"] else "")
  )
  console(out["local_tier"])
  loops = f"; XLA counts each of its {c['loops']} loops' body once" if c["loops"] else ""
  model = f", model (analytic) {c['model_flops_per_step']:,.0f}" if c["model_flops_per_step"] else ""
  console(
    f"FLOPs per step: compiled {c['flops_per_device']:,.0f} per device, {c['flops_all_devices']:,.0f} "
    f"on all{loops}{model}"
  )
  console("collectives per step (inside loops: x trip count), bytes each device sends by a ring:")
  for e in c["collectives"]:
    looped = f" ({e['in_loops']} in loops)" if e["in_loops"] else ""
    console(
      f"  {e['kind']:<18} x{e['count']:<5} {e['sent_bytes_per_device']:>14,.0f} B sent/device over "
      f"{e['axes']}{looped}"
    )
  tr = out["traffic"]
  ratio = f"{tr['ratio']:.2f}x" if tr["ratio"] is not None else "n/a (one device)"
  console(
    f"traffic {tr['sent_bytes_per_device']:,.0f} B/device against the {out['strategy']} minimum "
    f"{tr['zero_minimum_bytes_per_device']:,.0f} B ({tr['minimum_formula']}): {ratio}"
    + (" (all-to-alls apart)" if tr["all_to_all_bytes_per_device"] else "")
    + (" (collective-permutes apart)" if tr["collective_permute_bytes_per_device"] else "")
  )
  if tr["all_to_all_minimum_bytes_per_device"]:
    console(
      f"all-to-all {tr['all_to_all_bytes_per_device']:,.0f} B/device against the routed rows' minimum "
      f"{tr['all_to_all_minimum_bytes_per_device']:,.0f} B ({tr['all_to_all_minimum_formula']}): "
      f"{tr['all_to_all_bytes_per_device'] / tr['all_to_all_minimum_bytes_per_device']:.2f}x"
    )
  for line in out["expert_placement"]:
    console(f"placement: {line}")
  for line in out["experiment_notes"]:
    console(line)
  if (dev := out["target_device"]) is not None:
    verdict = "fits" if dev["fits"] else "does NOT fit"
    console(
      f"{verdict}: {100 * dev['fraction']:.0f}% of {dev['memory_bytes'] / 1e9:.0f} GB ({dev['name']}); "
      f"XLA's estimate, before NCCL/cuDNN workspaces"
    )
  console(f"wrote {os.path.join(workdir, 'inspect.json')}")
  return out
