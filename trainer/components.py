"""Builds and validates everything a mode needs from the config: mesh, experiment, data, optimizer,
model definition and shardings. Mistakes in the config become UserErrors here, before any compile."""

import dataclasses
import functools
import importlib
import math
from types import ModuleType

import optax
from jax.sharding import Mesh, NamedSharding

from data import pipeline
from data.pipeline import BatchPlan
from data.sources import DataSources
from trainer import mesh as mesh_lib
from trainer import sharding as sharding_lib
from trainer import state as state_lib
from trainer.errors import UserError
from trainer.optimizer import make_optimizer


@dataclasses.dataclass(frozen=True)
class Components:
  mesh: Mesh
  rules: tuple
  experiment: ModuleType
  sources: DataSources
  plan: BatchPlan  # Train order.
  eval_plan: BatchPlan  # Held-out order (not shuffled).
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  mdef: state_lib.ModelDef
  shardings: state_lib.TrainState  # NamedSharding per leaf.
  batch_sharding: NamedSharding


def load_experiment(name: str) -> ModuleType:
  try:
    module = importlib.import_module(f"experiments.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"experiments.{name}":
      raise
    raise UserError(f"experiment={name!r}: no module experiments/{name}.py") from None
  for fn in ("build_model", "loss_sums", "data_sources"):
    if not hasattr(module, fn):
      raise UserError(f"experiments/{name}.py must define {fn}()")
  return module


def build(config, devices=None) -> Components:
  if config.steps < 1:
    raise UserError(f"steps={config.steps}: must be at least 1")
  at_least = {
    "microbatches": (config.microbatches, 1),
    "log_every": (config.log_every, 1),
    "checkpoint.every": (config.checkpoint.every, 1),
    "checkpoint.keep": (config.checkpoint.keep, 1),
    "eval_every": (config.eval_every, 0),
    "eval_steps": (config.eval_steps, 1 if config.eval_every else 0),
    "model.num_heads": (config.model.num_heads, 1),
    "model.num_layers": (config.model.num_layers, 1),
    "data.seq_len": (config.data.seq_len, 1),
  }
  for key, (value, low) in at_least.items():
    if value < low:
      why = " when eval_every > 0" if key == "eval_steps" else ""
      raise UserError(f"{key}={value}: must be at least {low}{why}")
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  rules = sharding_lib.resolve_rules(config.sharding.strategy, config.sharding.rules)
  dp = math.prod(mesh.shape[a] for a in sharding_lib.batch_axes(rules))
  b, m = config.global_batch_size, config.microbatches
  if b < 1 or b % (dp * m):
    raise UserError(
      f"global_batch_size={b} must be divisible by the data-parallel size {dp} "
      f"(batch axes of mesh {dict(mesh.shape)}) times microbatches={m}"
    )
  experiment = load_experiment(config.experiment)
  sources = experiment.data_sources(config)
  if len(sources.train) == 0:
    raise UserError("the training source has no records: every batch would be empty")
  if len(sources.eval) == 0 and config.eval_steps > 0:
    raise UserError("the held-out source has no records; set data.eval_examples or eval_steps=0")
  tx, schedule = make_optimizer(config.optimizer, config.steps)
  try:
    mdef = state_lib.model_def(functools.partial(experiment.build_model, config))
  except ValueError as e:
    raise UserError(f"model: {e}") from None
  try:
    shardings = state_lib.state_shardings(mdef, tx, mesh, rules, config.sharding.strategy)
  except ValueError as e:
    raise UserError(str(e)) from None
  return Components(
    mesh=mesh,
    rules=rules,
    experiment=experiment,
    sources=sources,
    plan=BatchPlan(len(sources.train), b, config.seed),
    eval_plan=BatchPlan(max(len(sources.eval), 1), b, config.seed, shuffle=False),
    tx=tx,
    schedule=schedule,
    mdef=mdef,
    shardings=shardings,
    batch_sharding=mesh_lib.batch_sharding(mesh, rules),
  )


def init_state(comp: Components, config) -> state_lib.TrainState:
  """A fresh train state from config.seed, initialized directly into comp's shardings."""
  build = lambda rngs: comp.experiment.build_model(config, rngs)
  return state_lib.init_state(build, comp.mdef, comp.tx, comp.shardings, config.seed)


def local_batches(comp: Components, config, split: str = "train") -> pipeline.LocalBatches:
  """This process's rows of the train (or held-out) global batches, with padding and packing."""
  rows = pipeline.process_rows(comp.batch_sharding, comp.plan.global_batch_size)
  source, plan = (comp.sources.train, comp.plan) if split == "train" else (comp.sources.eval, comp.eval_plan)
  eos_id = comp.sources.eos_id if config.data.packing else None
  return pipeline.LocalBatches(source, plan, rows, config.data.seq_len, comp.sources.pad_id, eos_id)
