"""Counts the collectives in a compiled step's post-partitioning HLO: kind, count, bytes per step, the
traffic each device sends, and which mesh axes they run over.

A collective inside a loop (scanned layers, microbatches) runs once per trip: its count and bytes are
multiplied by the loop's known trip count, and by every enclosing loop's. XLA's own cost analysis counts
a loop body once; this does not.
"""

import math
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*%\S+ = (?P<result>.+?) (?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(?P<name>\S+) \(.*\{\s*$")
_CALLEE = re.compile(r"\b(?:body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2}
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
  r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}"
)
_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    size = _BYTES.get(dtype) or int(dtype[1:]) // 8
    total += size * math.prod(_ints(dims))
  return total


def _tuple_elements(text: str) -> list[str]:
  """The top-level elements of an HLO tuple type '(a, (b, c), d)'."""
  inner, depth, parts, part = text.strip()[1:-1], 0, [], ""
  for ch in inner:
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append(part)
      part = ""
    else:
      part += ch
  return [*parts, part]


def _result_bytes(result: str, kind: str, is_start: bool) -> int:
  """The bytes the collective produces. An async '-start' op other than all-reduce returns
  (operands, results, ...): only its second element is the result."""
  if is_start and kind != "all-reduce" and result.lstrip().startswith("("):
    elements = _tuple_elements(result)
    if len(elements) > 1:
      return _shape_bytes(elements[1])
  return _shape_bytes(result)


def _first_group(line: str) -> list[int] | None:
  """Device positions (in the mesh's flattened order) of the op's first replica group."""
  if m := _IOTA.search(line):
    groups, size, dims, perm = int(m[1]), int(m[2]), _ints(m[3]), m[4]
    ids = np.arange(math.prod(dims)).reshape(dims)
    return list((ids.transpose(_ints(perm)) if perm else ids).reshape(groups, size)[0])
  if m := _MESH.search(line):
    axes = [(name.strip("'"), int(size)) for name, size in (a.split("=") for a in m[1].split(","))]
    ids = np.arange(math.prod(s for _, s in axes))
    if m[2]:
      ids = ids.reshape(_ints(m[2]))
      ids = (ids.transpose(_ints(m[3])) if m[3] else ids).reshape(-1)
    grid = ids.reshape([s for _, s in axes])
    over = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m[4]]
    rest = [i for i in range(len(axes)) if i not in over]
    return list(grid.transpose(rest + over).reshape(-1, math.prod(axes[i][1] for i in over) or 1)[0])
  if m := _LIST.search(line):
    return _ints(m[1].split("}")[0].strip("{"))
  return None


def _axes(group, mesh) -> list[str]:
  if group is None:
    return []
  coords = np.unravel_index(np.asarray(group), mesh.devices.shape)
  return [name for name, c in zip(mesh.axis_names, coords, strict=True) if len(set(c.tolist())) > 1]


def _permute_axes(line: str, mesh) -> list[str]:
  """The mesh axes a collective-permute's (source, target) pairs move along: a ring over context, say."""
  if not (m := _PAIRS.search(line)) or not m[1]:
    return []
  pairs = np.asarray([int(x) for x in re.findall(r"\d+", m[1])]).reshape(-1, 2)
  source, target = (np.unravel_index(pairs[:, i], mesh.devices.shape) for i in (0, 1))
  moved = zip(mesh.axis_names, source, target, strict=True)
  return [name for name, s, t in moved if np.any(s != t)]


def sent_bytes(kind: str, result_bytes: int, group_size: int) -> float:
  """Bytes one device sends for one op, by the bandwidth-optimal (ring) algorithm: what a network
  must carry, whatever the backend does. An all-reduce is a reduce-scatter plus an all-gather."""
  n = max(group_size, 1)
  share = (n - 1) / n
  return {
    "all-reduce": 2 * result_bytes * share,
    "all-gather": result_bytes * share,
    "reduce-scatter": result_bytes * (n - 1),  # Its result is one shard of the n reduced.
    "all-to-all": result_bytes * share,
    "collective-permute": result_bytes,
  }[kind]


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """{computation name: its lines}, and the entry computation's name."""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    if m := _COMPUTATION.match(line):
      current = m["name"]
      comps[current] = []
      entry = current if line.startswith("ENTRY") else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def trip_multipliers(hlo_text: str) -> dict[str, int]:
  """How many times each computation runs per execution of the entry: a while body runs its known trip
  count times per run of its caller (1 when XLA does not know it); a call, fusion or branch once."""
  return _runs(*_computations(hlo_text))


def _runs(comps: dict[str, list[str]], entry: str | None) -> dict[str, int]:
  calls: dict[str, list[tuple[str, int]]] = {name: [] for name in comps}
  for name, lines in comps.items():
    for line in lines:
      trips = int(m[1]) if " while(" in line and (m := _TRIP.search(line)) else 1  # Unknown: once.
      callees = _CALLEE.findall(line)
      if m := _BRANCHES.search(line):
        callees += [c.strip().lstrip("%") for c in m[1].split(",")]
      calls[name] += [(c, trips) for c in callees if c in comps]
  runs = dict.fromkeys(comps, 0)

  def visit(name: str, times: int) -> None:
    runs[name] += times
    for callee, trips in calls[name]:
      visit(callee, times * trips)

  if entry is not None:
    visit(entry, 1)
  return runs


def collectives(hlo_text: str, mesh) -> list[dict]:
  """[{kind, axes, count, bytes_per_device, sent_bytes_per_device, in_loops}], one entry per (kind,
  axes), largest traffic first. Per step: ops inside loops count once per trip. bytes_per_device: the
  results' size; sent_bytes_per_device: what each device sends (sent_bytes); in_loops: ops inside a
  loop (counted before multiplying)."""
  comps, entry = _computations(hlo_text)
  runs = _runs(comps, entry)  # The text is split once.
  table: dict[tuple, dict] = {}
  for name, lines in comps.items():
    for line in lines:
      m = _OP.match(line)
      if not m or not runs[name]:
        continue
      group = _first_group(line)
      axes = _permute_axes(line, mesh) if m["kind"] == "collective-permute" else _axes(group, mesh)
      size = _result_bytes(m["result"], m["kind"], bool(m["start"]))
      group_size = len(group) if group is not None else mesh.devices.size
      key = (m["kind"], tuple(axes))
      empty = {"count": 0, "bytes_per_device": 0, "sent_bytes_per_device": 0.0, "in_loops": 0}
      entry = table.setdefault(key, {"kind": m["kind"], "axes": axes, **empty})
      entry["count"] += runs[name]
      entry["bytes_per_device"] += runs[name] * size
      entry["sent_bytes_per_device"] += runs[name] * sent_bytes(m["kind"], size, group_size)
      entry["in_loops"] += runs[name] > 1
  return sorted(table.values(), key=lambda e: -e["sent_bytes_per_device"])
