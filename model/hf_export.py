"""Writes our Decoder's params as a Hugging Face Llama directory that transformers loads:
config.json, model.safetensors (or shards with model.safetensors.index.json beyond max_shard_bytes)
and generation_config.json, plus the tokenizer when the run's data has one (data/tokenizers.py).
"""

import json
import os

import numpy as np
from safetensors.numpy import save_file

from model import hf_llama

MAX_SHARD_BYTES = 5 * 2**30  # As transformers' save_pretrained shards by default ("5GB").


def shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
  """The tensors in name order, cut into files of at most `max_bytes` (a larger tensor alone)."""
  out, size = [{}], 0
  for name in sorted(tensors):
    n = tensors[name].nbytes
    if out[-1] and size + n > max_bytes:
      out.append({})
      size = 0
    out[-1][name] = tensors[name]
    size += n
  return out


def write(out: str, model_config, params: dict, special: dict, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
  """Writes the directory `out`; `special` holds the token ids ({'eos_token_id': 1, ...}) for the
  configs. Returns the number of files of weights."""
  hf_llama.check_exportable(model_config)
  os.makedirs(out, exist_ok=True)
  parts = shards(hf_llama.hf_tensors(params), max_shard_bytes)
  metadata = {"format": "pt"}  # What transformers expects of a safetensors file it loads.
  if len(parts) == 1:
    save_file(parts[0], os.path.join(out, hf_llama.SINGLE), metadata=metadata)
  else:
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
      file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
      save_file(part, os.path.join(out, file), metadata=metadata)
      weight_map |= dict.fromkeys(part, file)
      total += sum(t.nbytes for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(os.path.join(out, hf_llama.INDEX), index)
  _write_json(os.path.join(out, hf_llama.CONFIG), hf_llama.hf_config(model_config) | special)
  _write_json(os.path.join(out, hf_llama.GENERATION_CONFIG), special)
  return len(parts)


def _write_json(path: str, value: dict) -> None:
  with open(path, "w") as f:
    json.dump(value, f, indent=2)
    f.write("\n")
