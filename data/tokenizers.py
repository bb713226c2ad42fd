"""Tokenizers for data/prepare.py: bytes (the default, nothing to install) and SentencePiece models;
and decoding of byte-tokenized records, for reading a prepared data set back."""

import os

import numpy as np

from errors import UserError

PAD_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2  # Byte tokenizer ids; byte b is id b + BYTE_OFFSET.
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET


class ByteTokenizer:
  name, model, vocab_size, pad_id, eos_id = "byte", None, BYTE_VOCAB_SIZE, PAD_ID, EOS_ID

  def encode(self, document: bytes, source: str) -> np.ndarray:
    return np.frombuffer(document, np.uint8).astype(np.int32) + BYTE_OFFSET


class SentencePieceTokenizer:
  name = "sentencepiece"

  def __init__(self, path: str):
    try:
      import sentencepiece  # Optional: only needed for this tokenizer.
    except ImportError:
      raise UserError(
        f"--tokenizer={path} needs the sentencepiece package: `pip install sentencepiece`, "
        "or use --tokenizer=byte"
      ) from None
    if not os.path.isfile(path):
      raise UserError(f"--tokenizer={path}: no such SentencePiece model file")
    self.model = os.path.abspath(path)
    self._sp = sentencepiece.SentencePieceProcessor(model_file=self.model)
    self.vocab_size = int(self._sp.get_piece_size())
    self.eos_id = int(self._sp.eos_id())
    if self.eos_id < 0:
      raise UserError(
        f"--tokenizer={path} defines no eos id; train it with an eos piece or use --tokenizer=byte"
      )
    pad = int(self._sp.pad_id())
    if pad < 0 or pad == self.eos_id:
      # The trainer masks targets equal to pad_id: a pad shared with eos would hide every document end.
      raise UserError(
        f"--tokenizer={path} defines no pad id distinct from eos; train it with --pad_id=N "
        "(spm_train) or use --tokenizer=byte"
      )
    self.pad_id = pad

  def encode(self, document: bytes, source: str) -> np.ndarray:
    try:
      text = document.decode("utf-8")
    except UnicodeDecodeError as e:
      raise UserError(f"{source} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return np.asarray(self._sp.encode(text), np.int32)


def make_tokenizer(spec: str):
  if spec == "byte":
    return ByteTokenizer()
  if spec.endswith(".model"):
    return SentencePieceTokenizer(spec)
  raise UserError(f"--tokenizer={spec!r} is not 'byte' or a SentencePiece '.model' file")


def decode(tokens) -> bytes:
  """Byte tokenizer, for reading: drops padding and shows each end-of-document as b'\\n'."""
  ids = np.asarray(tokens).ravel()
  ids = ids[ids != PAD_ID]
  _check_byte_ids(ids)
  return np.where(ids == EOS_ID, ord("\n"), ids - BYTE_OFFSET).astype(np.uint8).tobytes()


def decode_documents(records) -> list[bytes]:
  """Byte tokenizer, exact inverse of prepare: records in stream order -> the documents' bytes.

  Padding is dropped and the stream is split at each eos. Text after the last eos (records that end
  inside a document) comes back as a final, incomplete document.
  """
  ids = np.concatenate([np.asarray(r).ravel() for r in records]) if records else np.zeros(0, np.int32)
  ids = ids[ids != PAD_ID]
  _check_byte_ids(ids)
  ends = np.flatnonzero(ids == EOS_ID)
  docs, start = [], 0
  for end in ends:
    docs.append((ids[start:end] - BYTE_OFFSET).astype(np.uint8).tobytes())
    start = end + 1
  if start < len(ids):
    docs.append((ids[start:] - BYTE_OFFSET).astype(np.uint8).tobytes())
  return docs


def _check_byte_ids(ids: np.ndarray) -> None:
  if ids.size and (ids.min() < 0 or ids.max() >= BYTE_VOCAB_SIZE):
    raise ValueError(f"token ids must be in [0, {BYTE_VOCAB_SIZE}) for the byte tokenizer")
