"""data.prepare's output shards: how the records split into `train` and `eval`, the shards' names, and
writing them as ArrayRecord files (data/prepare.py's docstring says what a record holds).
"""

import hashlib
import math
import os

import numpy as np

SPLITS = ("train", "eval")
WRITER_OPTIONS = "group_size:1"  # One record per chunk: Grain reads records at random.


def split_sizes(num_records: int, eval_fraction: float) -> dict[str, int]:
  num_eval = 0
  if num_records >= 2 and eval_fraction > 0:
    num_eval = min(num_records - 1, max(1, int(num_records * eval_fraction)))
  return {"train": num_records - num_eval, "eval": num_eval}


def shard_names(split: str, num_records: int, records_per_shard: int) -> list[str]:
  n = math.ceil(num_records / records_per_shard)
  return [f"{split}-{i:05d}-of-{n:05d}.array_record" for i in range(n)]


def stream_records(tokens: np.ndarray, pad_id: int, record_len: int):
  """record i -> its bytes: the token stream cut every record_len tokens, the last one padded."""

  def record(i: int) -> bytes:
    row = np.full(record_len, pad_id, "<i4")
    chunk = tokens[i * record_len : (i + 1) * record_len]
    row[: len(chunk)] = chunk
    return row.tobytes()

  return record


def write_shards(record_bytes, sizes, records_per_shard, directory):
  """Writes every record (`record_bytes(i)`) in order; returns (shards per split, sha256 hex of all
  record bytes)."""
  from array_record.python.array_record_module import ArrayRecordWriter

  digest, shards, record = hashlib.sha256(), {}, 0
  for split in SPLITS:
    shards[split] = shard_names(split, sizes[split], records_per_shard)
    end = record + sizes[split]
    for name in shards[split]:
      writer = ArrayRecordWriter(os.path.join(directory, name), WRITER_OPTIONS)
      for _ in range(min(records_per_shard, end - record)):
        data = record_bytes(record)
        digest.update(data)
        writer.write(data)
        record += 1
      writer.close()
  return shards, digest.hexdigest()


def valid_in_last(sizes: dict[str, int], record_len: int, last_valid: int) -> dict[str, int]:
  """Real (non-padding) tokens in each split's last record: only the stream's last record is short."""
  last_split = "eval" if sizes["eval"] else "train"
  return {s: 0 if not sizes[s] else last_valid if s == last_split else record_len for s in SPLITS}
