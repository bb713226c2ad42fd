"""What a checkpoint is proven to be, and what a failed restore means.

After a save is committed, every process records its share of the step directory's files (`share`:
balanced by bytes, the same split on every process) with their sizes and XXH3-128 checksums in
`checksums-I-of-N.json` beside Orbax's own metadata. A restore first compares them: a file missing,
resized or changed proves damage, and only then is the checkpoint set aside. A checkpoint whose files
all match is whole, so a failure to read it is the environment's (memory, I/O, permissions, time); it
stops the run with one line and touches nothing. A checkpoint written before checksums existed, or
killed before every process's share landed, is unproven: its read failures are judged by their kind
(trainer/cluster/failures.py), damage where nothing says otherwise, as before.

Cost: one read of the checkpoint's files per save, shared out among the processes, in a background
thread of each, and one per restore, shared out the same way. The checksum is XXH3-128, as the local
tier's (trainer/checkpoint/local_copies.py): it finds damage, not an adversary, about ten times as
fast as SHA-256, used before (version 1, still verified; benchmarks/local_tier.py --pieces), so the
file system's read time is what remains.
"""

import glob
import hashlib
import heapq
import json
import os
import re

from errors import UserError
from trainer.checkpoint.local_copies import file_checksum

NAME = "checksums"  # checksums-I-of-N.json (and checksums.json, all files, from the first version).
VERSION = 2  # 1: SHA-256 digests; 2: "xxh3_128:" and the digest.
XXH3 = "xxh3_128:"


class RestoreFailed(UserError):
  """A checkpoint could not be read for a reason that is not proven damage: it stays as it is."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


def write(step_dir: str, part: tuple[int, int] = (0, 1)) -> None:
  """Records process i's share (`share`) of a committed checkpoint's files in checksums-i-of-n.json."""
  i, n = part
  sizes = {rel: os.path.getsize(os.path.join(step_dir, rel)) for rel in _files(step_dir)}
  files = {rel: _digest(os.path.join(step_dir, rel)) for rel in share(sizes, i, n)}
  path = os.path.join(step_dir, f"{NAME}-{i}-of-{n}.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"version": VERSION, "files": files}, f)
  os.replace(path + ".tmp", path)  # Whole or absent.


def share(sizes: dict[str, int], i: int, n: int) -> list[str]:
  """Process i's files of n processes', balanced by bytes: largest first (ties by name), each onto the
  process with the fewest bytes so far (ties: the lowest index). Every process computes the same split
  from the same sizes, and no process ends more than the largest file above another. Orbax's files
  differ in size by orders of magnitude: every n-th file by name, as before, left some processes
  several times the bytes of others."""
  loads = [(0, p) for p in range(n)]  # A heap of (bytes so far, process).
  mine = []
  for name in sorted(sizes, key=lambda name: (-sizes[name], name)):
    load, p = heapq.heappop(loads)
    if p == i:
      mine.append(name)
    heapq.heappush(loads, (load + sizes[name], p))
  return sorted(mine)


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names if not n.startswith(NAME)]
  return sorted(out)


def _recorded(step_dir: str) -> dict | str | None:
  """Every recorded file, from a complete set of shares; None if there is none; a string if one is
  unreadable (proof of damage)."""
  shares = {}
  for path in glob.glob(os.path.join(step_dir, f"{NAME}*.json")):
    m = re.fullmatch(rf"{NAME}(?:-(\d+)-of-(\d+))?\.json", os.path.basename(path))
    if m:
      shares[(int(m[1]), int(m[2])) if m[1] else (0, 1)] = path
  counts = {n for _, n in shares}
  complete = [n for n in counts if all((i, n) in shares for i in range(n))]
  if not complete:
    return None  # None written, or a process was killed before its share landed.
  files = {}
  for i in range(complete[0]):
    path = shares[(i, complete[0])]
    try:
      with open(path) as f:
        recorded = json.load(f)
    except ValueError:
      return f"{os.path.basename(path)} is not JSON"
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict):
      return f"{os.path.basename(path)} has no file list"
    files.update(recorded["files"])
  return files


def verify(step_dir: str, part: tuple[int, int] = (0, 1)) -> bool | str:
  """True: every recorded file is there, unchanged. False: unproven (no checksums). A string: the
  proof of damage, e.g. 'state/d/ab12 changed (checksum differs)'. An unreadable file is not proof:
  its OSError propagates. `part=(i, n)` checks process i's `share` of the recorded files (by their
  recorded sizes): n processes share the reading."""
  recorded = _recorded(step_dir)
  if recorded is None:
    return False
  if isinstance(recorded, str):
    return recorded
  i, n = part
  for rel in share({rel: size for rel, (size, _) in recorded.items()}, i, n):
    size, digest = recorded[rel]
    full = os.path.join(step_dir, rel)
    if not os.path.exists(full):
      return f"{rel} is missing"
    if (now := os.path.getsize(full)) != size:  # Cheap, before reading the file.
      return f"{rel} has {now} bytes, {size} when saved"
    if _digest(full, sha256=not digest.startswith(XXH3))[1] != digest:
      return f"{rel} changed (checksum differs)"
  return True


def _digest(path: str, sha256: bool = False) -> tuple[int, str]:
  """(size, checksum): XXH3-128 as written now, or SHA-256 for a checkpoint of version 1."""
  with open(path, "rb") as f:
    if sha256:
      return os.path.getsize(path), hashlib.file_digest(f, "sha256").hexdigest()
    return os.path.getsize(path), XXH3 + file_checksum(f)
