"""checks.first_step: XLA's SPMD partitioning of the real train step checked on the real devices, at a
run's first step and whenever its layout changes (mesh, strategy, rules, microbatches, jax or jaxlib,
XLA_FLAGS), unless this very compiled step passed before on these devices
(trainer/checks/checked_programs.py).

The run's first step is the train step the loop compiles (microbatches, optimizer update, donation),
compiled with two more outputs: the divided, unclipped gradients and the params' update. The same
step, from a copy of the same state and batch, runs once more under another layout of the same
devices: the first candidate (data-parallel over every device, pure FSDP, FSDP over half with data or
tensor over two) that is valid for this config, compiles to a different program (another HLO
fingerprint: labels that differ but partition alike check nothing) and fits the devices' free memory.
Both are one objective, so the gradients of every parameter group agree to verify's tolerance, and
their updates to UPDATE_FACTOR times it, unless XLA partitioned one of them wrongly (a missing
all-reduce, say: tests/xla_repro_fork.py). Comparing gradients matters: AdamW's first update is about
lr * sign(g) and clipping rescales, so a uniformly scaled gradient would leave the params equal.

A disagreement ends the run with one line naming the groups and exit 6 (never restarted: the same
program fails the same way; another mesh or sharding.rules avoids it). A first step that is not
finite under either layout is no question of partitioning: its own line and exit 7 (after a restore,
checkpoint.on_nonfinite decides, as at any step). Where no other
layout is valid, distinct and fits, the start-up line says the check could not run and why.
"""

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from errors import UserError
from trainer import components, device_memory
from trainer import mesh as mesh_lib
from trainer.checks.compare import TOLERANCES, group
from trainer.cluster import failures, multihost
from trainer.mesh import replicated
from trainer.observe.metrics import console

# The updates' tolerance, in multiples of the gradients': Adam's first update divides each gradient
# element by its own magnitude, so where |g| is near epsilon a last-bit difference of the gradient
# moves the update by far more (the BatchNorm fork's norm scale: 2.2e-3 between (2, 2, 2) and dp in
# float32, its gradients within verify's 1e-3). A miscompiled update (a missing gather or reduction)
# is off by order 1: at most 0.1 (bfloat16).
UPDATE_FACTOR = 10


class Miscompiled(UserError):
  exit_code = failures.MISCOMPILED_EXIT


class NonFiniteFirstStep(UserError):
  exit_code = failures.NONFINITE_FIRST_STEP_EXIT


