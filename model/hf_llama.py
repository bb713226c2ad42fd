"""Hugging Face's Llama layout <-> model/transformer.py's Decoder: config.json's keys, tensor names and
how each tensor is laid out, in both directions. No torch, no transformers: safetensors and numpy.
Qwen3 is the same with q_norm and k_norm (model.qk_norm); the mixtures of experts (Mixtral, Qwen3-MoE)
add their routed blocks' names and config keys in model/hf_moe.py and share the rest.

Each of our parameters is one Hugging Face tensor per layer (`model.layers.{i}.self_attn.q_proj.weight`
[heads * head_dim, embed]), transposed where torch's Linear keeps [out, in] and its flat axis split
(ours: wq [embed, heads, head_dim]). Scanned layers stack the per-layer tensors on a leading axis, and
experts (ours [E, ...]) the per-expert ones. model/hf_read.py reads slices of the files lazily
(np.memmap): a process reads only what it holds.
"""

import math
from typing import NamedTuple

import numpy as np

from errors import UserError
from model import hf_moe
from model.hf_common import (  # noqa: F401 - re-exported: the files' names, where they are used.
  _COMPUTED,
  CONFIG,
  GENERATION_CONFIG,
  INDEX,
  SINGLE,
  Layout,
  common_keys,
  read_config,
  unsupported,
  whole,
)

# A block's tensors by our path inside the block: what every block has (its two norms, attention),
# Qwen3's per-head q/k norms, and a dense SwiGLU (a mixture of experts' routed MLP: model/hf_moe.py).
_BLOCK = {
  ("attn_norm", "scale"): Layout("model.layers.{i}.input_layernorm.weight", False, (1,)),
  ("mlp_norm", "scale"): Layout("model.layers.{i}.post_attention_layernorm.weight", False, (1,)),
  ("attn", "wq"): Layout("model.layers.{i}.self_attn.q_proj.weight", True, (1, 2)),
  ("attn", "wk"): Layout("model.layers.{i}.self_attn.k_proj.weight", True, (1, 2)),
  ("attn", "wv"): Layout("model.layers.{i}.self_attn.v_proj.weight", True, (1, 2)),
  ("attn", "wo"): Layout("model.layers.{i}.self_attn.o_proj.weight", True, (2, 1)),
}
_QK_NORM = {
  ("attn", "q_norm", "scale"): Layout("model.layers.{i}.self_attn.q_norm.weight", False, (1,)),
  ("attn", "k_norm", "scale"): Layout("model.layers.{i}.self_attn.k_norm.weight", False, (1,)),
}
_DENSE_MLP = {
  ("mlp", "gate"): Layout("model.layers.{i}.mlp.gate_proj.weight", True, (1, 1)),
  ("mlp", "up"): Layout("model.layers.{i}.mlp.up_proj.weight", True, (1, 1)),
  ("mlp", "down"): Layout("model.layers.{i}.mlp.down_proj.weight", True, (1, 1)),
}
_TOP = {
  ("embed",): Layout("model.embed_tokens.weight", False, (1, 1)),
  ("unembed",): Layout("lm_head.weight", True, (1, 1)),
  ("final_norm", "scale"): Layout("model.norm.weight", False, (1,)),
}


class Where(NamedTuple):
  layout: Layout
  layers: range | None  # The Hugging Face layers the parameter holds; None: not a block's.
  stacked: bool  # Scanned: a leading axis over `layers`.


class Names:
  """Which Hugging Face tensor each of our parameters is, for one model: the top-level ones, a dense
  block's (`dense`) and, in a mixture of experts, a routed block's (`routed`), the blocks from
  `first_routed` on. Scanned, `dense_layers` stacks the dense blocks and `layers` the routed ones (or
  all of them)."""

  def __init__(self, dense: dict, num_layers: int, routed: dict | None = None, first_routed=0, experts=0):
    self.dense, self.routed, self.num_layers, self.experts = dense, routed, num_layers, experts
    self.first_routed = first_routed if routed else num_layers  # Where the routed blocks start.

  def where(self, leaf: tuple[str, ...]) -> Where:
    if leaf in _TOP:
      return Where(_TOP[leaf], None, False)
    kind, rest, lay = leaf[0], leaf[1:], None
    if kind == "blocks" and len(leaf) > 2:
      i, rest = int(leaf[1]), leaf[2:]
      lay = (self.routed if i >= self.first_routed else self.dense).get(rest)
      layers, stacked = range(i, i + 1), False
    elif kind == "dense_layers":
      lay, layers, stacked = self.dense.get(rest), range(self.first_routed), True
    elif kind == "layers":
      table, start = (self.routed, self.first_routed) if self.routed else (self.dense, 0)
      lay, layers, stacked = table.get(rest), range(start, self.num_layers), True
    if lay is None:
      raise UserError(f"parameter {'/'.join(leaf)} has no Hugging Face name")
    return Where(lay, layers, stacked)

  def hf_names(self, leaf: tuple[str, ...]) -> list[str]:
    """Every Hugging Face tensor parameter `leaf` is read from or written to."""
    lay, layers, _ = self.where(leaf)
    experts = range(self.experts) if lay.experts and "{j}" in lay.name else [0]
    return [lay.name.format(i=i, j=j) for i in layers or [0] for j in experts]


