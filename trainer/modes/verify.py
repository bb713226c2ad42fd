"""--mode=verify: does the sharded update optimize the same objective, and is it the objective?

On global batches verify builds to be hard (a full batch; an epoch's last, partial batch, where one
device's rows are partly padding and the others' only padding; the next epoch's first), with the
configured microbatches, it checks each property of trainer/modes/objective_checks.py against an
independent calculation on one device (additivity, padding_inert, one_division), make_batch on
slices of rows as processes apply it (rows_separate), the gradient norm on 1, 2, 4 and 8 devices
(device_count), and runs K optimizer steps twice from the same initial state: once on the configured
mesh and strategy, once on a single device (for a model with state beyond parameters, the variables
each step leaves are compared too: `variables`, a FAIL naming one the step cannot keep). Prints a
PASS/FAIL line per property and step (SKIP, with the reason, for one this set-up cannot check: a
one-device mesh, a batch without padding),
and per step and parameter group the loss difference and the gradient and parameter differences as
whole-group norm ratios (mesh_vs_one):
  grad_ratio  = |g_mesh - g_one| / |g_one|
  param_ratio = |theta_mesh - theta_one| / |theta_one - theta_0|   (difference relative to the update)
Single elements are shown for information only: AdamW magnifies last-bit differences in near-zero
gradients, so element-wise comparison is not a meaningful test.
"""

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from data import pipeline
from trainer import components, rundir
from trainer import mesh as mesh_lib
from trainer import sharding as sharding_lib
from trainer.checks.compare import TOLERANCES, compare
from trainer.cluster import multihost
from trainer.modes import objective_checks
from trainer.observe.metrics import console, device_label
from trainer.step import StateLost, example_keys, make_train_step


def _host(tree):
  """A tree of (possibly process-spanning) arrays as numpy on every process."""
  return multihost_utils.process_allgather(tree, tiled=True)


