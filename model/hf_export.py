"""Writes our Decoder's params as a Hugging Face directory that transformers loads (a Llama, a Qwen3, a
Mixtral or a Qwen3-MoE: model/hf_llama.py, model/hf_moe.py):
config.json, model.safetensors (or shards with model.safetensors.index.json beyond max_shard_bytes)
and generation_config.json, plus the tokenizer when the run's data has one (data/tokenizers.py).
`replacing` makes a re-export replace the earlier one whole: a stale index beside a new
model.safetensors would make our reader (which prefers the index) and transformers (which prefers
model.safetensors) load different weights.
"""

import contextlib
import json
import os
import re
import shutil
import tempfile

import numpy as np
from safetensors.numpy import save_file

from errors import UserError
from model import hf_llama

MAX_SHARD_BYTES = 5 * 2**30  # As transformers' save_pretrained shards by default ("5GB").
# Every name an export of ours writes (the tokenizer's two with data/tokenizers.write_hf_tokenizer):
# a directory holding only these is one we may replace; one holding anything else is not ours.
OURS = re.compile(
  r"(config|generation_config|tokenizer|tokenizer_config)\.json|model\.safetensors(\.index\.json)?"
  r"|model-\d{5}-of-\d{5}\.safetensors"
)


@contextlib.contextmanager
def replacing(out: str):
  """Yields a new empty directory beside `out` to write the export into; once the block ends
  without an exception it becomes `out`, replacing an earlier export there whole (its files are
  removed only after the new one is complete). A directory holding anything an export does not write
  is refused before anything is written; on an exception `out` is untouched and the new one removed.
  The swap is two renames: a crash between them leaves the old export in `.NAME.export-*/old`."""
  out = os.path.abspath(out)
  if os.path.lexists(out) and not os.path.isdir(out):
    raise UserError(f"--out={out} is a file, not a directory; give a new or empty directory")
  if os.path.isdir(out):
    if foreign := sorted(f for f in os.listdir(out) if not OURS.fullmatch(f)):
      raise UserError(
        f"--out={out} holds {foreign[0]!r}, which an export does not write; give a new or empty "
        "directory (an earlier export there is replaced whole)"
      )
  parent, name = os.path.split(out)
  os.makedirs(parent, exist_ok=True)
  hold = tempfile.mkdtemp(prefix=f".{name}.export-", dir=parent)  # A sibling: renames stay on one disk.
  staged = os.path.join(hold, "new")
  os.mkdir(staged)  # Not mkdtemp's own 0700 directory, which would make the export private to us.
  try:
    yield staged
  except BaseException:
    shutil.rmtree(hold, ignore_errors=True)
    raise
  if os.path.isdir(out):
    os.rename(out, os.path.join(hold, "old"))
  os.rename(staged, out)
  shutil.rmtree(hold)


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
  """Writes the directory `out` (new or empty: `replacing` gives one); `special` holds the token ids
  ({'eos_token_id': 1, ...}) for the configs. Returns the number of files of weights."""
  hf_llama.check_exportable(model_config)
  os.makedirs(out, exist_ok=True)
  parts = shards(hf_llama.hf_tensors(params, model_config), max_shard_bytes)
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
