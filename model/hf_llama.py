"""Hugging Face's Llama layout <-> model/transformer.py's Decoder: config.json's keys, tensor names and
how each tensor is laid out, in both directions. No torch, no transformers: safetensors and numpy.

Each of our parameters is one Hugging Face tensor per layer (`model.layers.{i}.self_attn.q_proj.weight`
[heads * head_dim, embed]), transposed where torch's Linear keeps [out, in] and its flat axis split
(ours: wq [embed, heads, head_dim]). Scanned layers stack the per-layer tensors on a leading axis.
Slices are read from the file lazily (safetensors' get_slice): a process reads only what it holds.
"""

import json
import math
import os
from typing import NamedTuple

import numpy as np

from errors import UserError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
# Buffers some checkpoints save that are computed, not learned.
_COMPUTED = (".rotary_emb.inv_freq",)


class Layout(NamedTuple):
  """Ours = the tensor (transposed when `transposed`) with each of its 2 axes split into the dims of
  `groups` (ours, in order): wq is transposed with groups (1, 2), [embed] and [heads, head_dim]."""

  name: str  # The Hugging Face name; `{i}` is the layer.
  transposed: bool
  groups: tuple[int, ...]  # How many of our dims each (transposed) tensor axis becomes.


_BLOCK = {
  ("attn_norm", "scale"): Layout("model.layers.{i}.input_layernorm.weight", False, (1,)),
  ("mlp_norm", "scale"): Layout("model.layers.{i}.post_attention_layernorm.weight", False, (1,)),
  ("attn", "wq"): Layout("model.layers.{i}.self_attn.q_proj.weight", True, (1, 2)),
  ("attn", "wk"): Layout("model.layers.{i}.self_attn.k_proj.weight", True, (1, 2)),
  ("attn", "wv"): Layout("model.layers.{i}.self_attn.v_proj.weight", True, (1, 2)),
  ("attn", "wo"): Layout("model.layers.{i}.self_attn.o_proj.weight", True, (2, 1)),
  ("mlp", "gate"): Layout("model.layers.{i}.mlp.gate_proj.weight", True, (1, 1)),
  ("mlp", "up"): Layout("model.layers.{i}.mlp.up_proj.weight", True, (1, 1)),
  ("mlp", "down"): Layout("model.layers.{i}.mlp.down_proj.weight", True, (1, 1)),
}
_TOP = {
  ("embed",): Layout("model.embed_tokens.weight", False, (1, 1)),
  ("unembed",): Layout("lm_head.weight", True, (1, 1)),
  ("final_norm", "scale"): Layout("model.norm.weight", False, (1,)),
}


def layout(leaf: tuple[str, ...]) -> tuple[Layout, int | None, bool]:
  """(layout, layer or None, scanned) of one of our parameters by its tree path."""
  if leaf in _TOP:
    return _TOP[leaf], None, False
  if leaf[0] == "layers" and leaf[1:] in _BLOCK:
    return _BLOCK[leaf[1:]], None, True
  if leaf[0] == "blocks" and leaf[2:] in _BLOCK:
    return _BLOCK[leaf[2:]], int(leaf[1]), False
  raise UserError(f"parameter {'/'.join(leaf)} has no Hugging Face Llama name")


# --- config.json -> our keys


def read_config(path: str) -> dict:
  file = os.path.join(path, CONFIG)
  try:
    with open(file) as f:
      hf = json.load(f)
  except OSError as e:
    raise UserError(f"init_from={path}: cannot read {CONFIG} ({e.strerror})") from None
  except ValueError as e:
    raise UserError(f"{file} is not valid JSON ({e})") from None
  if not isinstance(hf, dict):
    raise UserError(f"{file} is not a JSON object")
  return hf


