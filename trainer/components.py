"""Builds and validates everything a mode needs from the config: mesh, experiment, data, optimizer,
model definition and shardings. Mistakes in the config become UserErrors here, before any compile."""

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from types import ModuleType

import jax
import optax
from jax.sharding import Mesh, NamedSharding

import experiments
from data import pipeline
from data.pipeline import BatchPlan
from data.sources import DataSources
from errors import UserError
from trainer import experiment as experiment_lib
from trainer import mesh as mesh_lib
from trainer import sharding as sharding_lib
from trainer import state as state_lib
from trainer.config import assemble
from trainer.config import rules as config_rules
from trainer.experiment import Experiment
from trainer.optimizer import learning_rate, make_optimizer


@dataclasses.dataclass(frozen=True)
class Components:
  mesh: Mesh
  rules: tuple
  experiment: ModuleType
  sources: DataSources | None  # None when built without data (inspect, from example_batch).
  plan: BatchPlan | None  # Train order.
  eval_plan: BatchPlan | None  # Held-out order (not shuffled).
  tx: optax.GradientTransformationExtraArgs  # Its update takes steps=config.steps.
  learning_rate: Callable  # (count, steps) -> the rate of the update that completes step count + 1.
  steps: int  # config.steps: an argument of the train step, not a constant in it.
  mdef: state_lib.ModelDef
  shardings: state_lib.TrainState  # NamedSharding per leaf.
  batch_sharding: NamedSharding
  loss_sums: Callable  # The experiment's, with the config bound where it asks for one.
  ema_decay: float  # 0: no average of the params.


def load_experiment(config) -> Experiment:
  """The config's experiment, whose own keys the config must have (base.get_config(NAME) adds them)."""
  experiment = experiment_lib.load(config.experiment)
  name = experiments.module_name(config.experiment)
  missing = sorted(set(experiments.load_keys(name).KEYS) - assemble.dotted_keys(config))
  if missing:
    more = " ..." if len(missing) > 4 else ""
    raise UserError(
      f"experiment={name!r} needs config keys {', '.join(missing[:4])}{more} that this config lacks: "
      f"use a config whose get_config() calls base.get_config({name!r})"
    )
  return experiment


def _with_config(loss_sums, config) -> Callable:
  """loss_sums(model, batch, rng), given the config as `config=` when it has that parameter."""
  if "config" in inspect.signature(loss_sums).parameters:
    return functools.partial(loss_sums, config=config)
  return loss_sums


def _check_coupling(experiment, config) -> None:
  """A loss that couples the examples of a global batch (COUPLES_EXAMPLES) is another objective over
  microbatches (each sees only its own examples), unless the experiment says how it accumulates."""
  if config.microbatches > 1 and experiment.microbatches_change_objective:
    name = experiments.module_name(config.experiment)
    raise UserError(
      f"microbatches={config.microbatches}: experiments/{name}.py declares COUPLES_EXAMPLES (its loss "
      "couples the examples of the whole global batch), so each microbatch would see only its own and "
      "the objective would change; set microbatches=1, or declare MICROBATCH_COUPLING saying how the "
      "loss accumulates over microbatches"
    )


def build(config, devices=None, with_data: bool = True) -> Components:
  """`with_data=False`: no data sources or plans (for compiling from the experiment's example_batch)."""
  experiment = load_experiment(config)
  config_rules.check(config, assemble.declared(config.experiment))  # Every key against its rule.
  experiment.check_config(config)
  _check_coupling(experiment, config)
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  rules = sharding_lib.resolve_rules(config.sharding.strategy, config.sharding.rules, experiment.LOGICAL_AXES)
  dp = math.prod(mesh.shape[a] for a in sharding_lib.batch_axes(rules))
  b, m = config.global_batch_size, config.microbatches
  if b < 1 or b % (dp * m):
    raise UserError(
      f"global_batch_size={b} must be divisible by the data-parallel size {dp} "
      f"(batch axes of mesh {dict(mesh.shape)}) times microbatches={m}"
    )
  sources = experiment.data_sources(config) if with_data else None
  if sources is not None and len(sources.train) == 0:
    raise UserError("the training source has no records: every batch would be empty")
  if sources is not None and len(sources.eval) == 0 and config.eval_steps > 0:
    raise UserError(
      "the held-out source has no records; give the experiment held-out data or set eval_steps=0"
    )
  try:
    mdef = state_lib.model_def(functools.partial(experiment.build_model, config))
  except ValueError as e:
    raise UserError(f"model: {e}") from None
  traced = sharding_lib.traced_names(mdef.logical_specs, mdef.variable_specs)
  for warning in sharding_lib.check_rule_names(config.sharding.rules, traced, experiment.LOGICAL_AXES):
    _warn_once(warning)
  split = {axis for name, axes in rules if name in traced for axis in sharding_lib.mesh_axes(axes)}
  if mesh.shape["expert"] > 1 and "expert" not in split:
    _warn_once(
      f"warning: mesh.expert={mesh.shape['expert']} but no parameter of this model is split over it (no "
      "experts): the expert axis only splits the batch, as data would"
    )
  tx = make_optimizer(config.optimizer, mdef.logical_specs)
  try:
    s = config.sharding
    ema = config.ema.decay > 0
    shardings = state_lib.state_shardings(mdef, tx, mesh, rules, s.strategy, s.fsdp_min_size, ema)
  except ValueError as e:
    raise UserError(str(e)) from None
  return Components(
    loss_sums=_with_config(experiment.loss_sums, config),
    ema_decay=config.ema.decay,
    mesh=mesh,
    rules=rules,
    experiment=experiment,
    sources=sources,
    plan=BatchPlan(len(sources.train), b, config.seed) if sources else None,
    eval_plan=BatchPlan(max(len(sources.eval), 1), b, config.seed, shuffle=False) if sources else None,
    tx=tx,
    learning_rate=functools.partial(learning_rate, config.optimizer),
    steps=config.steps,
    mdef=mdef,
    shardings=shardings,
    batch_sharding=mesh_lib.batch_sharding(mesh, rules),
  )


