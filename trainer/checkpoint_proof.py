"""What a checkpoint is proven to be, and what a failed restore means.

After a save is committed, process 0 records every file of the step directory with its size and
SHA-256 in `checksums.json` beside Orbax's own metadata. A restore first compares them: a file missing,
resized or changed proves damage, and only then is the checkpoint set aside. A checkpoint whose files
all match is whole, so a failure to read it is the environment's (memory, I/O, permissions, time);
it stops the run with one line and touches nothing. A checkpoint written before checksums existed, or
killed between commit and checksums, is unproven: its read failures are judged by their kind
(trainer/failures.py), damage where nothing says otherwise, as before.

Cost: one read of the checkpoint's files per save, in a background thread on process 0 (a shared file
system holds every process's shards; about 0.6 s for a 1.3 GB state here), and one per restore, its
files shared out among the processes.
"""

import hashlib
import json
import os

from errors import UserError

NAME = "checksums.json"
VERSION = 1


class RestoreFailed(UserError):
  """A checkpoint could not be read for a reason that is not proven damage: it stays as it is."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


def write(step_dir: str) -> None:
  """Records every file under `step_dir` (a committed checkpoint) in its checksums.json."""
  files = {}
  for root, _, names in os.walk(step_dir):
    for name in sorted(names):
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if not rel.startswith(NAME):  # Itself, and its .tmp.
        files[rel] = _digest(path)
  tmp = os.path.join(step_dir, NAME + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"version": VERSION, "files": files}, f)
  os.replace(tmp, os.path.join(step_dir, NAME))  # Whole or absent.


def verify(step_dir: str, part: tuple[int, int] = (0, 1)) -> bool | str:
  """True: every recorded file is there, unchanged. False: unproven (no checksums). A string: the
  proof of damage, e.g. 'state/d/ab12 changed (sha256 differs)'. An unreadable file is not proof:
  its OSError propagates. `part=(i, n)` checks every n-th file from the i-th: n processes share the
  reading."""
  path = os.path.join(step_dir, NAME)
  try:
    with open(path) as f:
      recorded = json.load(f)
  except FileNotFoundError:
    return False
  except ValueError:
    return f"{NAME} is not JSON"
  if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict):
    return f"{NAME} has no file list"
  i, n = part
  for rel, (size, digest) in sorted(recorded["files"].items())[i::n]:
    full = os.path.join(step_dir, rel)
    if not os.path.exists(full):
      return f"{rel} is missing"
    if (now := os.path.getsize(full)) != size:  # Cheap, before reading the file.
      return f"{rel} has {now} bytes, {size} when saved"
    if _digest(full)[1] != digest:
      return f"{rel} changed (sha256 differs)"
  return True


def _digest(path: str) -> tuple[int, str]:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      h.update(chunk)
  return os.path.getsize(path), h.hexdigest()
