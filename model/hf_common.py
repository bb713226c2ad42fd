"""What Hugging Face's Llama-like layouts share, dense (model/hf_llama.py) or mixtures of experts
(model/hf_moe.py): the file names, how a tensor maps onto ours (Layout), and the config.json keys every
family fixes alike. No torch, no transformers."""

import json
import os
from typing import NamedTuple

from errors import UserError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
# Buffers some checkpoints save that are computed, not learned.
_COMPUTED = (".rotary_emb.inv_freq",)


class Layout(NamedTuple):
  """Ours = the tensor (transposed when `transposed`) with each of its 2 axes split into the dims of
  `groups` (ours, in order): wq is transposed with groups (1, 2), [embed] and [heads, head_dim].
  `experts`: ours has a leading experts axis [E, ...] over one tensor per expert (`{j}` in the name),
  or over the first axis of one fused tensor [E, parts x out, in] whose `part` of the out axis is ours
  (transformers 5's gate_up_proj holds gate, then up: parts 2)."""

  name: str  # The Hugging Face name; `{i}` is the layer, `{j}` the expert.
  transposed: bool
  groups: tuple[int, ...]  # How many of our dims each (transposed) tensor axis becomes.
  experts: bool = False
  part: int = 0
  parts: int = 1


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


def unsupported(file: str, what: str) -> UserError:
  return UserError(f"{file}: {what}, which model/transformer.py's Decoder does not have")


def whole(hf: dict, file: str, *fields: str) -> None:
  for field in fields:
    if not isinstance(hf.get(field), int):
      raise UserError(f"{file} has no whole number {field}")


def common_keys(hf: dict, file: str) -> dict[str, tuple[object, str]]:
  """The keys every family's config.json fixes alike (embeddings, attention, norms, RoPE), and a
  UserError for what none of them maps (biases, another activation, sliding windows, other RoPE)."""
  if hf.get("attention_bias") or hf.get("qkv_bias"):
    raise unsupported(file, "attention_bias=true (biases)")
  if hf.get("hidden_act", "silu") != "silu":
    raise unsupported(file, f"hidden_act {hf['hidden_act']!r} (its MLP is SwiGLU with silu)")
  # Qwen's configs keep a sliding_window that only use_sliding_window turns on; Llama's and Mixtral's
  # attend within it whenever it is set.
  qwen = str(hf.get("model_type", "")).startswith("qwen")
  sliding = {t for t in hf.get("layer_types") or () if t != "full_attention"}
  if hf.get("use_sliding_window") or (hf.get("sliding_window") and not qwen) or sliding:
    raise unsupported(file, "a sliding attention window")
  whole(hf, file, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
  rope = _rope(hf)
  if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    raise unsupported(file, "partial_rotary_factor (RoPE on part of each head)")
  if rope["rope_type"] not in ("default", "llama3"):
    raise unsupported(file, f"rope_type {rope['rope_type']!r} (it has plain RoPE and 'llama3' scaling)")
  heads = hf["num_attention_heads"]
  keys = {
    "model.vocab_size": (hf["vocab_size"], "vocab_size"),
    "model.embed_dim": (hf["hidden_size"], "hidden_size"),
    "model.num_layers": (hf["num_hidden_layers"], "num_hidden_layers"),
    "model.num_heads": (heads, "num_attention_heads"),
    "model.num_kv_heads": (hf.get("num_key_value_heads") or heads, "num_key_value_heads"),
    "model.head_dim": (hf.get("head_dim") or hf["hidden_size"] // heads, "head_dim"),
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
