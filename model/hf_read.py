"""Hugging Face safetensors directories read slice by slice into our params (trainer/init_from.py through
experiments/lm.py's open_pretrained): a process reads only the slices it holds. The names and layouts
are model/hf_llama.py's (and model/hf_moe.py's for mixtures of experts); this file only reads.
"""

import json
import math
import os

import numpy as np

from errors import UserError
from model.hf_llama import _COMPUTED, INDEX, SINGLE, Layout, hf_shape, names

# safetensors' dtypes as numpy reads them; bfloat16 is read as its 16 bits and widened.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class Tensors:
  """The tensors of a Hugging Face model directory, one file or sharded with an index, mapped from
  the files (np.memmap: a slice copies only its bytes, though the system reads whole pages);
  `bytes_read` counts what slices have copied.
  Its own reader of the safetensors layout (8 bytes of header length, a JSON header, the data), as
  safetensors' numpy API cannot slice bfloat16, the dtype most checkpoints have."""

  def __init__(self, path: str):
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
      try:
        with open(index) as f:
          files = sorted(set(json.load(f)["weight_map"].values()))
      except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"init_from={path}: {INDEX} has no readable weight_map ({e})") from None
    elif os.path.isfile(os.path.join(path, SINGLE)):
      files = [SINGLE]
    else:
      raise UserError(f"init_from={path} has neither {SINGLE} nor {INDEX}")
    self.path, self._meta, self.bytes_read = path, {}, 0
    for file in files:
      full = os.path.join(path, file)
      not_safetensors = f"init_from={path}: {file} is not a whole safetensors file"
      try:
        length = os.path.getsize(full)
        with open(full, "rb") as f:
          size = int.from_bytes(f.read(8), "little")
          if size > length - 8:  # A Git LFS pointer, say: a clone without git-lfs.
            raise UserError(f"{not_safetensors} (its header runs past its end: a Git LFS pointer?)")
          header = json.loads(f.read(size))
        for name, info in header.items():
          if name != "__metadata__":
            start, end = info["data_offsets"]
            if 8 + size + end > length:
              raise UserError(f"{not_safetensors}: {name} runs past its end (truncated?)")
            self._meta[name] = (full, 8 + size + start, info["dtype"], tuple(info["shape"]))
      except OSError as e:
        raise UserError(f"init_from={path}: cannot read {file} ({e.strerror})") from None
      except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{not_safetensors} ({type(e).__name__}: {e})") from None

  def names(self) -> set[str]:
    return set(self._meta)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._info(name)[3]

  def _info(self, name: str):
    if name not in self._meta:
      raise UserError(f"init_from={self.path} has no tensor {name}")
    return self._meta[name]

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    file, offset, dtype, shape = self._info(name)
    if dtype not in _DTYPES:
      raise UserError(f"init_from={self.path}: {name} is {dtype}; this reads {', '.join(_DTYPES)}")
    mapped = np.memmap(file, _DTYPES[dtype], "r", offset, shape)
    out = np.array(mapped[index])
    self.bytes_read += out.nbytes
    if dtype == "BF16":  # Its 16 bits are a float32's upper half.
      out = out.astype(np.uint32)
      out <<= 16
      out = out.view(np.float32)
    return out


def _from_tensor(tensors: Tensors, lay: Layout, layer: int | None, shape: tuple, index: tuple) -> np.ndarray:
  """Our slice `index` (one slice per dim of our `shape`) of one layer's parameter: its tensor's, or
  for experts each expert's in turn, into one array."""
  if not lay.experts:
    return _from_matrix(tensors, lay, lay.name.format(i=layer), shape, index)
  if "{j}" in lay.name:  # One tensor per expert.
    read = lambda j: _from_matrix(tensors, lay, lay.name.format(i=layer, j=j), shape[1:], index[1:])
  else:  # One fused tensor [E, parts x out, in].
    read = lambda j: _from_matrix(tensors, lay, lay.name.format(i=layer), shape[1:], index[1:], (j, shape[0]))
  return _stacked(read, index[0], shape[0])


def _stacked(read, index: slice, size: int) -> np.ndarray:
  """`read(k)` for each k of `index` into one float32 array: part by part, never a second copy."""
  start, stop, _ = index.indices(size)
  out = None
  for k in range(start, stop):
    part = read(k)
    if out is None:
      out = np.empty((stop - start, *part.shape), np.float32)
    out[k - start] = part
  return out


def _from_matrix(tensors: Tensors, lay: Layout, name: str, shape: tuple, index: tuple, expert=None):
  """Our slice `index` of the 2-axis tensor `name` (or, `expert` = (j, E), of expert j's rows of a
  fused one), reading only the rows and columns it needs: per tensor axis, the range its group's first
  dim covers."""
  expected = hf_shape(lay, shape)
  lead, offset = (), 0
  if expert is not None:
    lead, offset = expert[:1], lay.part * expected[0]
    expected = (expert[1], lay.parts * expected[0], *expected[1:])
  if (found := tensors.shape(name)) != expected:
    raise UserError(
      f"init_from={tensors.path}: {name} is {list(found)}, but the model's config makes it "
      f"{list(expected)}: config.json and the weights disagree"
    )
  dims, reads, rest, at = [], [], [], 0
  for size in lay.groups:
    group, sl = shape[at : at + size], index[at : at + size]
    inner = math.prod(group[1:])
    start, stop, _ = sl[0].indices(group[0])
    reads.append(slice(start * inner, stop * inner))
    dims.append((stop - start, *group[1:]))
    rest.append((slice(None), *sl[1:]))
    at += size
  if lay.transposed:
    reads = reads[::-1]
  reads[0] = slice(reads[0].start + offset, reads[0].stop + offset)
  block = tensors.read(name, (*lead, *reads))
  if lay.transposed:
    block = block.T
  block = block.reshape(tuple(d for group in dims for d in group))
  return block[tuple(s for r in rest for s in r)]


class Pretrained:
  """Our params read from a Hugging Face directory (model/hf_moe.py for mixtures of experts):
  `read(leaf, shape, index)` is the slice of one parameter, in float32 (bfloat16 and float16 files
  are widened)."""

  def __init__(self, path: str, leaves: list[tuple[str, ...]], m):
    self.tensors = Tensors(path)
    self.names = names(m, self.tensors.names())
    expected = {name for leaf in leaves for name in self.names.hf_names(leaf)}
    unexpected = self.tensors.names() - expected - ({"lm_head.weight"} if m.tie_embeddings else set())
    unexpected = {n for n in unexpected if not n.endswith(_COMPUTED)}
    missing = expected - self.tensors.names()
    if missing or unexpected:
      raise UserError(
        f"init_from={path}: tensors "
        + "; ".join(
          f"{what} {', '.join(sorted(names)[:4])}{' ...' if len(names) > 4 else ''}"
          for what, names in (("missing", missing), ("not in the model", unexpected))
          if names
        )
      )

  @property
  def bytes_read(self) -> int:
    return self.tensors.bytes_read

  def read(self, leaf: tuple[str, ...], shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    lay, layers, stacked = self.names.where(leaf)
    if stacked:  # Layer by layer into one array.
      read = lambda k: _from_tensor(self.tensors, lay, layers[k], shape[1:], index[1:])
      return _stacked(read, index[0], shape[0])
    out = _from_tensor(self.tensors, lay, None if layers is None else layers[0], shape, index)
    return out.astype(np.float32, copy=False)
