"""The experiment contract: what an experiment provides, and what the trainer guarantees in return.

An experiment is a module `experiments/NAME.py` (or a folder `experiments/NAME/` with `__init__.py`)
that binds a model, data and a loss. `trainer/` knows it only through the names below; nothing in
`trainer/` is specific to one experiment. `python -m experiments.new MINE --from=lm|vit` copies one.

Its keys live beside it, in `experiments/NAME_keys.py`, which imports no JAX (config files load it
without the model):
  KEYS: dict[str, trainer.config.keys.Key]
      The experiment's own keys (typically `model.*` and `data.*`), each declared once: default, rule
      (trainer/config/rules.py has whole, real, one_of, ...), resume class (keys.DATA for data keys:
      the data fingerprint decides; keys.MODEL, keys.changes(...), keys.refused(...), keys.FREE) and a
      one-line meaning. `configs/base.py`'s `get_config(NAME)` adds them to the trainer's keys before
      the config is locked, so they are checked like every other key; redefining a trainer key is an
      error. tests/test_config_checks.py walks every key with wrong values.
  TINY: dict[str, object]
      Overrides (dotted keys) that shrink the experiment to a pulse on 8 logical CPU devices: what a
      config's `:tiny` argument applies on top of the trainer's own shrinking.

What the module provides:
  UNIT: str
      What the loss's count counts ("tokens", "images"): metrics are named `valid_{UNIT}` and
      `{UNIT}_per_s`, the summary `{UNIT}_trained_this_run`.
  LOGICAL_AXES: dict[str, str | None]
      Every logical axis name its model uses beyond the trainer's own (`batch`, `embed`, `mlp`,
      `heads`, `kv`, `norm`, `act_seq`, `act_embed`, `act_mlp`, `act_heads`, `act_kv`; see
      trainer/sharding.py), mapped to the trainer name it is sharded like, or None (replicated).
  check_config(config) -> None
      Raises errors.UserError for values of the experiment's keys that do not go together (one line,
      naming the keys), before anything is compiled. Each key's own rule is checked before it.
  build_model(config, rngs: nnx.Rngs) -> nnx.Module
      Parameters carry logical axis names (`nnx.Param(..., out_sharding=("embed", "mlp"))`). Everything
      else the model holds (nnx.BatchStat, a variable type of its own, an array attribute) is state
      beyond parameters: kept apart from the params (no gradient, optimizer moments or weight decay),
      saved, restored, resharded and handed to evaluation; what loss_sums writes to it in training is
      kept, microbatch after microbatch in order. Create every such variable here, with its final
      shape and dtype: one loss_sums creates or reshapes is an error naming it.
  data_sources(config) -> data.sources.DataSources
      Train and held-out random-access sources (`len()`, `[i]`, optionally Grain's batched
      `__getitems__`, and `at_epoch(epoch)` where records move on from epoch to epoch), a fingerprint
      of the records, an optional loss floor, and `make_batch`: how the records of a process's rows
      become arrays (see DataSources).
  loss_sums(model, batch, rng[, config]) -> (loss_sum, count, {metric: sum})
      With a parameter named `config`, the trainer passes the run's config (a loss weight, say);
      values the model holds can also travel as its attributes, set in build_model.
      Scalars summed over the valid elements of `batch` (weight > 0), never a mean: the trainer adds
      them over devices, processes and microbatches and divides once by the global count. `rng` is
      uint32[B, 2], one key per example of the batch (a function of seed, step and the example's row
      in the global batch): draw random bits per example (jax.vmap over rows) so they never depend on
      how the batch is split. `rng` is None in evaluation: be deterministic then (a loss random by
      definition, masked tokens, derives each example's key from the example:
      docs/getting-started/first-fork.md).

Optional:
  COUPLES_EXAMPLES: bool
      True when loss_sums couples the examples of the global batch it is given (a contrastive loss over
      all pairs, batch statistics): its sum over a batch is then not the sum over its examples, so
      --mode=verify reports `additivity` as SKIP (and checks the rest), and microbatches > 1 is an
      error, since each microbatch would see only its own examples,
  MICROBATCH_COUPLING: str
      unless this says how the loss accumulates over microbatches (e.g. "negatives are drawn within
      each microbatch"), which the experiment then accepts as its objective.
  eval_weights(params, variables, ema) -> {name: (params, variables)}
      Which weights and variables evaluation scores, by name: set "" gives eval_loss, set "ema"
      eval_ema_loss, and so on for the metrics. Default: {"": (params, variables)}, plus
      {"ema": (ema, variables)} when ema.decay > 0 (`ema` is {} otherwise).
  pretrained_keys(path) -> {dotted key: (value, where it comes from)}
  open_pretrained(path, config, leaves) -> reader with read(leaf, shape, index) and bytes_read
      A pretrained format the experiment reads for `init_from` (the LM: a Hugging Face Llama
      directory): the config keys it fixes, and each parameter's slices read lazily from its files
      (trainer/init_from.py says more); EXTENDABLE_KEYS, those of the keys a config may set otherwise
      on purpose (the LM: RoPE's, to train longer than the pretrained context).
  EXPORT_FORMATS: dict[str, (run: trainer.checkpoint.read.Loaded, out, weights) -> [what it wrote]]
      Formats `trainer.modes.export --format=NAME` writes (the LM: 'hf', a directory transformers loads).
  example_batch(config) -> dict[str, np.ndarray]
      One row shaped and typed as make_batch's batches (zeros will do), from the config alone:
      --mode=inspect compiles the step from it without opening the data, so a cluster's data.path
      need not exist where you inspect. Without it, inspect reads the first batch of the real data.
  model_flops_per_example(config, param_count) -> float
      Forward and backward FLOPs of one example by the usual analytic count (the LM: 6 x matmul
      parameters x tokens, plus attention): the numerator of MFU in the metrics and the summary.
      Without it MFU uses the compiled step's FLOPs (which count rematerialized work, and a
      scanned loop's body once).
  routed_bytes_per_example(config) -> float
      Bytes of one example's activations a mixture of experts sends to its experts and back in one
      forward pass (the LM: capacity routing's [experts, capacity, embed] buffers per MoE layer):
      --mode=inspect holds the all-to-alls over the expert axis against it. 0 or absent: not shown.
  inspect_notes(config, mesh_shape) -> list[str]
      Lines --mode=inspect prints (and writes as inspect.json's experiment_notes) about how the step
      computes on this mesh ({axis: size}): the LM names the attention implementation it compiled.
  hooks(config) -> list[trainer.hooks.Hook]
      Periodic work beside training (a few generations, an image, an extra metric): each
      Hook(name, fn, every=N steps, every_s=S seconds, on="all" | "process_0") runs fn(ctx) after the
      step's row, save and evaluation, with ctx.step, ctx.params, ctx.variables, ctx.ema, ctx.config,
      ctx.model(ema=False) (the weights merged into the model) and ctx.writer (.scalar, .text, .image:
      a `"event": "hook"` row in metrics.jsonl with keys NAME/KEY, and TensorBoard). on="all" runs on
      every process with the devices' arrays (collectives allowed); on="process_0" runs on process 0
      with host copies of the whole state, gathered on every process first. A hook that raises ends
      the run with one `error:` line naming it and its line (exit 8), after its step is saved.
  evaluators(config) -> list[trainer.hooks.Evaluator]
      Named evaluations beside eval_loss (a downstream task): each Evaluator(name, fn, on="all" |
      "process_0") runs fn(ctx) at every evaluation (eval_every, the final step, --mode=eval) for each
      weight set, ctx as a hook's with that set's params (ctx.writer None), and returns {metric:
      number}: eval_NAME_METRIC in the evaluation's row (eval_ema_NAME_METRIC for the EMA). One that
      raises, or returns anything else, ends the run as a hook does. More held-out sets go in
      DataSources.eval_sets (eval_NAME_loss); the LM's data.eval_tasks are evaluators
      (experiments/_lm_tasks.py).

What the trainer guarantees:
  - Global batch t holds the same records in the same order on any number of devices and processes;
    an epoch's last batch is padded with rows whose records are zeros and `valid` is False.
  - Each process reads only its own rows; batches are prepared ahead and sharded over the batch axes
    (arrays of any rank, split along their first dimension).
  - loss_sum / count is the objective of the whole global batch: the gradient is that of the summed
    loss divided once by the global count; a globally empty batch is refused before it runs.
  - Checked, not assumed: a missing name, a batch without zero `weights` on padding rows, a
    loss_sums that does not return (scalar, scalar, {name: scalar}), and a variable write the train
    state could not keep end in one `error:` line.
"""

