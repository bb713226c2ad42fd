"""--mode=verify: does the sharded update optimize the same objective as one device?

Runs K optimizer steps twice from the same initial state on the same global batches: once on the
configured mesh and strategy, once on a single device. Prints, per step and parameter group, the
loss difference and the gradient and parameter differences as whole-group norm ratios:
  grad_ratio  = |g_mesh - g_one| / |g_one|
  param_ratio = |theta_mesh - theta_one| / |theta_one - theta_0|   (difference relative to the update)
Single elements are shown for information only: AdamW magnifies last-bit differences in near-zero
gradients, so element-wise comparison is not a meaningful test.
"""

import json
import os

import jax
import numpy as np

from data import pipeline
from errors import UserError
from trainer import components
from trainer import state as state_lib
from trainer.metrics import console, device_label
from trainer.step import make_train_step

# (loss relative difference, gradient/parameter norm ratio) by compute dtype; measured in tests.
TOLERANCES = {"float32": (1e-5, 1e-3), "bfloat16": (2e-3, 5e-2)}


def _groups(tree) -> dict[str, list[np.ndarray]]:
  """Leaves grouped by their module path (the path without the leaf's own name)."""
  out: dict[str, list[np.ndarray]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = state_lib.path_keys(path)
    out.setdefault("/".join(keys[:-1]) or keys[-1], []).append(np.asarray(leaf, np.float64))
  return out


def _norm(leaves) -> float:
  return float(np.sqrt(sum(np.sum(x * x) for x in leaves)))


def _worst_element(a, b) -> float:
  return max(float(np.max(np.abs(x - y) / (np.abs(y) + 1e-12))) for x, y in zip(a, b, strict=True))


def compare(mesh_tree, one_tree, base_tree=None) -> dict[str, tuple[float, float]]:
  """Per group: (|mesh - one| / |one - base or one|, worst element's relative difference)."""
  mesh_g, one_g = _groups(mesh_tree), _groups(one_tree)
  base_g = _groups(base_tree) if base_tree is not None else None
  out = {}
  for name, one in one_g.items():
    diff = _norm([m - o for m, o in zip(mesh_g[name], one, strict=True)])
    scale = _norm([o - b for o, b in zip(one, base_g[name], strict=True)]) if base_g else _norm(one)
    out[name] = (diff / max(scale, 1e-30), _worst_element(mesh_g[name], one))
  return out


def verify(config, workdir: str, steps: int = 3) -> bool:
  if jax.process_count() > 1:
    raise UserError("--mode=verify runs in one process: start it without the distributed flags")
  dtype = config.model.compute_dtype
  loss_tol, ratio_tol = TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
  sharded = components.build(config)
  single = components.build(config, devices=jax.devices()[:1])
  b = config.global_batch_size

  state = components.init_state(sharded, config)
  # Through the host: two independent copies of one initial state (each step donates its input).
  ref = jax.device_put(jax.device_get(state), single.shardings)
  theta0 = jax.device_get(state.params)
  step_mesh = make_train_step(sharded, config.microbatches, with_grads=True)
  step_one = make_train_step(single, config.microbatches, with_grads=True)
  local = components.local_batches(sharded)

  console(
    f"verify: {device_label()} on mesh {dict(sharded.mesh.shape)}, strategy "
    f"{config.sharding.strategy}, microbatches {config.microbatches}, {dtype}\n"
    f"   vs {device_label(jax.devices()[:1])}; {steps} steps; tolerance: loss {loss_tol:g} relative, "
    f"grad/param norm ratio {ratio_tol:g}"
  )
  console(
    f"{'step':>4}  {'group':<24} {'loss_rel':>9} {'grad_ratio':>10} {'param_ratio':>11} "
    f"{'worst_elem':>10}  result"
  )
  rows, ok = [], True
  for t in range(steps):
    if sharded.plan.valid_rows(t) == 0:
      raise UserError(f"global batch {t} has no valid examples; refusing an empty step")
    batch = local(t)
    with jax.set_mesh(sharded.mesh):
      state, m_mesh = step_mesh(state, pipeline.to_global(batch, sharded.batch_sharding, b))
    with jax.set_mesh(single.mesh):
      ref, m_one = step_one(ref, pipeline.to_global(batch, single.batch_sharding, b))
    m_mesh, m_one = jax.device_get((m_mesh, m_one))
    loss_rel = abs(float(m_mesh["loss"]) - float(m_one["loss"])) / abs(float(m_one["loss"]))
    grads = compare(m_mesh["grads"], m_one["grads"])
    params = compare(jax.device_get(state.params), jax.device_get(ref.params), theta0)
    for group, (grad_ratio, grad_worst) in grads.items():
      param_ratio, param_worst = params[group]
      passed = loss_rel <= loss_tol and grad_ratio <= ratio_tol and param_ratio <= ratio_tol
      ok &= passed
      rows.append(
        {
          "step": t + 1,
          "group": group,
          "loss_rel": loss_rel,
          "grad_ratio": grad_ratio,
          "param_ratio": param_ratio,
          "worst_element": max(grad_worst, param_worst),
          "pass": passed,
        }
      )
      console(
        f"{t + 1:>4}  {group:<24} {loss_rel:>9.1e} {grad_ratio:>10.1e} {param_ratio:>11.1e} "
        f"{max(grad_worst, param_worst):>10.1e}  {'PASS' if passed else 'FAIL'}"
      )
  console(f"verify: {'PASS' if ok else 'FAIL'}")
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "verify.json"), "w") as f:
      json.dump({"devices": device_label(), "tolerance": [loss_tol, ratio_tol], "rows": rows}, f, indent=1)
  return ok