def candidates(devices, expert: int = 1, context: int = 1) -> list:
  """Other partitionings of the same devices, most replicated first: (mesh sizes in AXES order,
  strategy). Models that fit only sharded get pure FSDP, or FSDP over half the devices with data or
  tensor over two. The expert and context axes keep their sizes: a mixture of experts that fits only
  with its experts split, or a sequence that fits only split, has no replicated layout, and the other
  layout then checks the rest of the split."""
  n = len(devices) // (expert * context)
  e, c = expert, context
  halves = [((2, n // 2, e, c, 1), "fsdp"), ((1, n // 2, e, c, 2), "fsdp_tp")] if n % 2 == 0 and n > 2 else []
  return [((n, 1, e, c, 1), "dp"), ((1, n, e, c, 1), "fsdp"), *halves]


def other_config(config, sizes, strategy):
  other = config.copy_and_resolve_references()
  other.mesh.update(
    dict(zip(mesh_lib.AXES, sizes, strict=True)) | {f"dcn_{a}": 1 for a in mesh_lib.ACROSS_HOSTS}
  )
  other.sharding.strategy = strategy
  other.sharding.rules = ()  # The preset's: the configured rules are what is being checked.
  return other


def _fits(compiled, mine, device) -> bool:
  """Whether the other layout's program fits `device`'s free memory beside what the configured first
  step keeps alive while it runs (its new state, gradients and updates); True where the device does
  not say (CPU)."""
  memory, held = compiled.memory_analysis(), mine.memory_analysis()
  stats = device.memory_stats() or {}
  if memory is None or held is None or "bytes_limit" not in stats:
    return True
  needed = device_memory.program_bytes(memory) + held.output_size_in_bytes - held.alias_size_in_bytes
  return needed <= stats["bytes_limit"] - stats.get("bytes_in_use", 0)


_DEBUG_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _without_attribute(line: str, name: str) -> str:
  """`line` without `, NAME={...}` (braces nest)."""
  while (start := line.find(f", {name}={{")) >= 0:
    depth, brace = 0, start + len(name) + 3
    for end in range(brace, len(line)):  # noqa: B007 - `end` is the closing brace's index.
      depth += {"{": 1, "}": -1}.get(line[end], 0)
      if depth == 0:
        break
    line = line[:start] + line[end + 1 :]
  return line


def fingerprint(compiled) -> str:
  """The partitioned program's instructions without debug information or the sharding annotations
  left on them (their per-device shapes and collectives are the partitioning): the same program
  traced from two lines of Python, or two configs that partition alike, fingerprint the same."""
  kept, in_table = [], False
  for line in compiled.as_text().splitlines():
    if line in _DEBUG_TABLES or (in_table and line[:1].isdigit()):
      in_table = True  # A table's rows are numbered.
      continue
    in_table = False
    kept.append(_without_attribute(_without_attribute(line, "metadata"), "sharding"))
  return hashlib.sha256("\n".join(kept).encode()).hexdigest()


@dataclasses.dataclass
class Other:
  comp: components.Components
  step: object  # Compiled.
  label: str


def _on(tree, shardings):
  """The shapes of `tree` placed by `shardings` (a tree like it, or one sharding for every leaf)."""
  if not isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shardings, tree)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)


class FirstStepCheck:
  """Compiled at start-up (make_train_step's program with gradients and updates, under both layouts);
  called as the loop's first step: (state, batch) -> (new state, metrics), the configured layout's.
  `other` is None where no other layout is valid, distinct and fits: the loop's own step runs then."""

  def __init__(self, comp, config, make_train_step, state_shapes, batch_shapes, resumed: bool, on_pass=None):
    self.comp, self.config, self.other, self.resumed = comp, config, None, resumed
    self.on_pass = on_pass  # Called with the other layout's label and the worst ratios once they agree.
    devices = list(comp.mesh.devices.flat)
    m = config.microbatches
    if len(devices) == 1:
      console("warning: checks.first_step could not run: one device has no other layout")
      return
    with jax.set_mesh(comp.mesh):
      self.mine = make_train_step(comp, m, with_grads=True).lower(state_shapes, batch_shapes).compile()
    mine_print, skipped = fingerprint(self.mine), []
    mine_device = next(d for d in devices if d.process_index == jax.process_index())
    for sizes, strategy in candidates(devices, comp.mesh.shape["expert"], comp.mesh.shape["context"]):
      label = f"mesh {dict(zip(mesh_lib.AXES, sizes, strict=True))} (strategy {strategy})"
      try:  # The same config on every process: each decides alike.
        other = components.build(other_config(config, sizes, strategy), devices, with_data=False)
      except UserError as e:  # A mesh the user never asked for: its mistakes are not theirs.
        skipped.append(f"{label}: {e}")
        continue
      shapes = _on(state_shapes, other.shardings), _on(batch_shapes, other.batch_sharding)
      reason = None
      try:
        with jax.set_mesh(other.mesh):  # Nothing is moved before it fits.
          compiled = make_train_step(other, m, with_grads=True).lower(*shapes).compile()
      except Exception as e:  # noqa: BLE001 - XLA's error, for a layout the user never asked for.
        reason = f"does not compile ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
      else:
        if fingerprint(compiled) == mine_print:
          reason = "compiles to the same program"
        elif not _fits(compiled, self.mine, mine_device):
          reason = "does not fit the devices' free memory"
      # Every process takes the same layout, or the collectives would not match: one process's
      # reason (its own compile, its own free memory) rules the candidate out for all.
      ok = reason is None
      if not multihost.all_agree(f"first_step_{strategy}_{sizes}", ok, config.watchdog.compile_timeout_s):
        skipped.append(f"{label}: {reason or 'ruled out on another process'}")
        continue
      self.other = Other(other, compiled, label)
      break
    if self.other is None:
      console(
        "warning: checks.first_step could not run: no other layout of these devices is valid, compiles "
        f"to another program and fits ({'; '.join(skipped)})"
      )

  def __call__(self, state, batch):
    """The run's real first step under the configured layout, checked against the other. Inside the
    loop's transfer guard: resharding the copies and reading the verdict's scalars may pass the host."""
    with jax.transfer_guard_device_to_host("allow"):
      return self._checked_step(state, batch)

  def _checked_step(self, state, batch):
    other = self.other
    # Copies even where a sharding is the same: the configured step donates the originals.
    copies = jax.device_put(
      (state, batch), (other.comp.shardings, other.comp.batch_sharding), may_alias=False
    )
    with jax.set_mesh(self.comp.mesh):
      state, metrics = self.mine(state, batch)  # Donates the configured state: the real first step.
    with jax.set_mesh(other.comp.mesh):
      _, theirs = other.step(*copies)
    self._judge(metrics, theirs)
    return state, _without_check_outputs(metrics)

  def _judge(self, mine, theirs) -> None:
    finite = {"configured": bool(mine["finite"]), "other": bool(theirs["finite"])}
    if not all(finite.values()):
      where = " and ".join(k for k, ok in finite.items() if not ok)
      if self.resumed:  # After a restore, checkpoint.on_nonfinite decides, as at any other step.
        console(f"checks.first_step: the first step is not finite under the {where} layout: not compared")
        return
      raise NonFiniteFirstStep(
        f"checks.first_step: the first step's loss or gradients are not finite (NaN/Inf) under the "
        f"{where} layout ({self.other.label} was the other): not a partitioning question; check the "
        "data, the initialization and the learning rate (restarting fails the same way)"
      )
    to_mine = lambda tree: jax.device_put(tree, self.comp.shardings.params)
    ratios = {
      "gradients": _ratios(self.comp, mine["grads"], to_mine(theirs["grads"])),
      "updates": _ratios(self.comp, mine["updates"], to_mine(theirs["updates"])),
    }
    _, tolerance = TOLERANCES.get(self.config.model.compute_dtype, TOLERANCES["bfloat16"])
    tolerances = {"gradients": tolerance, "updates": min(UPDATE_FACTOR * tolerance, 0.1)}
    bad = [
      (f"{g} ({what})", r) for what, rs in ratios.items() for g, r in rs.items() if not r <= tolerances[what]
    ]
    here = dict(self.comp.mesh.shape)
    limits = f"verify's {tolerance:g} for gradients, {tolerances['updates']:g} for updates"
    if bad:
      bad.sort(key=lambda x: -x[1] if np.isfinite(x[1]) else -np.inf)
      worst = ", ".join(f"{g} {r:.1e}" for g, r in bad[:4]) + (" ..." if len(bad) > 4 else "")
      raise Miscompiled(
        f"checks.first_step: the first step on mesh {here} (strategy {self.config.sharding.strategy}) "
        f"differs from the same step on {self.other.label} for {worst}, beyond {limits}: XLA "
        "partitioned the step wrongly; use another mesh or sharding.rules (restarting fails the same way)"
      )
    worst = {what: max(rs.values(), default=0.0) for what, rs in ratios.items()}
    if self.on_pass is not None:
      self.on_pass(self.other.label, worst)
    console(
      f"checks.first_step: the first step's gradients and updates agree with {self.other.label}: "
      f"worst {worst['gradients']:.1e} and {worst['updates']:.1e} ({limits})"
    )


def _without_check_outputs(metrics: dict) -> dict:
  return {k: v for k, v in metrics.items() if k not in ("grads", "updates")}


def _ratios(comp, mine, theirs) -> dict[str, float]:
  """Per parameter group, |a_configured - a_other| / |a_other|: the squared sums are taken on the
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
