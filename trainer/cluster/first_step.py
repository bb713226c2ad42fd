"""checks.first_step: XLA's SPMD partitioner checked on the real devices, before a run's first step and
after a restore onto another mesh.

The first batch's gradients are computed twice from the same state, on the same devices: with the
configured partitioning, and with another that fits (data-parallel over every device, else pure
FSDP; whichever differs from the configured one and whose compiled memory estimate fits). Both are the
gradient of one objective, so they agree to verify's tolerances unless XLA partitioned one of them
wrongly (a missing all-reduce, say: tests/xla_repro_fork.py). A disagreement ends the run with one
line naming the parameters and exit 6 (trainer/cluster/failures.py): deterministic, so a restart
would fail the same way; another mesh or sharding.rules avoids it.
"""

import jax
import jax.numpy as jnp
import numpy as np

from errors import UserError
from trainer import components
from trainer import mesh as mesh_lib
from trainer.agreement import TOLERANCES, group
from trainer.cluster import failures, multihost
from trainer.mesh import replicated
from trainer.observe.metrics import console
from trainer.step import example_keys, sums_and_grads


class Miscompiled(UserError):
  exit_code = failures.MISCOMPILED_EXIT


def candidates(config, devices) -> list:
  """Other partitionings of the same devices, most replicated first: (mesh sizes, strategy). Models
  that fit only sharded get pure FSDP, or FSDP over half the devices with data or tensor over two."""
  n = len(devices)
  here = (dict(mesh_lib.make_mesh(config.mesh, devices).shape), config.sharding.strategy)
  halves = [((2, n // 2, 1), "fsdp"), ((1, n // 2, 2), "fsdp_tp")] if n % 2 == 0 and n > 2 else []
  out = []
  for sizes, strategy in [((n, 1, 1), "dp"), ((1, n, 1), "fsdp"), *halves]:
    if (dict(zip(mesh_lib.AXES, sizes, strict=True)), strategy) != here:
      out.append((sizes, strategy))
  return out


def other_config(config, sizes, strategy):
  other = config.copy_and_resolve_references()
  other.mesh.update(
    dict(zip(("data", "fsdp", "tensor"), sizes, strict=True)) | {"dcn_data": 1, "dcn_fsdp": 1}
  )
  other.sharding.strategy = strategy
  other.sharding.rules = ()  # The preset's: the configured rules are what is being checked.
  return other


def grads_program(comp):
  """jit(params, variables, batch, rng) -> divided gradients, on comp's shardings (no update)."""

  def grads(params, variables, batch, base_rng):
    rng = example_keys(base_rng, 0, jax.tree.leaves(batch)[0].shape[0])
    _, count, _, grad_sums, _ = sums_and_grads(
      comp.loss_sums, comp.mdef, params, variables, batch, rng, comp.rules
    )
    return jax.tree.map(lambda g: g / count, grad_sums)

  sh = comp.shardings
  in_shardings = (sh.params, sh.variables, comp.batch_sharding, sh.rng)
  return jax.jit(grads, in_shardings=in_shardings, out_shardings=sh.params)


def _fits(compiled) -> bool:
  """Whether the compiled program's memory estimate fits this process's devices' free memory (True
  where they do not say: CPU)."""
  memory = compiled.memory_analysis()
  stats = jax.local_devices()[0].memory_stats() or {}
  if memory is None or "bytes_limit" not in stats:
    return True
  needed = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
  return needed - memory.alias_size_in_bytes <= stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def check(comp, config, state, batch) -> None:
  """Raises Miscompiled when the configured partitioning's first gradients differ from another's."""
  devices = list(comp.mesh.devices.flat)
  args = (state.params, state.variables, batch, state.rng)
  with jax.set_mesh(comp.mesh):
    mine = grads_program(comp)(*args)
  for sizes, strategy in candidates(config, devices):
    other = components.build(other_config(config, sizes, strategy), devices, with_data=False)
    sh = other.shardings
    shardings = (sh.params, sh.variables, other.batch_sharding, sh.rng)
    shaped = lambda s, x: jax.tree.map(lambda y: jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=s), x)
    shapes = jax.tree.map(shaped, shardings, args)  # One sharding for every array of the batch.
    with jax.set_mesh(other.mesh):
      compiled = grads_program(other).lower(*shapes).compile()  # Nothing is moved before it fits.
      # Every process takes the same partitioning, or the collectives would not match.
      if not multihost.all_agree(f"first_step_fits_{strategy}_{sizes}", _fits(compiled), timeout_s=600):
        continue
      theirs = compiled(*jax.device_put(args, shardings))
    ratios = _ratios(comp, mine, jax.device_put(theirs, comp.shardings.params))
    _judge(ratios, config, (dict(comp.mesh.shape), dict(other.mesh.shape)), strategy)
    return
  console("warning: checks.first_step: no other partitioning of these devices fits; not checked")


def _ratios(comp, mine, theirs) -> dict[str, float]:
  """Per parameter group, |g_configured - g_other| / |g_other|: the squared sums are taken on the
  devices, so only two scalars per leaf reach the host (a model's gradients may not fit there)."""
  squares = lambda a, b: jnp.stack(
    [jnp.sum(jnp.square(a - b), dtype=jnp.float32), jnp.sum(jnp.square(b), dtype=jnp.float32)]
  )
  with jax.set_mesh(comp.mesh):
    sums = jax.jit(lambda a, b: jax.tree.map(squares, a, b), out_shardings=replicated(comp.mesh))(
      mine, theirs
    )
  totals: dict[str, np.ndarray] = {}
  for path, pair in jax.tree_util.tree_flatten_with_path(sums)[0]:  # Replicated: every process has them.
    totals[group(path)] = totals.get(group(path), 0.0) + np.asarray(pair.addressable_data(0), np.float64)
  return {g: float(np.sqrt(d) / max(np.sqrt(n), 1e-30)) for g, (d, n) in totals.items()}


def _judge(ratios: dict, config, meshes: tuple[dict, dict], strategy: str) -> None:
  """A Miscompiled naming the groups beyond verify's norm-ratio tolerance, else one line."""
  _, tolerance = TOLERANCES.get(config.model.compute_dtype, TOLERANCES["bfloat16"])
  bad = sorted((g for g, r in ratios.items() if not r <= tolerance), key=lambda g: -ratios[g])
  here, mesh = meshes
  if bad:
    worst = ", ".join(f"{g} ({ratios[g]:.1e})" for g in bad[:4]) + (" ..." if len(bad) > 4 else "")
    raise Miscompiled(
      f"checks.first_step: the first step's gradients on mesh {here} differ from those on mesh {mesh} "
      f"(strategy {strategy}) for {worst}, beyond verify's {tolerance:g}: XLA partitioned the step "
      "wrongly; use another mesh or sharding.rules (restarting fails the same way)"
    )
  console(
    f"checks.first_step: the first gradients agree with mesh {mesh} (strategy {strategy}): worst "
    f"{max(ratios.values(), default=0.0):.1e} of {tolerance:g}"
  )
