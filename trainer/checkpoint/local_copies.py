"""A local-tier copy on disk (trainer/checkpoint/local.py): a folder STEP holding `shards.bin` and
`manifest.json` (the bytes' checksum, the step, the process, the layout's fingerprint), written as
STEP.tmp and renamed when whole. A kill mid-write leaves a .tmp that is never read and is removed by
the next copy; a copy whose bytes do not match their checksum is not whole.

`shards.bin` is data only (dump_record): a JSON header (the step, data position and config, and each
shard's leaf, index, dtype, shape and place) and the shards' raw bytes, read back as numpy views of
them. Copies cross the network (a partner's, trainer/cluster/peers.py): nothing in them is unpickled or
run, and a header that does not describe its bytes is refused.

The bytes are streamed to the file as they are made (or received from a partner) and checksummed on
the way: no second copy of the shards in memory. The checksum is XXH3-128, not sha256:
it proves a copy whole against damage (a torn write, a flipped bit), there is no adversary to resist,
and it runs about ten times as fast as sha256 (benchmarks/local_tier.py --pieces), CPU time that
logical CPU devices would take from the step.

The copy that falls out of the newest KEEP is kept as SPARE, and the next copy is written over its file:
in a tmpfs such as /dev/shm a new file's pages are allocated and zeroed as they are written, an old
file's are not (writing over one is several times faster: benchmarks/local_tier.py --pieces), and
every copy pays it twice, on its process and its partner.
"""

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable

import ml_dtypes
import numpy as np
import xxhash

# Three, not two: a process whose write lags (its copy of step k torn by a kill) has k-1 whole while a
# partner one step ahead has written k and k+1; with two each, no step would be whole for both.
KEEP = 3
SHARDS, MANIFEST = "shards.bin", "manifest.json"
SPARE = "spare"  # Not a step: never read, never whole.
CHECKSUM = "xxh3_128"  # The manifest's key for the bytes' checksum (a copy without one is never whole).


def checksum(data) -> str:
  return xxhash.xxh3_128_hexdigest(data)


def file_checksum(f) -> str:
  """`checksum` of an open binary file's bytes, read in pieces (never held whole)."""
  return hashlib.file_digest(f, xxhash.xxh3_128).hexdigest()


def dump_record(record: dict, write: Callable) -> None:
  """Writes `record` ({step, position, config: JSON values; shards: {leaf path: {index: array}}}) with
  `write`: 8 bytes of header length, the JSON header, then each shard's bytes where it says."""
  arrays, entries, offset = [], [], 0
  for path, shards in record["shards"].items():
    for index, array in shards.items():
      array = np.asarray(array, order="C")  # (ascontiguousarray would make a scalar 1-d.)
      entries.append(
        {
          "path": path,
          "index": [list(span) for span in index],
          "dtype": array.dtype.name,
          "shape": list(array.shape),
          "offset": offset,
        }
      )
      arrays.append(array)
      offset += array.nbytes
  header = json.dumps({**{k: v for k, v in record.items() if k != "shards"}, "arrays": entries}).encode()
  write(len(header).to_bytes(8, "big"))
  write(header)
  for array in arrays:
    write(array.reshape(-1).view(np.uint8).data)  # Raw bytes of any dtype, bfloat16's included.


def load_record(blob) -> dict:
  """dump_record's record from its bytes, each shard a read-only numpy view of them; ValueError where
  the header does not describe them (a dtype that is not a number's, a shard past the end)."""
  view = memoryview(blob)
  n = int.from_bytes(view[:8], "big")
  try:
    header = json.loads(bytes(view[8 : 8 + n]))
    shards, base = {}, 8 + n
    for entry in header.pop("arrays"):
      dtype, shape = _number_dtype(entry["dtype"]), tuple(int(d) for d in entry["shape"])
      start, count = base + int(entry["offset"]), math.prod(shape)
      if min(shape, default=0) < 0 or start < base or start + count * dtype.itemsize > len(view):
        raise ValueError(f"a copy's shard of {entry['path']} lies outside its bytes")
      array = np.frombuffer(view, dtype=dtype, count=count, offset=start).reshape(shape)
      index = tuple((int(a), int(b)) for a, b in entry["index"])
      shards.setdefault(str(entry["path"]), {})[index] = array
  except (TypeError, KeyError, AttributeError, IndexError) as e:  # A header of another shape.
    raise ValueError(f"a copy's header does not describe its shards ({type(e).__name__}: {e})") from None
  return {**header, "shards": shards}


def _number_dtype(name: str) -> np.dtype:
  """A numeric dtype by name (numpy's, or ml_dtypes' bfloat16 and float8s); ValueError otherwise."""
  try:
    ours = isinstance(name, str) and hasattr(ml_dtypes, name)
    dtype = np.dtype(getattr(ml_dtypes, name)) if ours else np.dtype(name)
  except TypeError:
    dtype = None
  number = dtype is not None and not dtype.hasobject and dtype.type.__module__ in ("numpy", "ml_dtypes")
  if not number or (dtype.kind not in "biufc" and dtype.type.__module__ != "ml_dtypes"):
    raise ValueError(f"a copy names dtype {name!r}, not a number's")
  return dtype


