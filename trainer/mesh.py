"""The device mesh (data, fsdp, expert, context, tensor) from config, and logical-rule shardings on it."""

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from model.partitioning import logical_to_spec

# Outermost first: an axis's collectives run over devices that far apart in the device order. The
# batch is split over data, fsdp and expert (trainer/sharding.py), the experts over expert, so
# attention is not repeated on every expert shard; context splits the activations' sequence (its
# keys and values travel a ring every layer); tensor, innermost, takes the fastest links.
AXES = ("data", "fsdp", "expert", "context", "tensor")
# The axes that may also span hosts (`mesh.dcn_<axis>`): tensor and context parallelism's per-layer
# collectives need within-host links, and a process reads whole rows, its devices their chunks.
ACROSS_HOSTS = ("data", "fsdp", "expert")


def dcn_shape(mesh_cfg) -> tuple[int, ...]:
  """Each axis's across-host size (1 for context and tensor)."""
  return tuple(mesh_cfg[f"dcn_{a}"] if a in ACROSS_HOSTS else 1 for a in AXES)


def resolve_shape(mesh_cfg, num_devices: int) -> tuple[int, ...]:
  """Within-host axis sizes times across-host sizes, with one -1 filled from the device count.

  On a single device every axis is 1, whatever the config says: any config runs unchanged on one
  device for debugging, through the same code path.
  """
  if num_devices == 1:
    return (1,) * len(AXES)
  dcn = dcn_shape(mesh_cfg)
  ici = [mesh_cfg[a] for a in AXES]
  across = [mesh_cfg[f"dcn_{a}"] for a in ACROSS_HOSTS]
  if ici.count(-1) > 1:
    raise UserError(f"at most one of {', '.join(f'mesh.{a}' for a in AXES)} may be -1")
  if any(s == 0 or s < -1 for s in ici) or any(s < 1 for s in dcn):
    raise UserError(f"mesh sizes must be positive (or one -1): got {ici}, dcn {across}")
  known = math.prod(s for s in ici if s != -1) * math.prod(dcn)
  if -1 in ici:
    if num_devices % known:
      raise UserError(f"mesh axes {ici} x dcn {across} cannot divide {num_devices} devices")
    ici[ici.index(-1)] = num_devices // known
  shape = tuple(i * d for i, d in zip(ici, dcn, strict=True))
  if math.prod(shape) != num_devices:
    raise UserError(
      f"mesh {'*'.join(AXES)} = {'*'.join(map(str, shape))} = {math.prod(shape)} but there are "
      f"{num_devices} devices; change --config.mesh.* (or --cpu_devices)"
    )
  return shape


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  shape = resolve_shape(mesh_cfg, len(devices))
  dcn = dcn_shape(mesh_cfg)
  if math.prod(dcn) > 1 and len(devices) > 1:
    if math.prod(dcn) != jax.process_count():
      raise UserError(
        f"{' * '.join(f'mesh.dcn_{a}' for a in ACROSS_HOSTS)} = {math.prod(dcn)} must equal the number "
        f"of processes ({jax.process_count()}): the outer axes span hosts"
      )
    # Across-host axes outermost, so FSDP/tensor collectives stay on the fast within-host links.
    ici = tuple(s // d for s, d in zip(shape, dcn, strict=True))
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
  else:
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  return Mesh(np.asarray(grid), AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """Batch arrays of any rank: rows (the first dimension) split over the axes `batch` maps to."""
  return NamedSharding(mesh, logical_to_spec(("batch",), rules))


def tree_shardings(mesh: Mesh, logical_specs, rules):
  """A tree of logical PartitionSpecs -> a tree of NamedShardings on `mesh`."""
  return jax.tree.map(
    lambda spec: NamedSharding(mesh, logical_to_spec(tuple(spec), rules)),
    logical_specs,
    is_leaf=lambda x: isinstance(x, P),
  )


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
