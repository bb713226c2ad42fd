"""data.prepare's inputs: the files a comma-separated --input names, and the documents in each.

A `.jsonl` file holds one document per line in a field (`text` unless --jsonl_field says another);
any other file is one document. data/prepare.py's docstring says how they become records.
"""

import glob
import json
import os

from errors import UserError


def _files_under(path: str) -> list[str]:
  """A file itself; a directory's files, recursively, sorted."""
  if not os.path.isdir(path):
    return [path]
  return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)


def resolve_inputs(inputs: list[str]) -> list[str]:
  """Files named by each entry (a path, a directory or a glob), in the order given, each file once."""
  files = []
  for pattern in inputs:
    pattern = pattern.strip()
    if not pattern:
      continue
    matched = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    matched = [f for m in matched for f in _files_under(m) if os.path.isfile(f)]
    if not matched:
      raise UserError(f"--input {pattern!r} matches no files")
    files += [f for f in matched if f not in files]
  if not files:
    raise UserError("--input names no files; give a comma-separated list of text or .jsonl files or globs")
  return files


def read_documents(path: str, field: str = "text"):
  """Yields (document bytes, where it came from) for each document of one file, empty ones included
  (the caller counts them): the whole file, or each line's `field` of a .jsonl file."""
  if not path.endswith(".jsonl"):
    with open(path, "rb") as f:
      yield f.read(), path
    return
  for row, where in jsonl_rows(path):
    if not isinstance(row.get(field), str):
      raise UserError(
        f'{where} has no string {field!r} field; each .jsonl line must be {{"{field}": ...}} '
        "(--jsonl_field names another)"
      )
    yield row[field].encode("utf-8"), where


def jsonl_rows(path: str):
  """Yields (object, 'PATH:LINE') of each non-blank line of a .jsonl file; a line that is not a JSON
  object is a UserError naming it."""
  with open(path, "rb") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        row = json.loads(line)
      except ValueError as e:
        raise UserError(f"{where} is not valid JSON ({e})") from None
      if not isinstance(row, dict):
        raise UserError(f"{where} is not a JSON object")
      yield row, where
