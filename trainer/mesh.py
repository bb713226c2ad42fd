"""The device mesh (data, fsdp, tensor) from config, and logical-rule shardings on it."""

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from model.partitioning import logical_to_spec

AXES = ("data", "fsdp", "tensor")


def resolve_shape(mesh_cfg, num_devices: int) -> tuple[int, int, int]:
  """Within-host axis sizes times across-host sizes, with one -1 filled from the device count.

  On a single device every axis is 1, whatever the config says: any config runs unchanged on one
  device for debugging, through the same code path.
  """
  if num_devices == 1:
    return (1, 1, 1)
  dcn = (mesh_cfg.dcn_data, mesh_cfg.dcn_fsdp, 1)
  ici = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
  if ici.count(-1) > 1:
    raise UserError("at most one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
  if any(s == 0 or s < -1 for s in ici) or any(s < 1 for s in dcn):
    raise UserError(f"mesh sizes must be positive (or one -1): got {ici}, dcn {dcn[:2]}")
  known = math.prod(s for s in ici if s != -1) * math.prod(dcn)
  if -1 in ici:
    if num_devices % known:
      raise UserError(f"mesh axes {ici} x dcn {dcn[:2]} cannot divide {num_devices} devices")
    ici[ici.index(-1)] = num_devices // known
  shape = tuple(i * d for i, d in zip(ici, dcn, strict=True))
  if math.prod(shape) != num_devices:
    raise UserError(
      f"mesh data*fsdp*tensor = {'*'.join(map(str, shape))} = {math.prod(shape)} but there are "
      f"{num_devices} devices; change --config.mesh.* (or --cpu_devices)"
    )
  return shape


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else devices
  shape = resolve_shape(mesh_cfg, len(devices))
  dcn = (mesh_cfg.dcn_data, mesh_cfg.dcn_fsdp, 1)
  if math.prod(dcn) > 1 and len(devices) > 1:
    if math.prod(dcn) != jax.process_count():
      raise UserError(
        f"mesh.dcn_data * mesh.dcn_fsdp = {math.prod(dcn)} must equal the number of processes "
        f"({jax.process_count()}): the outer axes span hosts"
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