def _rope(hf: dict) -> dict:
  """RoPE's parameters from either layout: transformers 5's `rope_parameters`, or 4's `rope_theta`
  beside `rope_scaling`."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  params.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
  params.setdefault("rope_type", params.pop("type", "default"))
  return params


def config_keys(hf: dict, file: str) -> dict[str, tuple[object, str]]:
  """{our dotted key: (value, the config.json field it comes from)}; a UserError naming any feature
  the Decoder does not have."""

  def unsupported(what: str) -> UserError:
    return UserError(f"{file}: {what}, which model/transformer.py's Decoder does not have")

  if hf.get("model_type") != "llama":
    raise unsupported(f"model_type {hf.get('model_type')!r} (only 'llama' maps onto it)")
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field):
      raise unsupported(f"{field}=true (biases)")
  if hf.get("hidden_act", "silu") != "silu":
    raise unsupported(f"hidden_act {hf['hidden_act']!r} (its MLP is SwiGLU with silu)")
  if hf.get("sliding_window") or hf.get("use_sliding_window"):
    raise unsupported("a sliding attention window")
  for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
    if not isinstance(hf.get(field), int):
      raise UserError(f"{file} has no whole number {field}")
  rope = _rope(hf)
  if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise unsupported("partial_rotary_factor (RoPE on part of each head)")
  if rope["rope_type"] not in ("default", "llama3"):
    raise unsupported(f"rope_type {rope['rope_type']!r} (it has plain RoPE and 'llama3' scaling)")
  heads = hf["num_attention_heads"]
  keys = {
    "model.vocab_size": (hf["vocab_size"], "vocab_size"),
    "model.embed_dim": (hf["hidden_size"], "hidden_size"),
    "model.num_layers": (hf["num_hidden_layers"], "num_hidden_layers"),
    "model.num_heads": (heads, "num_attention_heads"),
    "model.num_kv_heads": (hf.get("num_key_value_heads") or heads, "num_key_value_heads"),
    "model.head_dim": (hf.get("head_dim") or hf["hidden_size"] // heads, "head_dim"),
    "model.mlp_dim": (hf["intermediate_size"], "intermediate_size"),
    "model.norm_eps": (float(hf.get("rms_norm_eps", 1e-6)), "rms_norm_eps"),
    "model.rope_base": (float(rope["rope_theta"]), "rope_theta"),
    "model.rope_scaling": ("none" if rope["rope_type"] == "default" else "llama3", "rope_type"),
    "model.tie_embeddings": (bool(hf.get("tie_word_embeddings", False)), "tie_word_embeddings"),
    "model.scale_tied_embeddings": (False, "Llama looks up its table unscaled"),
  }
  if rope["rope_type"] == "llama3":
    for ours, theirs in (
      ("factor", "factor"),
      ("low_freq_factor", "low_freq_factor"),
      ("high_freq_factor", "high_freq_factor"),
      ("original_max_len", "original_max_position_embeddings"),
    ):
      if theirs not in rope:
        raise UserError(f"{file}: rope_type llama3 without {theirs}")
      value = rope[theirs] if ours == "original_max_len" else float(rope[theirs])
      keys[f"model.rope_llama3_{ours}"] = (value, theirs)
  return keys


def hf_config(m, generation: bool = False) -> dict:
  """config.json (or, `generation`, generation_config.json) of our model config `m` (config.model)."""
  head_dim = m.head_dim or m.embed_dim // m.num_heads
  rope = {"rope_type": "default", "rope_theta": m.rope_base}
  if m.rope_scaling == "llama3":
    rope = {
      "rope_type": "llama3",
      "rope_theta": m.rope_base,
      "factor": m.rope_llama3_factor,
      "low_freq_factor": m.rope_llama3_low_freq_factor,
      "high_freq_factor": m.rope_llama3_high_freq_factor,
      "original_max_position_embeddings": m.rope_llama3_original_max_len,
    }
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": m.vocab_size,
    "hidden_size": m.embed_dim,
    "num_hidden_layers": m.num_layers,
    "num_attention_heads": m.num_heads,
    "num_key_value_heads": m.num_kv_heads or m.num_heads,
    "head_dim": head_dim,
    "intermediate_size": m.mlp_dim,
    "hidden_act": "silu",
    "rms_norm_eps": m.norm_eps,
    "rope_parameters": rope,
    # transformers 4's names for the same, which it reads instead of rope_parameters.
    "rope_theta": m.rope_base,
    "rope_scaling": None if rope["rope_type"] == "default" else rope,
    "tie_word_embeddings": m.tie_embeddings,
    "attention_bias": False,
    "mlp_bias": False,
    "dtype": "float32",
  }


def check_exportable(m) -> None:
  if m.tie_embeddings and m.scale_tied_embeddings:
    raise UserError(
      "this run's tied embeddings are scaled by sqrt(embed_dim) (model.scale_tied_embeddings=True), "
      "which Llama's layout cannot say; train with model.scale_tied_embeddings=False to export it"
    )


# --- Reading tensors from a safetensors directory, slice by slice


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


def hf_shape(lay: Layout, shape: tuple) -> tuple[int, ...]:
  """The Hugging Face tensor's shape of one layer of ours (`shape`, without a scanned layer axis)."""
  axes, at = [], 0
  for size in lay.groups:
    axes.append(math.prod(shape[at : at + size]))
    at += size
  return tuple(axes[::-1] if lay.transposed else axes)


