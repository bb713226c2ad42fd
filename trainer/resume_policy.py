"""What may change in the config between a checkpoint and the run that resumes from it.

Every key falls in one class, decided here once for trainer keys and experiment keys alike:
- refused: keys that change which examples later steps see (the data order) or what is trained.
  An `error:` names the key; `--config.checkpoint.allow_changed_keys=KEY,...` accepts it anyway,
  with the warning below.
- free: how the run is executed or reported, never what it optimizes (mesh, sharding, microbatches,
  logging, evaluation, checkpoint cadence, watchdog, integrity checks, host threads). Resumes silently.
- data: the experiment's data keys. The data fingerprint in the checkpoint's data position decides
  (checkpointing.check_data_position, `data.allow_changed_data`), so they are not judged twice.
- everything else (`steps`, optimizer.*, model.*, a fork's own keys): accepted, with one warning per
  key that says what differs from the original run from the resumed step on.
"""

from errors import UserError

REFUSED = {
  "seed": "the data order and every random draw (dropout) change",
  "global_batch_size": "global batch t holds other examples: some are trained twice, some never",
  "experiment": "another experiment's model and loss",
}
FREE_PREFIXES = ("mesh.", "sharding.", "checkpoint.", "watchdog.", "checks.")
FREE = {
  "log_every",
  "eval_every",
  "eval_steps",
  "compilation_cache",
  "microbatches",
  "data.allow_changed_data",
  "data.worker_processes",
  "data.read_threads",
  "data.prefetch",
}


def _flatten(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def _what_changes(key: str) -> str:
  if key == "steps":
    return "the learning-rate schedule now ends at the new step count, so the learning rate differs"
  if key.startswith("optimizer."):
    return "the optimizer's updates differ"
  if key.startswith("model."):
    return "the model computes differently"
  return "the run differs"


def check(saved: dict, now: dict, step: int, allowed: str) -> list[str]:
  """Warnings (one line each) for accepted changes; a UserError for a refused one not in `allowed`.

  `saved` and `now` are configs as JSON dicts; `allowed` is checkpoint.allow_changed_keys.
  """
  before, after = _flatten(saved), _flatten(now)
  accepted = {k.strip() for k in allowed.split(",") if k.strip()}
  warnings = []
  for key in sorted(set(before) & set(after)):  # A key only one side has: the code changed, not the run.
    old, new = before[key], after[key]
    if old == new or key in FREE or key.startswith(FREE_PREFIXES):
      continue
    if key.startswith("data."):
      continue  # The data fingerprint decides.
    change = f"{key} changed {old!r} -> {new!r} since checkpoint {step}"
    if key in REFUSED:
      if key not in accepted:
        raise UserError(
          f"{change}: {REFUSED[key]}; restore {key}={old!r}, start a new --workdir, or pass "
          f"--config.checkpoint.allow_changed_keys={key} to resume anyway"
        )
      warnings.append(f"warning: {change} (accepted): {REFUSED[key]} from step {step + 1}")
    else:
      warnings.append(f"warning: {change}: {_what_changes(key)} from step {step + 1} on")
  return warnings
