"""What may change in the config between a checkpoint and the run that resumes from it: each key's
declared resume class (trainer/config/keys.py) decides, for trainer keys and experiment keys alike.
"""

from errors import UserError


def _flatten(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def check(saved: dict, now: dict, step: int, allowed: str, declared: dict) -> list[str]:
  """Warnings (one line each) for accepted changes; a UserError for a refused one not in `allowed`.

  `saved` and `now` are configs as JSON dicts; `allowed` is checkpoint.allow_changed_keys; `declared`
  every key's declaration. A key only one side has, or one no longer declared: the code changed, not
  the run.
  """
  before, after = _flatten(saved), _flatten(now)
  accepted = {k.strip() for k in allowed.split(",") if k.strip()}
  warnings = []
  for key in sorted(set(before) & set(after) & set(declared)):
    old, new, resume = before[key], after[key], declared[key].on_resume
    if old == new or resume.kind in ("free", "data"):  # Data keys: the data fingerprint decides.
      continue
    change = f"{key} changed {old!r} -> {new!r} since checkpoint {step}"
    if resume.kind == "refused":
      if key not in accepted:
        raise UserError(
          f"{change}: {resume.why}; restore {key}={old!r}, start a new --workdir, or pass "
          f"--config.checkpoint.allow_changed_keys={key} to resume anyway"
        )
      warnings.append(f"warning: {change} (accepted): {resume.why} from step {step + 1}")
    else:
      warnings.append(f"warning: {change}: {resume.why} from step {step + 1} on")
  return warnings