def _from_tensor(tensors: Tensors, lay: Layout, layer: int, shape: tuple, index: tuple) -> np.ndarray:
  """Our slice `index` (one slice per dim of our `shape`) of one layer's tensor, reading only the
  rows and columns it needs: per tensor axis, the range its group's first dim covers."""
  name = lay.name.format(i=layer)
  if (found := tensors.shape(name)) != (expected := hf_shape(lay, shape)):
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
  block = tensors.read(name, tuple(reads))
  if lay.transposed:
    block = block.T
  block = block.reshape(tuple(d for group in dims for d in group))
  return block[tuple(s for r in rest for s in r)]


class Pretrained:
  """Our params read from a Hugging Face Llama directory: `read(leaf, shape, index)` is the slice of
  one parameter, in float32 (bfloat16 and float16 files are widened)."""

  def __init__(self, path: str, leaves: list[tuple[str, ...]], tied: bool, num_layers: int):
    self.tensors = Tensors(path)
    expected = set()
    for leaf in leaves:
      lay, layer, scanned = layout(leaf)
      expected |= {lay.name.format(i=i) for i in (range(num_layers) if scanned else [layer])}
    unexpected = self.tensors.names() - expected - ({"lm_head.weight"} if tied else set())
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
    lay, layer, scanned = layout(leaf)
    if scanned:
      start, stop, _ = index[0].indices(shape[0])
      out = None
      for i in range(start, stop):  # Layer by layer into one array, never a second copy of it.
        part = _from_tensor(self.tensors, lay, i, shape[1:], index[1:])
        if out is None:
          out = np.empty((stop - start, *part.shape), np.float32)
        out[i - start] = part
    else:
      out = _from_tensor(self.tensors, lay, layer, shape, index)
    return out.astype(np.float32, copy=False)


# --- Our params -> Hugging Face tensors


def hf_tensors(params: dict) -> dict[str, np.ndarray]:
  """{Hugging Face name: array} of our params (numpy, nested as the model names them)."""
  import jax

  out = {}
  for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
    leaf = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    lay, layer, scanned = layout(leaf)
    for i, array in enumerate(value) if scanned else [(layer, value)]:
      flat = np.asarray(array)
      flat = flat.reshape(hf_shape(lay, flat.shape)[::-1] if lay.transposed else hf_shape(lay, flat.shape))
      out[lay.name.format(i=i)] = np.ascontiguousarray(flat.T if lay.transposed else flat)
  return out
