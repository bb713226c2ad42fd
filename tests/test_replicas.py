"""A device whose copy of a replicated array differs is named, and nothing is saved after it."""

import os

import jax
import pytest

from tests.conftest import tiny_config
from trainer import train as train_lib
from trainer.checks import replicas


def _corrupting(after_calls: int, device):
  """make_train_step whose compiled step changes `device`'s copy of one replicated parameter once,
  after its `after_calls`-th call: what silent data corruption on that device would leave."""
  real = train_lib.make_train_step

  def make(comp, microbatches):
    step = real(comp, microbatches)

    class Lowered:
      def __init__(self, lowered):
        self.lowered = lowered

      def compile(self):
        compiled, calls = self.lowered.compile(), [0]

        def run(state, batch):
          state, metrics = compiled(state, batch)
          calls[0] += 1
          if calls[0] == after_calls:
            state = state.replace(params=replicas.perturb_one_copy(state.params, device))
          return state, metrics

        run.cost_analysis = compiled.cost_analysis
        return run

    class Step:
      def lower(self, *args):
        return Lowered(step.lower(*args))

    return Step()

  return make


def test_a_corrupted_copy_on_one_of_8_devices_is_named_and_never_saved(tmp_path, monkeypatch):
  device = jax.devices()[5]
  monkeypatch.setattr(train_lib, "make_train_step", _corrupting(5, device))
  config = tiny_config(
    steps=8, **{"mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1, "sharding.strategy": "dp"}
  )
  config.checks.replica_every, config.checkpoint.every = 3, 4
  with pytest.raises(replicas.ReplicaMismatch) as e:
    train_lib.train(config, str(tmp_path))
  # Corrupted in step 5; the next check, at step 6, names device 5 alone (a save checks first too).
  assert str(e.value).startswith(
    "step 6: copies that must be identical differ: device 5 (process 0): params/"
  )
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]


def test_two_copies_that_differ_are_both_named():
  """With two copies (FSDP over 4, data 2) there is no majority: both devices are named."""
  from trainer import components

  config = tiny_config(**{"mesh.data": 2, "mesh.fsdp": 4, "mesh.tensor": 1, "sharding.strategy": "fsdp"})
  comp = components.build(config)
  state = components.fresh_state(comp, config)
  replicas.check(state, comp.mesh, 1)  # Healthy: silent.
  bad = state.replace(params=replicas.perturb_one_copy(state.params, jax.devices()[6]))
  with pytest.raises(
    replicas.ReplicaMismatch, match=r"on devices 2 \(process 0\), 6 \(process 0\), no majority"
  ):
    replicas.check(bad, comp.mesh, 1)


def _wrong_on(device):
  """make_train_step whose optimizer update comes out wrong on `device` alone, wherever the mesh puts
  it: one element of the shard that device holds of the first sharded parameter is off by 1e-3 in
  every update. A device computing its own part of the step wrong; the stored state is not touched."""
  import dataclasses

  import numpy as np
  import optax

  real = train_lib.make_train_step

  def make(comp, microbatches):
    tx = comp.tx
    specs = jax.tree.leaves(comp.shardings.params)

    def update(grads, opt_state, params, **extra_args):
      updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
      leaves, treedef = jax.tree_util.tree_flatten(updates)
      i = next(i for i, s in enumerate(specs) if any(s.spec))  # Sharded: no copy on another device.
      delta = np.zeros(leaves[i].shape, leaves[i].dtype)
      block = specs[i].devices_indices_map(leaves[i].shape)[device]
      delta[tuple(sl.start or 0 for sl in block)] = 1e-3
      leaves[i] = leaves[i] + delta
      return jax.tree_util.tree_unflatten(treedef, leaves), opt_state

    return real(
      dataclasses.replace(comp, tx=optax.GradientTransformationExtraArgs(tx.init, update)), microbatches
    )

  return make


def test_under_pure_fsdp_a_device_computing_wrong_is_named_before_the_next_save(tmp_path, monkeypatch):
  """Pure FSDP over 8 devices: no leaf but the step counter has copies, so the replica check sees
  nothing. The recompute check runs the step again with every shard on another device and names the
  one device common to the differences, before anything is saved; a healthy run passes it and trains
  exactly as without it."""
  from tests.conftest import train_losses

  fsdp = {"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1, "sharding.strategy": "fsdp"}
  config = tiny_config(steps=4, **fsdp)
  config.checks.recompute_every, config.checks.replica_every, config.checkpoint.every = 1, 1, 2
  train_lib.train(config, str(tmp_path / "checked"))
  plain = tiny_config(steps=4, **fsdp)
  train_lib.train(plain, str(tmp_path / "plain"))
  assert train_losses(str(tmp_path / "checked")) == train_losses(str(tmp_path / "plain"))

  monkeypatch.setattr(train_lib, "make_train_step", _wrong_on(jax.devices()[5]))
  config.checks.recompute_every, config.checks.replica_every, config.checkpoint.every = 3, 3, 4
  with pytest.raises(replicas.ReplicaMismatch) as e:
    train_lib.train(config, str(tmp_path / "wrong"))
  message = str(e.value)
  assert message.startswith("step 3: the step recomputed with its shards on other devices differs"), message
  assert "device 5 (process 0) computed its part of the step wrong" in message, message
  assert os.listdir(tmp_path / "wrong" / "checkpoints") == []


def test_a_difference_in_every_shard_is_reported_without_naming_a_device():
  from trainer.checks import recompute

  devices = jax.devices()
  witnesses = [(f"params/w{i}", {devices[i], devices[(i + 1) % 8]}) for i in range(8)]
  message = recompute._verdict(7, witnesses, 8, ["loss"])
  assert "8 of 8 shards, loss" in message and "cannot name it" in message and "(process" not in message
