"""A device whose copy of a replicated array differs is named, and nothing is saved after it."""

import os

import jax
import pytest

from tests.conftest import tiny_config
from trainer import replicas
from trainer import train as train_lib


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
  state = components.init_state(comp, config)
  replicas.check(state, comp.mesh, 1)  # Healthy: silent.
  bad = state.replace(params=replicas.perturb_one_copy(state.params, jax.devices()[6]))
  with pytest.raises(
    replicas.ReplicaMismatch, match=r"on devices 2 \(process 0\), 6 \(process 0\), no majority"
  ):
    replicas.check(bad, comp.mesh, 1)
