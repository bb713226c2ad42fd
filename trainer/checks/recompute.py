"""Silent corruption where nothing is replicated: the step recomputed with its shards on other devices.

Under pure FSDP each device holds its own shard of every leaf, so there is no copy to compare
(trainer/checks/replicas.py sees only replicated leaves). Every `checks.recompute_every` steps, and on every
step that saves a checkpoint on schedule, the step runs a second time from a copy of the same state
and batch, on a mesh of the same shape whose devices are rotated within each process: every shard is
computed by another device of the same host. Both runs are the same program on the same logical
layout, so their results must be equal bit for bit. Per shard of every leaf of the new state, and
for the step's loss and gradient norm, checksums of the two results are compared.

What it can name: a device that computes its own part of the step wrong (its shards' update, its
share of a reduction) makes the shards it held differ in the run where it held them; it is the one
device common to every difference. What it sees but cannot name: a wrong computation before the
gradients are reduced (a device's forward or backward pass) reaches every shard. What it cannot see:
state corrupted in memory before the copy (both runs start from it; the save-time checksums prove
only that a checkpoint reads back as written, trainer/checkpoint/proof.py), and anything in a
process with a single device (nothing to rotate: the check is off there, and says so).
"""

import collections
import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from trainer.checks import replicas


def rotated_mesh(mesh: Mesh) -> Mesh | None:
  """The mesh with each device's place taken by the next device of the same process (in mesh
  order): each process keeps its shards, so batches and state move only within hosts. None when
  some process has a single device."""
  flat = list(mesh.devices.flat)
  by_process = collections.defaultdict(list)
  for i, d in enumerate(flat):
    by_process[d.process_index].append(i)
  if min(len(places) for places in by_process.values()) < 2:
    return None
  rotated = list(flat)
  for places in by_process.values():
    for here, there in zip(places, places[1:] + places[:1], strict=True):
      rotated[here] = flat[there]
  return Mesh(np.array(rotated).reshape(mesh.devices.shape), mesh.axis_names)


class RecomputeCheck:
  def __init__(self, comp, microbatches: int, make_train_step, every: int):
    self.every = every
    mesh = rotated_mesh(comp.mesh) if every else None
    self.on = mesh is not None
    if not self.on:
      return
    on_b = lambda s: NamedSharding(mesh, s.spec)
    self.comp = dataclasses.replace(
      comp,
      mesh=mesh,
      shardings=jax.tree.map(on_b, comp.shardings),
      batch_sharding=on_b(comp.batch_sharding),
    )
    self.step = make_train_step(self.comp, microbatches)

  def copy(self, state, batch):
    """The state and batch on the rotated mesh: copies the step cannot donate away."""
    return jax.device_put(state, self.comp.shardings), jax.device_put(batch, self.comp.batch_sharding)

  def check(self, copied, state, metrics, mesh: Mesh, step: int) -> None:
    """Runs the step on the copy and compares it with the trained `state` and `metrics`; raises
    replicas.ReplicaMismatch naming the device (or saying it cannot) when they differ."""
    with jax.set_mesh(self.comp.mesh):
      other, other_metrics = self.step(*copied)
    scalars = ("loss", "grad_norm")
    leaves = [(n, x) for n, x in replicas.named_leaves(state) if x.size]
    other_leaves = [x for n, x in replicas.named_leaves(other) if x.size]
    sums = _per_device(mesh, [x for _, x in leaves])
    other_sums = _per_device(self.comp.mesh, other_leaves)
    witnesses = []  # Per differing shard: the devices that held it in either run.
    shards = 0
    for j, (name, x) in enumerate(leaves):
      here = _by_shard(mesh, x.sharding.devices_indices_map(x.shape), sums[:, j])
      there = _by_shard(
        self.comp.mesh, other_leaves[j].sharding.devices_indices_map(x.shape), other_sums[:, j]
      )
      for shard, (values, holders) in here.items():
        shards += 1
        other_values, other_holders = there[shard]
        if values != other_values:
          witnesses.append((name, set(holders) | set(other_holders)))
    metrics_differ = [k for k in scalars if _bits(metrics[k]) != _bits(other_metrics[k])]
    if witnesses or metrics_differ:
      raise replicas.ReplicaMismatch(_verdict(step, witnesses, shards, metrics_differ))


def _bits(x) -> bytes:
  return np.asarray(jax.device_get(x)).tobytes()


def _per_device(mesh, arrays) -> np.ndarray:
  """[devices in mesh order, leaves, 2] checksums of each device's block (replicas.py's)."""
  sums = replicas.checksums(mesh, arrays)
  return np.asarray(multihost_utils.process_allgather(sums, tiled=True))


def _by_shard(mesh, index, sums) -> dict:
  """{shard index: (the checksums of its holders' copies, the holders)}."""
  out = {}
  for k, d in enumerate(mesh.devices.flat):
    values, holders = out.setdefault(str(index[d]), ([], []))
    values.append(tuple(sums[k]))
    holders.append(d)
  return {shard: (sorted(values), holders) for shard, (values, holders) in out.items()}


def _verdict(step: int, witnesses, shards: int, metrics_differ) -> str:
  what = [f"{len(witnesses)} of {shards} shards"] if witnesses else []
  what += metrics_differ
  head = f"step {step}: the step recomputed with its shards on other devices differs ({', '.join(what)})"
  common = set.intersection(*(w for _, w in witnesses)) if witnesses else set()
  if len(common) == 1:
    (d,) = common
    names = ", ".join(dict.fromkeys(n for n, _ in witnesses))
    return (
      f"{head}: device {d.id} (process {d.process_index}) computed its part of the step wrong "
      f"({names[:200]}); nothing was saved from this step: take that host out and resume from the "
      "newest checkpoint"
    )
  return (
    f"{head}: a device computed wrong before the gradients were reduced, or more than one did, so the "
    "check cannot name it; nothing was saved from this step: check the hosts (each alone: "
    "--mode=verify on one host's devices), then resume from the newest checkpoint"
  )
