"""Counts the collectives in a compiled step's post-partitioning HLO: kind, count, bytes each device
sends or receives per step (the result size), and which mesh axes they run over."""

import math
import re

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*%\S+ = (?P<result>.+?) (?P<kind>" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2}
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
  r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}"
)
_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}")


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _result_bytes(result: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(result):
    size = _BYTES.get(dtype) or int(dtype[1:]) // 8
    total += size * math.prod(_ints(dims))
  return total


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


def collectives(hlo_text: str, mesh) -> list[dict]:
  """[{kind, count, bytes_per_device, axes}], one entry per (kind, axes), largest traffic first."""
  table: dict[tuple, dict] = {}
  for line in hlo_text.splitlines():
    m = _OP.match(line)
    if not m:
      continue
    axes = _axes(_first_group(line), mesh)
    entry = table.setdefault((m["kind"], tuple(axes)), {"kind": m["kind"], "count": 0, "bytes_per_device": 0})
    entry["axes"] = axes
    entry["count"] += 1
    entry["bytes_per_device"] += _result_bytes(m["result"])
  return sorted(table.values(), key=lambda e: -e["bytes_per_device"])
