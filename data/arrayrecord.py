"""Reads what `python -m data.prepare` wrote: metadata checks and a Grain random-access source.

Records are raw little-endian int32 bytes (see data/prepare.py): nothing is unpickled.
"""

import json
import os

import numpy as np

from data import prepare
from errors import UserError, require_keys

_RERUN = "re-run `python -m data.prepare`"
# What training, evaluation and decoding read from metadata.json (data.prepare writes more).
_READ_KEYS = (
  "seq_len",
  "vocab_size",
  "tokenizer",
  "pad_id",
  "eos_id",
  "num_records",
  "shards",
  "fingerprint",
)


def load_metadata(directory: str) -> dict:
  """metadata.json of a prepared dataset; a UserError that names data.path when it is missing or bad."""
  if not directory:
    raise UserError("data.path is empty; set it to a directory written by `python -m data.prepare`")
  if not os.path.isdir(directory):
    raise UserError(
      f"data.path={directory} is not a directory; {_RERUN} --output={directory} or fix data.path"
    )
  path = os.path.join(directory, prepare.METADATA)
  if not os.path.isfile(path):
    raise UserError(
      f"data.path={directory} has no {prepare.METADATA}; point data.path at a data.prepare output"
    )
  try:
    with open(path) as f:
      metadata = json.load(f)
  except ValueError as e:
    raise UserError(f"{path} is not valid JSON ({e}); {_RERUN}") from None
  if not isinstance(metadata, dict) or metadata.get("version") != prepare.VERSION:
    found = metadata.get("version") if isinstance(metadata, dict) else None
    raise UserError(f"{path} has format version {found}, this code reads {prepare.VERSION}; {_RERUN}")
  require_keys(metadata, _READ_KEYS, path, _RERUN)
  for key in ("num_records", "shards"):
    require_keys(metadata[key], ("train", "eval"), f"{path}'s {key}", _RERUN)
  return metadata


def check_seq_len(metadata: dict, seq_len: int) -> None:
  if metadata["seq_len"] != seq_len:
    raise UserError(
      f"data.seq_len={seq_len} but the data was prepared with seq_len={metadata['seq_len']}; "
      f"set data.seq_len={metadata['seq_len']} or {_RERUN} with --seq_len={seq_len}"
    )


def check_compatible(metadata: dict, seq_len: int, model_vocab_size: int) -> None:
  """The model and config can train on this data, else a UserError that says which key to change."""
  check_seq_len(metadata, seq_len)
  if metadata["vocab_size"] > model_vocab_size:
    raise UserError(
      f"the data's vocab_size={metadata['vocab_size']} ({metadata['tokenizer']} tokenizer) exceeds "
      f"model.vocab_size={model_vocab_size}; set model.vocab_size>={metadata['vocab_size']}"
    )


def _open(reader, paths: list[str], directory: str):
  """The ArrayRecord reader over `paths`; a shard it cannot open (truncated, not ArrayRecord: it raises
  a bare RuntimeError) is a UserError naming it. An OSError is the disk's, and stays one."""
  try:
    return reader(paths)
  except (RuntimeError, ValueError):
    for path in paths:
      try:
        reader([path])
      except (RuntimeError, ValueError) as e:
        raise UserError(
          f"data.path={directory}: shard {os.path.basename(path)} cannot be read ({type(e).__name__}"
          f"{': ' + str(e)[:200] if str(e) else ''}); it is truncated or damaged: {_RERUN}"
        ) from None
    raise


class ArrayRecordSource:
  """Grain random-access source over one split: record i is {'tokens': int32[seq_len + 1]}, and with
  the data's loss weights (prompt/response examples) also {'loss_weights': uint8[seq_len + 1]}.

  Safe to share between Grain's reader threads (ArrayRecord keeps one thread-safe reader per shard).
  Pickling (for Grain worker processes) carries only the directory, split and seq_len; shards reopen.
  """

  def __init__(self, directory: str, split: str, seq_len: int):
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    self.directory, self.split, self.seq_len = directory, split, seq_len
    self.metadata = load_metadata(directory)
    check_seq_len(self.metadata, seq_len)
    if split not in self.metadata["num_records"]:
      raise UserError(
        f"data.path={directory} has no split {split!r}; splits: {list(self.metadata['num_records'])}"
      )
    self.num_records = self.metadata["num_records"][split]
    if self.num_records == 0:
      raise UserError(
        f"data.path={directory} has no {split!r} records; prepare more text, a smaller --seq_len "
        f"or a larger --eval_fraction"
      )
    paths = [os.path.join(directory, name) for name in self.metadata["shards"][split]]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
      raise UserError(
        f"data.path={directory} is missing {len(missing)} shard(s), e.g. {missing[0]}; {_RERUN}"
      )
    self._source = _open(ArrayRecordDataSource, paths, directory)
    if len(self._source) != self.num_records:
      raise UserError(
        f"data.path={directory}: the {split!r} shards hold {len(self._source)} records but "
        f"{prepare.METADATA} says {self.num_records}; {_RERUN}"
      )
    self.loss_weights = bool(self.metadata.get("loss_weights"))
    self._record_bytes = (5 if self.loss_weights else 4) * (seq_len + 1)

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < self.num_records:
      raise IndexError(index)
    try:
      data = self._source[index]
    except (RuntimeError, ValueError) as e:  # The reader's word for a damaged shard (OSError: the disk's).
      raise UserError(
        f"record {index} of {self.split!r} in {self.directory} cannot be read ({type(e).__name__}: "
        f"{str(e)[:200]}); the shards are damaged: {_RERUN}"
      ) from None
    if len(data) != self._record_bytes:
      raise ValueError(
        f"record {index} of {self.split!r} in {self.directory} has {len(data)} bytes, not "
        f"{self._record_bytes}; the shards do not match {prepare.METADATA}"
      )
    n = self.seq_len + 1
    record = {"tokens": np.frombuffer(data, "<i4", n).astype(np.int32)}
    if self.loss_weights:
      record["loss_weights"] = np.frombuffer(data, np.uint8, n, 4 * n).copy()
    return record

  def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
    return [self[i] for i in indices]

  def __getstate__(self):
    return {"directory": self.directory, "split": self.split, "seq_len": self.seq_len}

  def __setstate__(self, state):
    self.__init__(state["directory"], state["split"], state["seq_len"])

  def __repr__(self) -> str:
    where = f"{self.directory!r}, {self.split!r}"
    return f"ArrayRecordSource({where}, seq_len={self.seq_len}, records={self.num_records})"