class HashingWriter:
  """A file's `write` that also checksums what it writes."""

  def __init__(self, f):
    self._f, self.hash = f, xxhash.xxh3_128()

  def write(self, data) -> int:
    self.hash.update(data)
    return self._f.write(data)


def stage(folder: str, step: int, fill: Callable, hashed: bool = True) -> str | None:
  """Writes STEP.tmp/shards.pkl with `fill(writer)`, over the spare's or a torn copy's file where there
  is one; the checksum of what it wrote where `hashed`."""
  tmp = os.path.join(folder, f"{step}.tmp")
  reused = _reuse(folder, tmp)
  if not reused:  # No spare yet: the first KEEP copies.
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
  with open(os.path.join(tmp, SHARDS), "r+b" if reused else "wb") as f:
    writer = HashingWriter(f) if hashed else f
    fill(writer)
    f.truncate()  # An older, longer copy's tail.
  return writer.hash.hexdigest() if hashed else None


def _reuse(folder: str, tmp: str) -> bool:
  """Renames the spare, else a torn copy a kill left, to `tmp` to be written over; whether one was."""
  torn = sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))
  for name in (SPARE, *torn):
    old = os.path.join(folder, name)
    if os.path.isfile(os.path.join(old, SHARDS)):
      if old != tmp:
        shutil.rmtree(tmp, ignore_errors=True)
        os.replace(old, tmp)
      return True
  return False


def commit(folder: str, step: int, manifest: dict) -> None:
  """STEP.tmp, staged, made whole as STEP with its manifest; the newest KEEP kept, torn leftovers removed."""
  tmp, final = os.path.join(folder, f"{step}.tmp"), os.path.join(folder, str(step))
  with open(os.path.join(tmp, MANIFEST), "w") as f:
    json.dump(manifest, f)
  _commit(tmp, final)
  for name in os.listdir(folder):
    if name.endswith(".tmp") and name != f"{step}.tmp":
      shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
  steps = sorted((int(n) for n in os.listdir(folder) if n.isdigit()), reverse=True)
  # The newest copy a check saw is kept too: a run with checks resumes only from one (restore_newest).
  checked = next((s for s in steps[KEEP:] if _manifest(folder, s).get("checked")), None)
  for old in steps[KEEP:]:
    if old != checked:
      _set_aside(os.path.join(folder, str(old)), os.path.join(folder, SPARE))


def _manifest(folder: str, step: int) -> dict:
  try:
    with open(os.path.join(folder, str(step), MANIFEST)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _set_aside(old: str, spare: str) -> None:
  """`old`, out of the newest KEEP, becomes the spare the next copy is written over (its manifest gone
  first: a spare is never whole); a second one is removed."""
  try:
    os.remove(os.path.join(old, MANIFEST))
    if not os.path.exists(spare):
      os.replace(old, spare)
      return
  except OSError:
    pass
  shutil.rmtree(old, ignore_errors=True)


def _commit(tmp: str, final: str) -> None:
  """The rename that makes a copy whole (tests pause here to tear one)."""
  shutil.rmtree(final, ignore_errors=True)
  os.replace(tmp, final)


def write_copy(folder: str, step: int, blob: bytes, manifest: dict) -> None:
  """A copy of bytes already in memory (tests)."""
  stage(folder, step, lambda w: w.write(blob))
  commit(folder, step, manifest)


def read_copy(folder: str, step: int) -> tuple[dict, bytes] | None:
  """(manifest, bytes) of a whole copy, or None (missing, torn or not matching its checksum)."""
  try:
    with open(os.path.join(folder, str(step), MANIFEST)) as f:
      manifest = json.load(f)
    with open(os.path.join(folder, str(step), SHARDS), "rb") as f:
      blob = f.read()
  except (OSError, ValueError):
    return None
  return (manifest, blob) if checksum(blob) == manifest.get(CHECKSUM) else None


def whole_manifest(folder: str, step: int) -> dict | None:
  """The manifest of a whole copy (its bytes checksummed as they are read, never held), or None."""
  try:
    with open(os.path.join(folder, str(step), MANIFEST)) as f:
      manifest = json.load(f)
    with open(os.path.join(folder, str(step), SHARDS), "rb") as f:
      digest = file_checksum(f)
  except (OSError, ValueError):
    return None
  return manifest if digest == manifest.get(CHECKSUM) else None


def whole_manifests(folder: str) -> dict[int, dict]:
  """{step: manifest} of the whole copies in `folder`."""
  if not os.path.isdir(folder):
    return {}
  manifests = {int(n): whole_manifest(folder, int(n)) for n in os.listdir(folder) if n.isdigit()}
  return {step: m for step, m in manifests.items() if m}


def whole_copies(folder: str) -> dict[int, str]:
  """{step: fingerprint} of the whole copies in `folder`."""
  return {step: m.get("fingerprint") for step, m in whole_manifests(folder).items()}


def discard_after(folders: list[str], step: int) -> set[int]:
  """Removes the copies (whole or torn) newer than `step` from `folders`; the steps removed."""
  removed = set()
  for folder in folders:
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
      head, path = name.split(".")[0], os.path.join(folder, name)
      if head.isdigit() and int(head) > step:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
          removed.add(int(head))
  return removed
