"""The rules a key is declared with (trainer/config/keys.py): its type, range or allowed values, checked
before anything is built. A mistake ends in one `error:` line naming the key and what is allowed.
JAX-free: key declarations import it."""

import math
from collections.abc import Callable

from errors import UserError

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


def pairs(v) -> str | None:
  ok = isinstance(v, tuple | list) and all(isinstance(e, tuple | list) and len(e) == 2 for e in v)
  return None if ok else "a tuple of (logical axis, mesh axes) pairs"


def check_rules(config, rules: dict[str, Rule]) -> None:
  """Each dotted key of `rules` against its rule; the first mistake is a UserError."""
  for key, rule in rules.items():
    node = config
    for part in key.split("."):
      node = node[part]
    if (allowed := rule(node)) is not None:
      raise UserError(f"{key}={node!r}: must be {allowed}")


def check(config, declared: dict) -> None:
  """Every key against its declared rule (trainer/config/keys.py), then what depends on two keys."""
  check_rules(config, {k: key.rule for k, key in declared.items()})
  refused = sorted(k for k, key in declared.items() if key.on_resume.kind == "refused")
  wrong = [
    n for n in config.checkpoint.allow_changed_keys.split(",") if n.strip() and n.strip() not in refused
  ]
  if wrong:
    raise UserError(
      f"checkpoint.allow_changed_keys={config.checkpoint.allow_changed_keys!r}: must be a comma-separated "
      f"list of {', '.join(refused)} (or ''); {', '.join(wrong)} would resume without being asked"
    )
  if config.eval_every and not config.eval_steps:
    raise UserError(f"eval_steps={config.eval_steps}: must be at least 1 when eval_every > 0")
