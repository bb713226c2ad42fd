"""The mesh's named axes (data, fsdp, expert, context, tensor): sizes from config, the short arguments, the
presets' expert rules, the first-step check's other layouts and the layout a checkpoint compares."""

import pytest

from errors import UserError
from tests.conftest import tiny_config
from trainer import mesh as mesh_lib
from trainer import sharding
from trainer.checkpoint import store
from trainer.checks import first_step
from trainer.config import assemble


def _mesh_cfg(**sizes):
  c = tiny_config().mesh
  c.update({a: 1 for a in mesh_lib.AXES} | {f"dcn_{a}": 1 for a in mesh_lib.ACROSS_HOSTS} | sizes)
  return c


def test_the_short_arguments_and_the_mesh_keys_name_the_same_axes_in_the_same_order():
  assert assemble.MESH_ARGS == mesh_lib.AXES
  c = assemble.apply_args(tiny_config(), "expert=2,fsdp=2")
  assert {a: c.mesh[a] for a in mesh_lib.AXES} == {
    "data": -1,
    "fsdp": 2,
    "expert": 2,
    "context": 1,
    "tensor": 1,
  }


@pytest.mark.parametrize(
  ("sizes", "devices", "shape"),
  [
    ({"data": -1, "expert": 2}, 8, (4, 1, 2, 1, 1)),
    ({"data": 2, "fsdp": 2, "expert": 2}, 8, (2, 2, 2, 1, 1)),
    ({"expert": -1, "dcn_expert": 2}, 8, (1, 1, 8, 1, 1)),  # 4 within each of 2 hosts.
    ({"data": -1, "expert": 4, "tensor": 2}, 8, (1, 1, 4, 1, 2)),
    ({"data": 2, "context": 4}, 8, (2, 1, 1, 4, 1)),
    ({"data": 3, "expert": 2}, 1, (1, 1, 1, 1, 1)),  # One device: every axis 1, whatever is asked.
  ],
)
def test_the_expert_axis_is_sized_like_the_others(sizes, devices, shape):
  assert mesh_lib.resolve_shape(_mesh_cfg(**sizes), devices) == shape


def test_a_mesh_that_does_not_cover_the_devices_names_every_axis():
  with pytest.raises(
    UserError, match=r"data\*fsdp\*expert\*context\*tensor = 1\*1\*3\*1\*1 = 3 but there are 8 devices"
  ):
    mesh_lib.resolve_shape(_mesh_cfg(expert=3), 8)
  with pytest.raises(
    UserError, match="at most one of mesh.data, mesh.fsdp, mesh.expert, mesh.context, mesh.tensor"
  ):
    mesh_lib.resolve_shape(_mesh_cfg(data=-1, expert=-1), 8)


@pytest.mark.parametrize("strategy", sorted(sharding.PRESETS))
def test_every_preset_splits_experts_over_expert_and_the_batch_over_it_too(strategy):
  rules = sharding.resolve_rules(strategy, ())
  table = dict(rules)
  assert sharding.batch_axes(rules) == ("data", "fsdp", "expert")
  assert table["experts"] == table["act_experts"] == "expert"
  assert table["act_seq"] == "context"  # The sequence of every activation, never the batch arrays.
  # Routed tokens after the all-to-all: their batch keeps data x fsdp, the experts take expert.
  assert table["moe_batch"] == ("data", "fsdp")


def test_an_expert_weight_keeps_its_other_splits_under_fsdp_tp():
  spec = sharding.logical_to_spec(("experts", "embed", "mlp"), sharding.resolve_rules("fsdp_tp", ()))
  assert tuple(spec) == ("expert", "fsdp", "tensor")


def test_the_first_step_checks_other_layouts_keep_the_expert_size():
  devices = list(range(8))
  assert first_step.candidates(devices, expert=2) == [
    ((4, 1, 2, 1, 1), "dp"),
    ((1, 4, 2, 1, 1), "fsdp"),
    ((2, 2, 2, 1, 1), "fsdp"),
    ((1, 2, 2, 1, 2), "fsdp_tp"),
  ]
  assert first_step.candidates(devices, context=4) == [((2, 1, 1, 4, 1), "dp"), ((1, 2, 1, 4, 1), "fsdp")]
  assert all(sizes[2] == 1 for sizes, _ in first_step.candidates(devices))  # A dense run: no expert split.
  other = first_step.other_config(tiny_config(**{"mesh.dcn_expert": 2}), (1, 4, 2, 1, 1), "fsdp")
  assert {a: other.mesh[a] for a in mesh_lib.AXES} == {
    "data": 1,
    "fsdp": 4,
    "expert": 2,
    "context": 1,
    "tensor": 1,
  }
  assert all(other.mesh[f"dcn_{a}"] == 1 for a in mesh_lib.ACROSS_HOSTS)


def test_a_checkpoint_saved_before_the_expert_axis_has_the_same_layout():
  now = {"mesh": {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}, "strategy": "fsdp_tp"}
  assert store.same_layout({"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "strategy": "fsdp_tp"}, now)
  assert not store.same_layout({"mesh": {"data": 4, "fsdp": 2, "tensor": 1}, "strategy": "fsdp_tp"}, now)
  assert not store.same_layout({**now, "mesh": {**now["mesh"], "expert": 2, "data": 1}}, now)
  assert not store.same_layout(None, now)  # A checkpoint without one: checked again.


def test_an_expert_axis_without_experts_is_a_warning_that_it_only_splits_the_batch(capsys, monkeypatch):
  from trainer import components

  monkeypatch.setattr(components, "_WARNED", set())  # Said once per process: this test's own.
  cfg = tiny_config(**{"mesh.data": -1, "mesh.fsdp": 2, "mesh.expert": 2, "mesh.tensor": 1})
  comp = components.build(cfg, with_data=False)
  assert sharding.batch_axes(comp.rules) == ("data", "fsdp", "expert")
  assert "warning: mesh.expert=2 but no parameter of this model is split over it" in capsys.readouterr().out
  cfg.model.moe.num_experts = 4
  components.build(cfg, with_data=False)
  assert "mesh.expert" not in capsys.readouterr().out
