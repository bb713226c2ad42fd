"""One rule per key of configs/base.py: its type, range or allowed values, checked before anything is
built. A mistake ends in one `error:` line naming the key and what is allowed; a key added to
base.py without a rule here fails tests/test_config_checks.py. Experiments check their own keys the
same way: their CONFIG_RULES, through check_rules, in check_config."""

import math
from collections.abc import Callable

from errors import UserError
from trainer import resume_policy, sharding

Rule = Callable[[object], str | None]  # None if the value is allowed, else what is allowed.


def _number(value) -> bool:
  return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def whole(low: int, high: int | None = None) -> Rule:
  def rule(v):
    if isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high):
      return None
    return f"a whole number >= {low}" + (f" and <= {high}" if high is not None else "")

  return rule


def real(low: float, high: float | None = None, low_open: bool = False, high_open: bool = False) -> Rule:
  def rule(v):
    ok = _number(v) and (v > low if low_open else v >= low)
    ok = ok and (high is None or (v < high if high_open else v <= high))
    lo = f"{'>' if low_open else '>='} {low:g}"
    hi = f" and {'<' if high_open else '<='} {high:g}" if high is not None else ""
    return None if ok else f"a number {lo}{hi}"

  return rule


def one_of(*allowed) -> Rule:
  return lambda v: None if v in allowed else "one of " + ", ".join(repr(a) for a in allowed)


def boolean(v) -> str | None:
  return None if isinstance(v, bool) else "True or False"


def mesh_size(v) -> str | None:
  return None if isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or v == -1) else "-1 or >= 1"


def name(v) -> str | None:
  return None if isinstance(v, str) and v.strip() else "a non-empty name"


def text(v) -> str | None:
  return None if isinstance(v, str) else "a string"


def names_from(*allowed) -> Rule:
  """A comma-separated list, each a name from `allowed` ('' for none)."""

  def rule(v):
    wrong = isinstance(v, str) and [n for n in v.split(",") if n.strip() and n.strip() not in allowed]
    if isinstance(v, str) and not wrong:
      return None
    return "a comma-separated list of " + ", ".join(allowed) + " (or '')"

  return rule


def pairs(v) -> str | None:
  ok = isinstance(v, tuple | list) and all(isinstance(e, tuple | list) and len(e) == 2 for e in v)
  return None if ok else "a tuple of (logical axis, mesh axes) pairs"


RULES: dict[str, Rule] = {
  "seed": whole(0, 2**32 - 1),
  "experiment": name,
  "steps": whole(1),
  "global_batch_size": whole(1),
  "microbatches": whole(1),
  "log_every": whole(1),
  "eval_every": whole(0),
  "eval_steps": whole(0),
  "compilation_cache": text,
  "mesh.data": mesh_size,
  "mesh.fsdp": mesh_size,
  "mesh.tensor": mesh_size,
  "mesh.dcn_data": whole(1),
  "mesh.dcn_fsdp": whole(1),
  "sharding.strategy": one_of(*sorted(sharding.PRESETS)),
  "sharding.rules": pairs,
  "sharding.fsdp_min_size": whole(0),
  "data.allow_changed_data": boolean,
  "data.worker_processes": whole(0),
  "data.read_threads": whole(0),
  "data.prefetch": whole(1),
  "model.compute_dtype": one_of("float32", "bfloat16"),
  "optimizer.name": one_of("adamw"),
  "optimizer.learning_rate": real(0.0, low_open=True),
  "optimizer.warmup_steps": whole(0),
  "optimizer.schedule": one_of("cosine", "constant"),
  "optimizer.end_factor": real(0.0, 1.0),
  "optimizer.b1": real(0.0, 1.0, high_open=True),
  "optimizer.b2": real(0.0, 1.0, high_open=True),
  "optimizer.weight_decay": real(0.0),
  "optimizer.grad_clip_norm": real(0.0),
  "checkpoint.every": whole(1),
  "checkpoint.keep": whole(1),
  "checkpoint.keep_every": whole(0),
  "checkpoint.on_nonfinite": one_of("stop", "rollback"),
  "checkpoint.max_rollbacks": whole(0),
  "checkpoint.replica_parallel": boolean,
  "checkpoint.allow_changed_keys": names_from(*resume_policy.REFUSED),
  "watchdog.startup_timeout_s": real(0.0, low_open=True),
  "watchdog.restore_timeout_s": real(0.0, low_open=True),
  "watchdog.compile_timeout_s": real(0.0, low_open=True),
  "watchdog.step_timeout_s": real(0.0, low_open=True),
  "watchdog.peer_timeout_s": real(0.0, low_open=True),
  "checks.replica_every": whole(0),
  "checks.recompute_every": whole(0),
  "profile.start_step": whole(0),
  "profile.steps": whole(0),
  "straggler.factor": real(0.0),
  "straggler.min_s": real(0.0),
}


def check_rules(config, rules: dict[str, Rule]) -> None:
  """Each dotted key of `rules` against its rule; the first mistake is a UserError."""
  for key, rule in rules.items():
    node = config
    for part in key.split("."):
      node = node[part]
    if (allowed := rule(node)) is not None:
      raise UserError(f"{key}={node!r}: must be {allowed}")


def check(config) -> None:
  """Every trainer key against its rule, then what depends on two keys."""
  check_rules(config, RULES)
  if config.eval_every and not config.eval_steps:
    raise UserError(f"eval_steps={config.eval_steps}: must be at least 1 when eval_every > 0")