def names(m, present=frozenset()) -> Names:
  """The Names of our model config `m` (config.model); `present`, a file's tensor names, chooses
  between the layouts of a mixture's experts (per expert, or transformers 5's fused ones)."""
  block = _BLOCK | (_QK_NORM if m.qk_norm else {})
  dense = block | _DENSE_MLP
  if not m.moe.num_experts:
    return Names(dense, m.num_layers)
  return Names(
    dense, m.num_layers, block | hf_moe.routed_mlp(m, present), m.moe.first_dense, m.moe.num_experts
  )


# --- config.json -> our keys

DENSE_TYPES = ("llama", "qwen3")  # Qwen3: Llama's layout with q_norm and k_norm (model.qk_norm).


def config_keys(hf: dict, file: str) -> dict[str, tuple[object, str]]:
  """{our dotted key: (value, the config.json field it comes from)}; a UserError naming any feature
  the Decoder does not have. Mixtures of experts: model/hf_moe.py."""
  kind = hf.get("model_type")
  if kind not in DENSE_TYPES:
    if kind in hf_moe.MODEL_TYPES:
      return hf_moe.config_keys(hf, file)
    known = ", ".join(repr(t) for t in DENSE_TYPES + hf_moe.MODEL_TYPES)
    raise unsupported(file, f"model_type {kind!r} (these map onto it: {known})")
  if hf.get("mlp_bias"):
    raise unsupported(file, "mlp_bias=true (biases)")
  whole(hf, file, "intermediate_size")
  return common_keys(hf, file) | {
    "model.mlp_dim": (hf["intermediate_size"], "intermediate_size"),
    "model.qk_norm": (kind == "qwen3", f"model_type {kind}"),
    "model.moe.num_experts": (0, f"model_type {kind}"),
  }


def hf_config(m) -> dict:
  """config.json of our model config `m` (config.model): a Llama, or with model.qk_norm a Qwen3; a
  mixture of experts as model/hf_moe.py says."""
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
  common = {
    "vocab_size": m.vocab_size,
    "hidden_size": m.embed_dim,
    "num_hidden_layers": m.num_layers,
    "num_attention_heads": m.num_heads,
    "num_key_value_heads": m.num_kv_heads or m.num_heads,
    "head_dim": head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": m.norm_eps,
    "rope_parameters": rope,
    # transformers 4's names for the same, which it reads instead of rope_parameters.
    "rope_theta": m.rope_base,
    "rope_scaling": None if rope["rope_type"] == "default" else rope,
    "tie_word_embeddings": m.tie_embeddings,
    "dtype": "float32",
  }
  if m.moe.num_experts:
    return hf_moe.hf_config(m, common)
  if m.qk_norm:
    family = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False}
  else:
    family = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False}
  return family | common | {"intermediate_size": m.mlp_dim, "attention_bias": False}


def check_exportable(m) -> None:
  if m.tie_embeddings and m.scale_tied_embeddings:
    raise UserError(
      "this run's tied embeddings are scaled by sqrt(embed_dim) (model.scale_tied_embeddings=True), "
      "which Llama's layout cannot say; train with model.scale_tied_embeddings=False to export it"
    )
  if m.moe.num_experts:
    hf_moe.check_exportable(m)


# --- Our shapes <-> Hugging Face's


def hf_shape(lay: Layout, shape: tuple) -> tuple[int, ...]:
  """The Hugging Face tensor's shape of one layer of ours (`shape`, without a scanned layer axis)."""
  axes, at = [], 0
  for size in lay.groups:
    axes.append(math.prod(shape[at : at + size]))
    at += size
  return tuple(axes[::-1] if lay.transposed else axes)


# --- Our params -> Hugging Face tensors


def hf_tensors(params: dict, m) -> dict[str, np.ndarray]:
  """{Hugging Face name: array} of our params (numpy, nested as the model names them) of model config
  `m`; a mixture's experts one tensor each."""
  import jax

  table, out = names(m), {}
  for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
    leaf = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    lay, layers, stacked = table.where(leaf)
    first = None if layers is None else layers[0]
    for i, array in zip(layers, value, strict=True) if stacked else [(first, value)]:
      for j, matrix in enumerate(array) if lay.experts else [(0, array)]:
        flat = np.asarray(matrix)
        shape = hf_shape(lay, flat.shape)
        flat = flat.reshape(shape[::-1] if lay.transposed else shape)
        out[lay.name.format(i=i, j=j)] = np.ascontiguousarray(flat.T if lay.transposed else flat)
  return out
