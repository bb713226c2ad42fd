"""The train state and its sharded initialization.

The model lives as (graphdef, params, variables): plain nested dicts of arrays, so the jitted step
is a pure function of the state (no object-graph walk per call) and checkpoints are plain trees.
`params` are the model's nnx.Param values: what the optimizer updates. `variables` are everything
else the model holds (nnx.BatchStat, any nnx.Variable type or array attribute of the experiment's):
no gradient, no optimizer moments, no weight decay, not in the parameter count; what training's
forward pass writes to them is kept (trainer/step.py).
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from trainer import mesh as mesh_lib
from trainer import sharding as sharding_lib


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken; also the index of the next global batch.
  params: Any  # Nested dict of arrays, sharded by the logical rules.
  variables: Any  # The model's other variables, as training's forward passes left them ({}: none).
  opt_state: Any  # optax state; mirrors params' shardings leaf for leaf.
  ema: Any  # The params' exponential moving average, sharded like them ({}: ema.decay is 0).
  rng: jax.Array  # uint32[2] base key; the step's key is fold_in(rng, step).


@dataclasses.dataclass(frozen=True)
class ModelDef:
  """What turns params and variables back into a model, plus their logical axis names."""

  graphdef: Any
  abstract_params: Any  # nnx.State of ShapeDtypeStructs, for merging a pure dict back.
  abstract_variables: Any  # The same for the variables.
  logical_specs: Any  # Nested dict like params: PartitionSpec of logical axis names.
  variable_specs: Any  # ... and like variables.

  def merge(self, params, variables) -> nnx.Module:
    filled = []
    for abstract, values in ((self.abstract_params, params), (self.abstract_variables, variables)):
      state = jax.tree.map(lambda x: x, abstract)  # A fresh copy to fill in.
      nnx.replace_by_pure_dict(state, values)
      filled.append(state)
    return nnx.merge(self.graphdef, *filled)

  @property
  def params(self):
    return nnx.to_pure_dict(self.abstract_params)

  @property
  def variables(self):
    return nnx.to_pure_dict(self.abstract_variables)


def split(model: nnx.Module) -> tuple[dict, dict]:
  """(params, variables) of a model as pure dicts."""
  return nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))


def model_def(build_model) -> ModelDef:
  """Traces the model abstractly: no parameter memory is allocated anywhere."""
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: build_model(nnx.Rngs(0)))
  graphdef, params, variables = nnx.split(abstract, nnx.Param, ...)
  specs = lambda state: nnx.to_pure_dict(nnx.get_partition_spec(state))
  return ModelDef(graphdef, params, variables, specs(params), specs(variables))


def state_shardings(
  mdef: ModelDef,
  tx: optax.GradientTransformation,
  mesh: Mesh,
  rules,
  strategy: str,
  fsdp_min_size: int = 0,
  ema: bool = False,
):
  """Explicit shardings for every leaf of the TrainState. Parameters follow their logical axes (under
  FSDP, large ones are split over fsdp regardless: sharding.fsdp_spec), and so does their average.
  Optimizer moments follow their parameter (or, for ZeRO-1, are split over the batch axes); variables
  follow their own logical axes (replicated without any); optimizer scalars are replicated."""
  param_sh = mesh_lib.tree_shardings(mesh, mdef.logical_specs, rules)
  abstract_params = mdef.params
  if sharding_lib.shards_params_over_fsdp(strategy):
    param_sh = jax.tree.map(
      lambda sh, leaf, names: NamedSharding(
        mesh, sharding_lib.fsdp_spec(leaf.shape, sh.spec, mesh, fsdp_min_size, tuple(names))
      ),
      param_sh,
      abstract_params,
      mdef.logical_specs,
    )
  _check_divisible(abstract_params, param_sh)
  variable_sh = mesh_lib.tree_shardings(mesh, mdef.variable_specs, rules)
  _check_divisible(mdef.variables, variable_sh, "variable")
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  repl = mesh_lib.replicated(mesh)
  opt_sh = optax.tree_map_params(
    tx,
    lambda leaf, sh: sharding_lib.optimizer_leaf_sharding(leaf.shape, sh, strategy, rules),
    abstract_opt,
    param_sh,
    transform_non_params=lambda _: repl,
  )
  return TrainState(
    step=repl, params=param_sh, variables=variable_sh, opt_state=opt_sh, ema=param_sh if ema else {}, rng=repl
  )


def _check_divisible(abstract_params, shardings, what: str = "parameter") -> None:
  """Every dimension splits evenly over the mesh axes its rules give it; else a ValueError
  naming the parameter (JAX would fail later, deep inside jit)."""
  for (path, leaf), sh in zip(
    jax.tree_util.tree_flatten_with_path(abstract_params)[0], jax.tree.leaves(shardings), strict=True
  ):
    for size, axes in zip(leaf.shape, tuple(sh.spec) + (None,) * leaf.ndim, strict=False):
      names = sharding_lib.mesh_axes(axes)
      ways = math.prod(sh.mesh.shape[a] for a in names)
      if size % ways:
        raise ValueError(
          f"{what} {'/'.join(path_keys(path))} has a dimension of {size}, which its mesh axes "
          f"{names} ({ways} ways) do not divide: change the model size, the mesh or sharding.rules"
        )


def init_state(build_model, mdef: ModelDef, tx, shardings: TrainState, seed: int, given=None) -> TrainState:
  """Initializes params and optimizer state directly into their shards (jit with out_shardings).
  `given`: (params, variables or None) already placed in their shards, used instead of the model's
  initialization (which XLA then leaves out); the optimizer state starts fresh for them."""

  def init(given):
    with nnx.use_eager_sharding(False):
      model = build_model(nnx.Rngs(params=seed))
    params, variables = split(model)
    if given is not None:
      params, variables = given[0], variables if given[1] is None else given[1]
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      variables=variables,
      opt_state=tx.init(params),
      ema=params if shardings.ema else {},  # The average starts at the initial params.
      rng=jax.random.fold_in(jax.random.PRNGKey(seed), 1),
    )

  return jax.jit(init, out_shardings=shardings, donate_argnums=0)(given)


def abstract_shapes(mdef: ModelDef, tx, ema: bool) -> TrainState:
  """The train state's ShapeDtypeStructs, without shardings."""
  abstract_params = mdef.params
  return TrainState(
    step=jax.ShapeDtypeStruct((), jnp.int32),
    params=abstract_params,
    variables=mdef.variables,
    opt_state=jax.eval_shape(tx.init, abstract_params),
    ema=abstract_params if ema else {},
    rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
  )


def abstract_state(shardings: TrainState, mdef: ModelDef, tx) -> TrainState:
  """ShapeDtypeStructs with shardings: the restore target for Orbax on any mesh."""
  shapes = abstract_shapes(mdef, tx, bool(shardings.ema))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def path_keys(path) -> list[str]:
  """A jax tree path as plain names: dict keys, list indices, dataclass fields ('params', 'blocks', '0')."""
  return [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]


def param_count(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
