"""A mistake the user can fix. main.py prints it as one `error:` line and exits 2.

A top-level module that imports nothing, so configs, data, model, experiments and the trainer can all
raise it without importing one another; `require_keys` is theirs for a record read back from a file.
"""


class UserError(Exception):
  pass


def require_keys(record, keys, where: str, fix: str) -> dict:
  """`record`, read back from `where`, if it is a JSON object holding every key of `keys`; else a
  UserError naming the first key missing (the file is incomplete: written by other code, or edited)."""
  if not isinstance(record, dict):
    raise UserError(f"{where} holds a {type(record).__name__}, not a JSON object; {fix}")
  missing = [k for k in keys if k not in record]
  if missing:
    more = f" (nor {', '.join(missing[1:])})" if len(missing) > 1 else ""
    raise UserError(f"{where} has no {missing[0]!r}{more}; {fix}")
  return record