def verify(config, workdir: str, steps: int = 3) -> bool:
  """With several processes, the sharded steps run across all of them, and every process repeats the
  one-device calculations on its first local device."""
  dtype = config.model.compute_dtype
  loss_tol, ratio_tol = TOLERANCES.get(dtype, TOLERANCES["bfloat16"])
  sharded = components.build(config)
  one_device = jax.local_devices()[:1]
  single = components.build(config, devices=one_device)
  b, m = config.global_batch_size, config.microbatches

  # The batches: record ids from the real train source, over an "epoch" of b + partial records, so
  # that batch 1 is an epoch's last batch with `partial` valid rows and batch 2 starts the next epoch.
  shards = math.prod(sharded.mesh.shape[a] for a in sharding_lib.batch_axes(sharded.rules))
  partial = objective_checks.example_rows(b, shards)
  plan = pipeline.BatchPlan(min(len(sharded.sources.train), b + partial), b, config.seed)
  batches = lambda rows: pipeline.LocalBatches(sharded.sources.train, plan, rows, sharded.sources.make_batch)
  local = batches((0, b))  # The whole batch, for the one-device calculations.
  # This process's rows of the mesh's batch, made from its own rows alone, as training makes them.
  mine = batches(pipeline.process_rows(sharded.batch_sharding, b))
  slices = max(2, min(shards, b)) if b > 1 else 1  # As many processes as could each hold a shard.
  pieces = [batches((i * b // slices, (i + 1) * b // slices)) for i in range(slices)]
  on_one = sharded.mesh.size == 1
  coupled = sharded.experiment.COUPLES_EXAMPLES

  state = components.fresh_state(sharded, config)
  # Through the host: independent copies of one initial state (each step donates its input).
  initial = _host(state)
  ref = jax.device_put(initial, single.shardings)
  step_mesh = make_train_step(sharded, m, with_grads=True)
  step_one = make_train_step(single, m, with_grads=True)
  reference = objective_checks.Reference(sharded.loss_sums, single.mdef, one_device[0])

  console(
    f"verify: {device_label()} on mesh {dict(sharded.mesh.shape)}, strategy "
    f"{config.sharding.strategy}, microbatches {m}, {dtype}\n"
    f"   vs {device_label(one_device)}; {steps} steps of {b} rows, step 2 with "
    f"{_valid_rows(plan.valid_rows(1), b)}; tolerance: loss {loss_tol:g} relative, "
    f"grad/param norm ratio {ratio_tol:g}"
  )
  # device_count: the padded step's gradient norm on one device, on the configured mesh, and all
  # data-parallel over the other device counts of 2, 4 and 8, from the same state. With several
  # processes, every process takes part in the sharded steps; process 0 alone does the one-device
  # calculations and the report, and the verdict is shared.
  padded, main = min(1, steps - 1), jax.process_index() == 0
  checks, rows, norms = [], [], {}
  for t in range(steps):
    valid, batch = plan.valid(t), local(t)
    params, variables = _host((state.params, state.variables))  # Before this step's update.
    try:
      with jax.set_mesh(sharded.mesh):
        state, m_mesh = step_mesh(state, pipeline.to_global(mine(t), sharded.batch_sharding, b))
    except StateLost as e:  # Found while tracing, the same on every process: nothing more to step.
      checks = [objective_checks.Check("variables", t + 1, math.inf, 0.0, str(e), _LOST)]
      break
    m_mesh, params_mesh, variables_mesh = _host((m_mesh, state.params, state.variables))
    if not main:
      continue
    if t == padded:
      norms = _grad_norms(config, jax.device_get(ref), batch, skip=(1, sharded.mesh.size))
    with jax.set_mesh(single.mesh):
      ref, m_one = step_one(ref, pipeline.to_global(batch, single.batch_sharding, b))
    m_one = jax.device_get(m_one)
    if t == padded:
      norms.update({1: float(m_one["grad_norm"]), sharded.mesh.size: float(m_mesh["grad_norm"])})
    rng = np.asarray(example_keys(jnp.asarray(initial.rng), t, b))  # The keys the step drew.
    calc = reference.calculate(params, variables, batch, rng, valid, halves=not coupled)
    tols = (loss_tol, ratio_tol)
    checks += [
      objective_checks.additivity(calc, t + 1, valid, tols) if not coupled else None,
      objective_checks.padding_inert(calc, t + 1, valid, loss_tol),
      objective_checks.one_division(calc, t + 1, m_mesh["loss"], m_mesh["grads"], tols),
      objective_checks.rows_separate(batch, [piece(t) for piece in pieces], t + 1) if b > 1 else None,
    ]
    if variables and not on_one:
      checks.append(_variables_check(t + 1, variables_mesh, jax.device_get(ref.variables), ratio_tol))
    if not on_one:
      rows += _mesh_rows(t + 1, m_mesh, m_one, params_mesh, jax.device_get(ref.params), initial.params, tols)
  if main:
    if norms:  # (None when the steps stopped at a variable they cannot keep.)
      checks.append(objective_checks.device_count(norms, padded + 1, ratio_tol))
    checks = [c for c in checks if c is not None]
    checks += _skipped(checks, on_one, b, coupled)
  ok = multihost.all_agree("verify", _report(checks, rows) if main else True, timeout_s=600)
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(rundir.mode_output(workdir, "verify"), "w") as f:
      out = {
        "verdict": "PASS" if ok else "FAIL",
        "devices": device_label(),
        "mesh": dict(sharded.mesh.shape),
        "strategy": config.sharding.strategy,
        "compute_dtype": dtype,
        "microbatches": m,
        "tolerance": {"loss_relative": loss_tol, "norm_ratio": ratio_tol},
        "properties": [{**dataclasses.asdict(c), "result": c.result} for c in checks],
        "rows": rows,
      }
      json.dump(out, f, indent=1)
  return ok


_LOST = (
  "the model writes a variable in training that the train state does not hold: create every variable "
  "in build_model, with the shape and dtype training gives it (docs/getting-started/first-fork.md, State "
  "beyond parameters)"
)


def _variables_check(step, mesh_tree, one_tree, tolerance) -> objective_checks.Check:
  """The variables training's forward pass left (a BatchNorm's running statistics), on the mesh
  against one device: |v_mesh - v_one| / |v_one| for the worst group."""
  ratios = {group: ratio for group, (ratio, _) in compare(mesh_tree, one_tree).items()}
  worst = max(ratios, key=ratios.get)
  detail = f"the variables after the step, mesh against one device; worst {worst}: {ratios[worst]:.1e}"
  meaning = "the variables' update is partitioned wrongly, or depends on the shard it runs on"
  return objective_checks.Check("variables", step, ratios[worst], tolerance, detail, meaning)


def _valid_rows(valid: int, rows: int) -> str:
  return f"{valid} valid (the rest padding)" if valid < rows else "no padding"


def _skipped(checks, on_one: bool, batch_size: int, coupled: bool) -> list:
  """SKIP rows for what this set-up cannot check, so that no property silently goes missing."""
  out = []
  if coupled:
    reason = (
      "the experiment declares COUPLES_EXAMPLES: its loss over a batch is not the sum over its examples "
      "by design (padding, one division, device count and mesh are still checked)"
    )
    out.append(objective_checks.skip("additivity", reason))
  if on_one:
    reason = "the configured mesh is one device, the reference's: run verify on several devices"
    out.append(objective_checks.skip("mesh_vs_one", reason))
  if not any(c.name == "padding_inert" for c in checks):
    reason = f"no batch verify built has padding rows (global_batch_size={batch_size})"
    out.append(objective_checks.skip("padding_inert", reason))
  if batch_size == 1:
    out.append(objective_checks.skip("rows_separate", "one row per batch: nothing to split"))
  return out


def _mesh_rows(step, m_mesh, m_one, params_mesh, params_one, params_0, tolerances) -> list[dict]:
  """mesh_vs_one, per parameter group: the sharded step against the same step on one device."""
  loss_tol, ratio_tol = tolerances
  loss_rel = abs(float(m_mesh["loss"]) - float(m_one["loss"])) / abs(float(m_one["loss"]))
  grads = compare(m_mesh["grads"], m_one["grads"])
  params = compare(params_mesh, params_one, params_0)
  rows = []
  for group, (grad_ratio, grad_worst) in grads.items():
    param_ratio, param_worst = params[group]
    rows.append(
      {
        "step": step,
        "group": group,
        "loss_rel": loss_rel,
        "grad_ratio": grad_ratio,
        "param_ratio": param_ratio,
        "worst_element": max(grad_worst, param_worst),
        "pass": bool(loss_rel <= loss_tol and grad_ratio <= ratio_tol and param_ratio <= ratio_tol),
      }
    )
  return rows


def _grad_norms(config, state, batch, skip) -> dict[int, float]:
  """The gradient norm of one step on `batch` from `state`, all data-parallel over 2, 4 and 8 of this
  process's devices (those not in `skip`, that it has and the batch divides over)."""
  b, m = config.global_batch_size, config.microbatches
  norms = {}
  for n in (2, 4, 8):
    if n in skip or n > jax.local_device_count() or b % (n * m):
      continue
    cfg = config.copy_and_resolve_references()
    cfg.mesh.update({a: n if a == "data" else 1 for a in mesh_lib.AXES})
    cfg.mesh.update({f"dcn_{a}": 1 for a in mesh_lib.ACROSS_HOSTS})
    comp = components.build(cfg, jax.local_devices()[:n])
    with jax.set_mesh(comp.mesh):
      step = make_train_step(comp, m)
      _, metrics = step(jax.device_put(state, comp.shardings), _put_local(batch, comp.batch_sharding))
    norms[n] = float(metrics["grad_norm"])
  return norms


def _put_local(batch, sharding) -> dict:
  """The whole batch onto a mesh of this process's devices alone."""
  return {k: jax.device_put(v, sharding) for k, v in batch.items()}


def _report(checks, rows) -> bool:
  """Prints the properties, then mesh_vs_one per step and group; returns the verdict."""
  console(f"{'property':<14} {'step':>4} {'figure':>9} {'tolerance':>9}  result  detail")
  for c in checks:
    if c.skipped:
      console(f"{c.name:<14} {'':>4} {'':>9} {'':>9}  SKIP    {c.detail}")
      continue
    console(f"{c.name:<14} {c.step:>4} {c.figure:>9.1e} {c.tolerance:>9.0e}  {c.result:<6}  {c.detail}")
    if not c.passed:
      console(f"{'':<14} what it usually means: {c.meaning}")
  if rows:
    console(
      f"{'mesh_vs_one':<14} {'step':>4}  {'group':<24} {'loss_rel':>9} {'grad_ratio':>10} "
      f"{'param_ratio':>11} {'worst_elem':>10}  result"
    )
  for r in rows:
    console(
      f"{'mesh_vs_one':<14} {r['step']:>4}  {r['group']:<24} {r['loss_rel']:>9.1e} {r['grad_ratio']:>10.1e} "
      f"{r['param_ratio']:>11.1e} {r['worst_element']:>10.1e}  {'PASS' if r['pass'] else 'FAIL'}"
    )
  failed = [c.name for c in checks if not c.passed] + ["mesh_vs_one"] * any(not r["pass"] for r in rows)
  ok = not failed
  console(f"verify: {'PASS' if ok else 'FAIL (' + ', '.join(dict.fromkeys(failed)) + ')'}")
  return ok
