"""The experiment contract as a type: what an experiment provides to the trainer (Experiment: each part a
field with its meaning and default), and `load`, which finds the one an experiment module defines as
`EXPERIMENT = Experiment(UNIT=..., loss_sums=..., ...)`. What the trainer guarantees in return, and an
experiment's keys, are experiments/__init__.py's; `make docs` writes both into
docs/reference/contract.md."""

import dataclasses
import re
from collections.abc import Callable

import experiments
from errors import UserError


def _part(doc: str, default=dataclasses.MISSING, factory=dataclasses.MISSING):
  if factory is not dataclasses.MISSING:
    return dataclasses.field(default_factory=factory, metadata={"doc": doc})
  return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class Experiment:
  """An experiment's parts, as its module's EXPERIMENT names them: the required ones (REQUIRED) are
  checked here, each optional one has its default."""

  module: str = _part("The module's name, as Python has it (experiments.lm), which load sets.", "")
  UNIT: str | None = _part(
    "What the loss's count counts ('images', 'pairs'): metrics are named valid_{UNIT} and "
    "{UNIT}_per_s, the summary {UNIT}_trained_this_run. A lower-case word.",
    None,
  )
  LOGICAL_AXES: dict | None = _part(
    "Every logical axis name its model uses beyond the trainer's own (batch, embed, mlp, heads, kv, "
    "norm, act_seq, act_embed, act_mlp, act_heads, act_kv; trainer/sharding.py), mapped to the "
    "trainer name it is sharded like, or None (replicated).",
    None,
  )
  check_config: Callable | None = _part(
    "check_config(config) -> None: raises errors.UserError for values of the experiment's keys that do "
    "not go together (one line, naming the keys), before anything is compiled; each key's own rule is "
    "checked before it.",
    None,
  )
  build_model: Callable | None = _part(
    "build_model(config, rngs) -> nnx.Module: parameters carry logical axis names; everything else the "
    "model holds (nnx.BatchStat, a variable type of its own) is state beyond parameters, created here "
    "with its final shape and dtype, kept apart from the params, saved, restored and resharded.",
    None,
  )
  data_sources: Callable | None = _part(
    "data_sources(config) -> data.sources.DataSources: train and held-out random-access sources, a "
    "fingerprint of the records, an optional loss floor, and make_batch (records -> arrays).",
    None,
  )
  loss_sums: Callable | None = _part(
    "loss_sums(model, batch, rng[, config]) -> (loss_sum, count, {metric: sum}): scalars summed over the "
    "valid elements of the batch (weight > 0), never a mean; the trainer adds them over devices, "
    "processes and microbatches and divides once by the global count. rng is uint32[B, 2], a key per "
    "example (None in evaluation: be deterministic then).",
    None,
  )
  COUPLES_EXAMPLES: bool = _part(
    "True when loss_sums couples the examples of the global batch (a contrastive loss, batch "
    "statistics): verify reports additivity as SKIP, and microbatches > 1 is an error ...",
    False,
  )
  MICROBATCH_COUPLING: str = _part(
    "... unless this says how the loss accumulates over microbatches (e.g. 'negatives are drawn within "
    "each microbatch'), which the experiment then accepts as its objective.",
    "",
  )
  eval_weights: Callable | None = _part(
    "eval_weights(params, variables, ema) -> {name: (params, variables)}: which weights evaluation "
    "scores by name ('' gives eval_loss, 'ema' eval_ema_loss). Default: the params, and the EMA's where "
    "ema.decay > 0.",
    None,
  )
  pretrained_keys: Callable | None = _part(
    "pretrained_keys(path) -> {dotted key: (value, where it comes from)}: the config keys a pretrained "
    "format the experiment reads for init_from fixes (the LM: a Hugging Face directory).",
    None,
  )
  open_pretrained: Callable | None = _part(
    "open_pretrained(path, config, leaves) -> a reader with read(leaf, shape, index) and bytes_read: "
    "each parameter's slices read lazily (trainer/init_from.py).",
    None,
  )
  EXTENDABLE_KEYS: tuple = _part(
    "Of pretrained_keys' keys, those a config may set otherwise on purpose (the LM: RoPE's, to train "
    "longer than the pretrained context).",
    (),
  )
  EXPORT_FORMATS: dict = _part(
    "{name: (run, out, weights) -> [what it wrote]}: formats trainer.modes.export --format=NAME writes "
    "(the LM: 'hf', a directory transformers loads).",
    factory=dict,
  )
  METRICS: tuple = _part(
    "The metrics loss_sums returns, each a trainer.observe.fields.Field (name, meaning, when it is "
    "written): docs/reference/metrics.md lists them.",
    (),
  )
  example_batch: Callable | None = _part(
    "example_batch(config) -> {name: np.ndarray}: one row shaped and typed as make_batch's, from the "
    "config alone: --mode=inspect compiles from it without opening the data.",
    None,
  )
  model_flops_per_example: Callable | None = _part(
    "model_flops_per_example(config, param_count) -> float: forward and backward FLOPs of one example by "
    "the analytic count, MFU's numerator. Without it MFU uses the compiled step's FLOPs.",
    None,
  )
  routed_bytes_per_example: Callable | None = _part(
    "routed_bytes_per_example(config) -> float: bytes of one example's activations a mixture of experts "
    "sends to its experts and back in a forward pass; --mode=inspect holds the all-to-alls against it.",
    None,
  )
  inspect_notes: Callable | None = _part(
    "inspect_notes(config, mesh_shape) -> [str]: lines --mode=inspect prints about how the step computes "
    "on this mesh (the LM: the attention implementation it compiled).",
    None,
  )
  hooks: Callable | None = _part(
    "hooks(config) -> [trainer.hooks.Hook]: periodic work beside training (generations, an image, an "
    "extra metric), every N steps or S seconds, on every process or on process 0 (trainer/hooks.py).",
    None,
  )
  evaluators: Callable | None = _part(
    "evaluators(config) -> [trainer.hooks.Evaluator]: named evaluations beside eval_loss, run at every "
    "evaluation for each weight set, returning {metric: number} (trainer/hooks.py).",
    None,
  )

  def __post_init__(self):
    if missing := [name for name in REQUIRED if getattr(self, name) is None]:
      raise UserError(
        f"Experiment(...) lacks {', '.join(missing)} of the experiment contract (docs/reference/contract.md, "
        "trainer/experiment.py)"
      )
    if not isinstance(self.UNIT, str) or not re.fullmatch(r"[a-z_]+", self.UNIT):
      raise UserError(f"Experiment(UNIT={self.UNIT!r}): UNIT must be a lower-case word like 'images'")

  @property
  def microbatches_change_objective(self) -> bool:
    """Whether splitting a global batch into microbatches would change the objective: the loss couples
    the examples of the whole batch and the experiment says nothing of how it accumulates."""
    return self.COUPLES_EXAMPLES and not self.MICROBATCH_COUPLING


REQUIRED = ("UNIT", "LOGICAL_AXES", "check_config", "build_model", "data_sources", "loss_sums")


def load(name: str) -> Experiment:
  """The Experiment that experiments/NAME.py defines as EXPERIMENT (experiments.module_name)."""
  file = f"experiments/{experiments.module_name(name)}.py"
  try:
    module = experiments.import_module(name)
  except UserError as e:  # Its Experiment(...) refused at import: say where.
    raise UserError(str(e) if str(e).startswith("experiment=") else f"{file}: {e}") from None
  experiment = vars(module).get("EXPERIMENT")
  if not isinstance(experiment, Experiment):
    raise UserError(
      f"{file} defines no EXPERIMENT = trainer.experiment.Experiment(...): an experiment names its parts "
      "there (UNIT=UNIT, loss_sums=loss_sums, ...; docs/reference/contract.md), not as module names alone"
    )
  return dataclasses.replace(experiment, module=module.__name__)
