"""--mode=inspect: where every shard lives and what the compiled step costs, without training.

Writes inspect.json (devices, mesh, per-parameter placement, totals, the compiled step's per-device
memory, FLOPs and collectives) and prints a summary. Nothing is allocated: shapes and shardings are
abstract, and the step is compiled ahead of time.
"""

import json
import os

import jax
import numpy as np

from trainer import components
from trainer import state as state_lib
from trainer.hlo_collectives import collectives
from trainer.metrics import console, device_label
from trainer.step import make_train_step


def _index(idx, shape) -> list[list[int]]:
  return [[s.start or 0, d if s.stop is None else s.stop] for s, d in zip(idx, shape, strict=True)]


def _bytes_per_device(leaf) -> int:
  """Bytes each device holds of one array, from its sharding's shard shape."""
  shard = leaf.sharding.shard_shape(leaf.shape)
  return int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


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


def report(config, devices=None) -> dict:
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
        "bytes_per_device": _bytes_per_device(leaf),
        "shards": [{"device_id": d.id, "index": _index(index_map[d], leaf.shape)} for d in devices],
      }
    )
  opt_leaves = [leaf for _, leaf in _leaves(target.opt_state)]

  def max_per_device(leaves):
    totals = {d.id: 0 for d in devices}
    for leaf in leaves:
      for d in leaf.sharding.devices_indices_map(leaf.shape):
        totals[d.id] += _bytes_per_device(leaf)
    return max(totals.values())

  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost
  param_leaves = [leaf for _, leaf in _leaves(target.params)]
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
      "param_bytes": sum(p["bytes_total"] for p in params),
      "opt_state_bytes": sum(
        int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize for x in opt_leaves
      ),
      "param_bytes_per_device_max": max_per_device(param_leaves),
      "opt_state_bytes_per_device_max": max_per_device(opt_leaves),
    },
    "compiled": {
      "memory_per_device": {
        "argument": memory.argument_size_in_bytes,
        "output": memory.output_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
      },
      # XLA's cost analysis is of the partitioned program one device runs (8 devices: 1/8 of a matmul).
      "flops_per_device": float(cost.get("flops", 0.0)),
      "flops_all_devices": float(cost.get("flops", 0.0)) * comp.mesh.devices.size,
      "collectives": collectives(compiled.as_text(), comp.mesh),
    },
  }


def inspect(config, workdir: str) -> dict:
  out = report(config)
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "inspect.json"), "w") as f:
      json.dump(out, f, indent=1)
  t, c = out["totals"], out["compiled"]
  console(f"devices: {out['devices_label']}; mesh {out['mesh']}; strategy {out['strategy']}")
  console(f"{'parameter':<28} {'shape':<16} {'logical axes':<24} {'spec':<28} {'bytes/device':>12}")
  for p in out["params"]:
    shape, axes, spec = (str(tuple(p[k])) for k in ("shape", "logical_axes", "spec"))
    console(f"{p['path']:<28} {shape:<16} {axes:<24} {spec:<28} {p['bytes_per_device']:>12,}")
  console(
    f"params {t['param_bytes']:,} B (max {t['param_bytes_per_device_max']:,} B/device); optimizer state "
    f"{t['opt_state_bytes']:,} B (max {t['opt_state_bytes_per_device_max']:,} B/device)"
  )
  m = c["memory_per_device"]
  console(
    f"compiled step per device: arguments {m['argument']:,} B, outputs {m['output']:,} B, "
    f"temporaries {m['temp']:,} B; {c['flops_per_device']:,.0f} FLOPs per device per step "
    f"({c['flops_all_devices']:,.0f} on all devices)"
  )
  for e in c["collectives"]:
    console(f"  {e['kind']:<18} x{e['count']:<4} {e['bytes_per_device']:>12,} B/device over {e['axes']}")
  console(f"wrote {os.path.join(workdir, 'inspect.json')}")
  return out