import importlib
import os
import re
from types import ModuleType

from errors import UserError

CONTRACT = (
  "UNIT",
  "LOGICAL_AXES",
  "check_config",
  "build_model",
  "data_sources",
  "loss_sums",
)
_HERE = os.path.dirname(os.path.abspath(__file__))


def module_name(name: str) -> str:
  """'lm', 'experiments.lm', 'experiments/lm.py' or 'experiments/lm/' -> 'lm'."""
  given = name
  name = name.strip().rstrip("/")
  if name.endswith(".py"):
    name = name[: -len(".py")]
  if "/" in name or os.sep in name:
    folder, name = os.path.split(os.path.normpath(name))
    if os.path.abspath(folder) != _HERE and os.path.normpath(folder) != "experiments":
      raise UserError(f"experiment={given!r}: an experiment lives in experiments/ (experiments/NAME.py)")
  elif name.startswith("experiments."):
    name = name[len("experiments.") :]
  if not re.fullmatch(r"[A-Za-z_]\w*", name):
    raise UserError(f"experiment={given!r}: use a module name under experiments/, e.g. 'lm'")
  return name


# Command-line tools beside the experiments: `python -m experiments.new` forks one, `experiments.sample`
# reads text from a trained language model.
TOOLS = ("new", "sample")


