"""--mode=inspect reports where every shard lives and which collectives the compiled step runs."""

import json

import jax
import numpy as np
import pytest

from errors import UserError
from tests.conftest import TINY_FLAGS, run_main, tiny_config
from trainer.checkpoint import local_room
from trainer.modes.inspect import report
from trainer.observe.collectives import trip_multipliers


def _cfg(mesh, strategy):
  data, fsdp, tensor = mesh
  return tiny_config(
    **{"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "sharding.strategy": strategy}
  )


def test_data_parallel_replicates_params_and_all_reduces_gradients_over_data():
  out = report(_cfg((8, 1, 1), "dp"))
  assert out["mesh"] == {"data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
  assert all(d["logical_cpu"] for d in out["devices"]) and len(out["devices"]) == 8
  for p in out["params"]:
    assert p["bytes_per_device"] == p["bytes_total"]
    assert all(s["index"] == [[0, n] for n in p["shape"]] for s in p["shards"])
  kinds = {(c["kind"], tuple(c["axes"])) for c in out["compiled"]["collectives"]}
  assert ("all-reduce", ("data",)) in kinds
  assert not any(kind == "all-gather" for kind, _ in kinds)
  grads = [c for c in out["compiled"]["collectives"] if c["kind"] == "all-reduce" and c["axes"] == ["data"]]
  assert grads[0]["bytes_per_device"] >= out["totals"]["param_bytes"]  # Every gradient crosses once.
  # A ring all-reduce of the gradients is the minimum: 2 x params x 7/8 sent per device.
  traffic = out["traffic"]
  assert traffic["zero_minimum_bytes_per_device"] == 2 * out["totals"]["param_bytes"] * 7 / 8
  assert 1.0 <= traffic["ratio"] < 1.05, traffic
  # The local tier copies a process's distinct shards once, however many of its devices replicate them.
  t = out["totals"]
  held = local_room.memory_line(t["param_bytes"] + t["opt_state_bytes"])
  assert held in out["local_tier"], out["local_tier"]


def test_a_local_tier_copy_taken_on_the_devices_counts_in_their_memory():
  """checkpoint.local_copy_in: a copy on the devices holds one more state there beside the next step;
  one taken in pinned host memory holds none, and inspect says which."""
  totals = {}
  for copy_in in ("device", "host"):
    cfg = _cfg((8, 1, 1), "dp")
    cfg.checkpoint.local_copy_in = copy_in
    out = report(cfg)
    totals[copy_in] = out["compiled"]["memory_per_device"]
    said = "copies taken on the devices" if copy_in == "device" else "copies taken in pinned host memory"
    assert said in out["local_tier"], out["local_tier"]
  t = out["totals"]
  assert totals["host"]["local_copy"] == 0
  assert totals["device"]["local_copy"] >= t["param_bytes"] + t["opt_state_bytes"]  # Replicated by dp.
  assert totals["device"]["total"] - totals["host"]["total"] == totals["device"]["local_copy"]


def test_collectives_inside_scanned_layers_count_once_per_trip():
  """Scanned, the gradients of 3 layers are all-reduced inside a loop of 3 trips: counted per trip,
  the step moves what the unrolled model moves (counted once per op, it would be under half)."""

  def totals(scan):
    cfg = _cfg((8, 1, 1), "dp")
    cfg.model.num_layers, cfg.model.scan_layers = 3, scan
    out = report(cfg)
    return out["traffic"]["sent_bytes_per_device"], out["compiled"]

  unrolled, _ = totals(False)
  scanned, compiled = totals(True)
  assert compiled["loops"] > 0 and any(e["in_loops"] for e in compiled["collectives"])
  assert abs(scanned - unrolled) <= 0.05 * unrolled, (scanned, unrolled)


def test_trip_counts_multiply_through_nested_loops_and_calls():
  hlo = """
%inner (p: f32[]) -> f32[] {
  %ar = f32[4]{0} all-reduce(f32[4]{0} %x), replica_groups={{0,1}}, to_apply=%add
}
%outer (p: f32[]) -> f32[] {
  %w = (s32[]) while((s32[]) %t), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  %f = f32[] fusion(f32[] %p), kind=kLoop, calls=%fused
}
%fused (p: f32[]) -> f32[] {
}
ENTRY %main (p: f32[]) -> f32[] {
  %w = (s32[]) while((s32[]) %t), condition=%c, body=%outer, backend_config={"known_trip_count":{"n":"2"}}
}
"""
  assert {k: v for k, v in trip_multipliers(hlo).items()} == {"inner": 6, "outer": 2, "fused": 2, "main": 1}


def test_fsdp_tp_splits_params_and_gathers_them_over_fsdp():
  out = report(_cfg((2, 2, 2), "fsdp_tp"))
  wq = next(p for p in out["params"] if p["path"] == "blocks/0/attn/wq")
  assert wq["logical_axes"] == ["embed", "heads", "kv"] and wq["spec"] == ["fsdp", "tensor", None]
  assert wq["bytes_per_device"] * 4 == wq["bytes_total"]
  assert len({json.dumps(s["index"]) for s in wq["shards"]}) == 4  # 4 distinct shards, each on 2 devices.
  t = out["totals"]
  assert (
    t["param_bytes_per_device_max"] < t["param_bytes"]
    and t["opt_state_bytes_per_device_max"] < t["opt_state_bytes"]
  )
  kinds = {(c["kind"], tuple(c["axes"])) for c in out["compiled"]["collectives"]}
  assert ("all-gather", ("fsdp",)) in kinds
  c = out["compiled"]
  assert c["flops_per_device"] > 0  # Labelled: XLA's figure is one device's partitioned program.
  assert c["memory_per_device"]["temp"] > 0


def test_inspect_cli_writes_inspect_json(tmp_path):
  result = run_main(
    "--mode=inspect", f"--workdir={tmp_path}", "--cpu_devices=8", "--target_device=h100", *TINY_FLAGS
  )
  assert result.returncode == 0, result.stderr
  assert "logical CPU devices" in result.stdout and "all-gather" in result.stdout
  assert "fits: 0% of 80 GB (NVIDIA H100 SXM)" in result.stdout and "fsdp_tp minimum" in result.stdout
  assert "local and peer tiers: up to " in result.stdout
  with open(tmp_path / "inspect.json") as f:
    out = json.load(f)
  assert set(out) >= {"devices", "mesh", "params", "totals", "compiled"}
  assert {d["id"] for d in out["devices"]} == {d.id for d in jax.devices()}


def test_fsdp_puts_near_total_over_n_on_every_device_the_embedding_table_included():
  """The tiny LM on (1, 8, 1) under fsdp, with no threshold (its norms are 1% of its 12,384
  parameters; in a real model far less): every leaf is split 8 ways, whatever its logical axes."""
  cfg = _cfg((1, 8, 1), "fsdp")
  cfg.sharding.fsdp_min_size = 0
  out = report(cfg)
  embed = next(p for p in out["params"] if p["path"] == "embed")
  assert embed["logical_axes"] == ["vocab", None] and "fsdp" in embed["spec"]
  t = out["totals"]
  assert t["param_bytes_per_device_max"] <= 1.05 * t["param_bytes"] / 8, t
  assert t["opt_state_bytes_per_device_max"] <= 1.05 * t["opt_state_bytes"] / 8, t
  # The reported index ranges are where a real array of that sharding puts its shards.
  from trainer import components
  from trainer import state as state_lib

  comp = components.build(cfg, with_data=False)
  target = state_lib.abstract_state(comp.shardings, comp.mdef, comp.tx).params
  leaves = {"/".join(state_lib.path_keys(k)): v for k, v in jax.tree_util.tree_flatten_with_path(target)[0]}
  for p in out["params"]:
    array = jax.device_put(np.zeros(p["shape"], np.float32), leaves[p["path"]].sharding)
    placed = {
      s.device.id: [
        [i.start or 0, n if i.stop is None else i.stop] for i, n in zip(s.index, p["shape"], strict=True)
      ]
      for s in array.addressable_shards
    }
    assert {s["device_id"]: s["index"] for s in p["shards"]} == placed, p["path"]


def test_an_unknown_target_device_is_an_error_before_compiling():
  with pytest.raises(UserError, match=r"--target_device='h900': use one of .*h100"):
    report(tiny_config(), target_device="h900")


def test_inspect_compiles_from_the_experiments_example_batch_without_opening_the_data(tmp_path):
  from trainer import components

  # The example batch is shaped and typed as the real data's batches.
  cfg = _cfg((2, 2, 2), "fsdp_tp")
  comp, spec = components.build_for_compile(cfg)
  real = components.local_batches(components.build(cfg))(0)
  assert {k: (v.shape[1:], v.dtype) for k, v in spec.items()} == {
    k: (v.shape[1:], v.dtype) for k, v in real.items()
  }
  assert all(v.shape[0] == cfg.global_batch_size for v in spec.values())
  # A cluster's packed data set that is not here: no error, and packing's extra inputs are there.
  packed = tiny_config(
    **{"data.source": "arrayrecord", "data.path": str(tmp_path / "absent"), "data.packing": True}
  )
  comp, spec = components.build_for_compile(packed)
  assert comp.sources is None and set(spec) == {"inputs", "targets", "weights", "segment_ids", "positions"}


def test_inspect_imports_neither_grain_nor_orbax():
  """Start-up pays only for what the mode uses: inspect reads no records and writes no checkpoint."""
  import subprocess
  import sys

  from tests.conftest import REPO

  code = "import sys, trainer.modes.inspect; print(sorted({'grain', 'orbax.checkpoint'} & set(sys.modules)))"
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_remat_and_a_chunked_loss_lower_the_compiled_steps_memory():
  """Switches that only trade memory for compute must show in the compiled step (the reference tests
  in test_objective.py show they keep the objective; a no-op would pass those)."""
  from trainer.modes.inspect import compile_train_step

  def temp_bytes(**overrides):
    cfg = tiny_config(**{"model.vocab_size": 2048, "data.seq_len": 64, "model.num_layers": 2, **overrides})
    return compile_train_step(cfg)[2].memory_analysis().temp_size_in_bytes

  scanned = temp_bytes(**{"model.scan_layers": True})
  assert temp_bytes(**{"model.scan_layers": True, "model.remat": "full"}) < 0.8 * scanned
  assert temp_bytes(**{"model.scan_layers": True, "model.loss_chunk": 8}) < 0.7 * scanned


def test_a_steps_memory_is_xlas_peak_on_a_tpu_and_the_sum_of_its_buffers_elsewhere(monkeypatch):
  """On a TPU v5e lm_125m's step held 14.63 GB (the allocator's 1.53 GB in use and 13.09 GB reserved for
  its temporaries) where XLA's peak said 14.60 GB and arguments + outputs - donated + temporaries 21.05
  GB: more than the chip, which sent local-tier copies to pinned host memory for nothing. On CPU, XLA's
  peak counts the arguments alone: the sum stays."""
  from trainer import device_memory
  from trainer.modes.inspect import compile_train_step

  m = compile_train_step(tiny_config())[2].memory_analysis()
  total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
  assert device_memory.program_bytes(m) == total and m.peak_memory_in_bytes < total
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert device_memory.program_bytes(m) == m.peak_memory_in_bytes


def test_device_kinds_map_to_their_peak_and_memory():
  from trainer.observe import hardware

  names = {
    "NVIDIA H100 80GB HBM3": "NVIDIA H100 SXM",
    "NVIDIA H100 PCIe": "NVIDIA H100 PCIe",
    "NVIDIA H200": "NVIDIA H200",
    "NVIDIA A100-SXM4-40GB": "NVIDIA A100 40GB",
    "NVIDIA A100-SXM4-80GB": "NVIDIA A100 80GB",
    "NVIDIA B200": "NVIDIA B200",
    "TPU v5 lite": "TPU v5e",
    "TPU v5": "TPU v5p",
    "TPU v6 lite": "TPU v6e",
  }
  assert {kind: hardware.for_device_kind(kind).name for kind in names} == names
  assert hardware.for_device_kind("cpu") is None and hardware.by_name("H200").memory_bytes == 141e9
  assert hardware.mfu(494.5e12, "NVIDIA H100 80GB HBM3", "gpu") == 0.5
  assert hardware.mfu(1e12, "cpu", "cpu") is None


def test_inspect_notes_a_dimension_left_unsplit_because_an_earlier_one_took_its_mesh_axis(tmp_path, capsys):
  """A rule putting `mlp` on fsdp, where `embed` already is: the MLP's (embed, mlp) weights can be split
  over fsdp along embed only, and inspect says so beside them; the down projection (mlp, embed) along
  mlp only."""
  from trainer.modes.inspect import inspect

  cfg = tiny_config(**{"sharding.rules": (("mlp", "fsdp"),)})
  out = inspect(cfg, str(tmp_path))
  notes = {p["path"]: p["notes"] for p in out["params"]}
  up = next(
    path for path, p in zip(notes, out["params"], strict=True) if p["logical_axes"] == ["embed", "mlp"]
  )
  assert notes[up] == [
    "dimension 1 ('mlp') is not split over 'fsdp': dimension 0 ('embed') already is, and one mesh axis "
    "cannot split two dimensions of one array"
  ]
  assert not notes["embed"]  # (vocab, embed): nothing taken twice.
  printed = capsys.readouterr().out
  assert f"  note: {up}: dimension 1 ('mlp') is not split over 'fsdp'" in printed, printed