_WARNED: set[str] = set()  # verify and inspect build several components from one config.


def _warn_once(line: str) -> None:
  if line not in _WARNED and jax.process_index() == 0:
    _WARNED.add(line)
    print(line, flush=True)


def fresh_state(comp: Components, config) -> state_lib.TrainState:
  """A fresh train state from config.seed, initialized directly into comp's shardings; with
  config.init_from, its params from there (trainer/init_from.py)."""
  build = lambda rngs: comp.experiment.build_model(config, rngs)
  given = None
  if config.init_from:
    from trainer import init_from

    given = init_from.initial_params(comp, config)
  return state_lib.init_state(build, comp.mdef, comp.tx, comp.shardings, config.seed, given)


def build_for_compile(config, devices=None) -> tuple[Components, dict]:
  """Components and the global batch's ShapeDtypeStructs, for compiling ahead of time. From the
  experiment's optional example_batch(config) the data is never opened (a cluster's data.path need not
  exist here); without it, from the first batch of the real data."""
  experiment = load_experiment(config)
  example = experiment.example_batch
  comp = build(config, devices, with_data=example is None)
  local = example(config) if example else local_batches(comp)(0)
  return comp, pipeline.global_spec(local, comp.batch_sharding, config.global_batch_size)


@dataclasses.dataclass(frozen=True)
class TrainInput:
  """The train input, built once per run (train.py) and read by the compile and the loop: this
  process's rows of global batch t, batch t's global shapes (what the step compiles for), and the
  prefetching reader over a range of batches (Grain threads or worker processes, then device puts
  ahead). Held-out batches: held_out_batches."""

  local: pipeline.LocalBatches
  sharding: NamedSharding
  global_batch_size: int
  data: object  # config.data: read_threads, prefetch, worker_processes.

  def spec(self, t: int) -> dict:
    return pipeline.global_spec(self.local(t), self.sharding, self.global_batch_size)

  def open(self, start: int, stop: int) -> pipeline.DevicePrefetch:
    """Global batches start..stop-1, read and put on the devices ahead of the loop."""
    d = self.data
    it = pipeline.local_batch_iterator(
      self.local, start, stop, d.read_threads, d.prefetch, d.worker_processes
    )
    return pipeline.DevicePrefetch(it, self.sharding, self.global_batch_size, depth=d.prefetch)


def train_input(comp: Components, config) -> TrainInput:
  return TrainInput(local_batches(comp), comp.batch_sharding, config.global_batch_size, config.data)


def local_batches(comp: Components, split: str = "train") -> pipeline.LocalBatches:
  """This process's rows of the train (or held-out) global batches, made by the experiment."""
  source, plan = (comp.sources.train, comp.plan) if split == "train" else (comp.sources.eval, comp.eval_plan)
  return _local(comp, source, plan)


def held_out_batches(comp: Components) -> dict[str, tuple[pipeline.LocalBatches, BatchPlan]]:
  """{name: (this process's rows of its batches, its order)} of every held-out set: "" the experiment's
  `eval`, then its named `eval_sets`, in order, never shuffled."""
  out = {"": (local_batches(comp, "eval"), comp.eval_plan)}
  for name, source in comp.sources.eval_sets.items():
    plan = BatchPlan(max(len(source), 1), comp.plan.global_batch_size, comp.plan.seed, shuffle=False)
    out[name] = (_local(comp, source, plan), plan)
  return out


def _local(comp: Components, source, plan: BatchPlan) -> pipeline.LocalBatches:
  rows = pipeline.process_rows(comp.batch_sharding, comp.plan.global_batch_size)
  return pipeline.LocalBatches(source, plan, rows, comp.sources.make_batch)