def available() -> list[str]:
  names = []
  for entry in sorted(os.listdir(_HERE)):
    stem = entry[:-3] if entry.endswith(".py") else entry
    is_module = entry.endswith(".py") or os.path.isfile(os.path.join(_HERE, entry, "__init__.py"))
    if is_module and not stem.startswith("_") and stem not in TOOLS and not stem.endswith("_keys"):
      names.append(stem)
  return names


def _no_such(name: str) -> UserError:
  return UserError(f"experiment={name!r}: no experiments/{name}.py (available: {', '.join(available())})")


def microbatches_change_objective(module: ModuleType) -> bool:
  """Whether splitting a global batch into microbatches would change the experiment's objective: its
  loss couples the examples of the whole batch (COUPLES_EXAMPLES) and it says nothing of how that
  loss accumulates over microbatches (MICROBATCH_COUPLING)."""
  return bool(getattr(module, "COUPLES_EXAMPLES", False) and not getattr(module, "MICROBATCH_COUPLING", ""))


def load_keys(name: str) -> ModuleType:
  """experiments/NAME_keys.py: the experiment's KEYS and TINY, without importing the experiment."""
  name = module_name(name)
  try:
    module = importlib.import_module(f"experiments.{name}_keys")
  except ModuleNotFoundError as e:
    if e.name not in (f"experiments.{name}_keys", f"experiments.{name}"):
      raise
    if not any(os.path.exists(os.path.join(_HERE, n)) for n in (f"{name}.py", f"{name}/__init__.py")):
      raise _no_such(name) from None
    raise UserError(
      f"experiments/{name}_keys.py is missing: an experiment's keys live there (KEYS and TINY, see "
      "experiments/__init__.py)"
    ) from None
  missing = [n for n in ("KEYS", "TINY") if not hasattr(module, n)]
  if missing:
    raise UserError(f"experiments/{name}_keys.py lacks {', '.join(missing)} (see experiments/__init__.py)")
  return module


def load(name: str) -> ModuleType:
  """The experiment module `name` (see module_name), with every name of the contract present."""
  name = module_name(name)
  try:
    module = importlib.import_module(f"experiments.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"experiments.{name}":
      raise
    raise _no_such(name) from None
  missing = [n for n in CONTRACT if not hasattr(module, n)]
  if missing:
    raise UserError(
      f"experiments/{name}.py lacks {', '.join(missing)} of the experiment contract "
      f"(documented in experiments/__init__.py)"
    )
  if not isinstance(module.UNIT, str) or not re.fullmatch(r"[a-z_]+", module.UNIT):
    raise UserError(
      f"experiments/{name}.py: UNIT must be a lower-case word like 'tokens', not {module.UNIT!r}"
    )
  return module
