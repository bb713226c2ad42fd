"""Tokenizers for data/prepare.py: bytes (the default), Hugging Face `tokenizers` files (loaded, or a
byte-level BPE trained on the corpus) and SentencePiece models (optional: install sentencepiece);
`for_dataset` gives a prepared data set's own tokenizer back, to decode what a model writes, and
`write_hf_tokenizer` writes it for transformers."""

import json
import os

import numpy as np

from errors import UserError

PAD_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2  # Byte tokenizer ids; byte b is id b + BYTE_OFFSET.
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET


TOKENIZER_FILE = "tokenizer.json"  # A data set's Hugging Face tokenizer, beside its metadata.json.
# Special tokens a `tokenizers` file may pad and end documents with; a trained one uses the first.
PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")
EOS_TOKENS = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "[SEP]")


class ByteTokenizer:
  name, model, vocab_size, pad_id, eos_id = "byte", None, BYTE_VOCAB_SIZE, PAD_ID, EOS_ID

  def encode(self, document: bytes, source: str) -> np.ndarray:
    return np.frombuffer(document, np.uint8).astype(np.int32) + BYTE_OFFSET

  def decode(self, ids) -> str:
    return decode(ids).decode("utf-8", errors="replace")

  # As transformers' tokenizer of our export encodes and decodes by default (what lm-eval calls).
  def encode_text(self, text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode("utf-8")]

  def decode_text(self, ids) -> str:
    ids = np.asarray(ids).ravel()
    return (
      (ids[ids >= BYTE_OFFSET] - BYTE_OFFSET).astype(np.uint8).tobytes().decode("utf-8", errors="replace")
    )


def _text(document: bytes, source: str) -> str:
  try:
    return document.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{source} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


class HFTokenizer:
  """A Hugging Face `tokenizers` file (tokenizer.json) with explicit pad and end-of-document tokens."""

  name = "tokenizers"

  def __init__(self, path: str):
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
      raise UserError(f"--tokenizer={path}: no such tokenizer.json file")
    try:
      self._tok = Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library's own parse error, as one line.
      raise UserError(f"--tokenizer={path} is not a Hugging Face tokenizer file: {e}") from None
    self.model = os.path.abspath(path)
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    found = lambda names: next((i for t in names if (i := self._tok.token_to_id(t)) is not None), None)
    self.pad_id, self.eos_id = found(PAD_TOKENS), found(EOS_TOKENS)
    if self.eos_id is None:
      raise UserError(f"--tokenizer={path} has no end-of-document token: add one of {', '.join(EOS_TOKENS)}")
    if self.pad_id is None or self.pad_id == self.eos_id:
      # The trainer masks targets equal to pad_id: a pad shared with eos would hide every document end.
      raise UserError(f"--tokenizer={path} has no padding token apart from eos: add one of {PAD_TOKENS[0]!r}")

  def encode(self, document: bytes, source: str) -> np.ndarray:
    return np.asarray(self._tok.encode(_text(document, source), add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  # As transformers' tokenizer of this file encodes and decodes by default (what lm-eval calls): with
  # the special tokens its post-processor adds (a BOS), and decoding without any special token.
  def encode_text(self, text: str) -> list[int]:
    return list(self._tok.encode(text).ids)

  def decode_text(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def train_bpe(documents, vocab_size: int, path: str) -> None:
  """Trains a byte-level BPE of `vocab_size` ids on the (bytes, source) documents and saves it at
  `path`: id 0 pads, id 1 ends a document, every byte is in the alphabet (nothing is unknown)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  if vocab_size < 258:
    raise UserError(f"--train_tokenizer=bpe:{vocab_size}: needs at least 258 ids (256 bytes, pad, eos)")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=[PAD_TOKENS[0], EOS_TOKENS[0]],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(_texts(documents), trainer)
  tok.save(path)


def _texts(documents):
  """The documents' text; ones that are not UTF-8 are left out, as they are (and counted) when tokenizing."""
  for document, _ in documents:
    try:
      yield document.decode("utf-8")
    except UnicodeDecodeError:
      continue


def for_dataset(metadata: dict, directory: str):
  """The tokenizer a prepared data set was made with, for decoding (SentencePiece: not here)."""
  if metadata["tokenizer"] == "byte":
    return ByteTokenizer()
  if metadata["tokenizer"] == HFTokenizer.name:
    return HFTokenizer(os.path.join(directory, TOKENIZER_FILE))
  raise UserError(f"{directory}: decoding {metadata['tokenizer']!r} tokens is not supported here")


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
    return np.asarray(self._sp.encode(_text(document, source)), np.int32)


def make_tokenizer(spec: str):
  if spec == "byte":
    return ByteTokenizer()
  if spec.endswith(".json"):
    return HFTokenizer(spec)
  if spec.endswith(".model"):
    return SentencePieceTokenizer(spec)
  raise UserError(
    f"--tokenizer={spec!r} is not 'byte', a Hugging Face tokenizer.json or a SentencePiece '.model' file"
  )


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


def _byte_chars() -> list[str]:
  """GPT-2's printable stand-in for each byte (what a byte-level Hugging Face tokenizer stores)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


def byte_tokenizer_json() -> str:
  """The byte tokenizer (id 0 pads, 1 ends a document, byte b is b + 2) as a Hugging Face
  tokenizer.json: a byte-level BPE without merges, so its ids are exactly ByteTokenizer's."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  vocab = {PAD_TOKENS[0]: PAD_ID, EOS_TOKENS[0]: EOS_ID}
  vocab |= {c: b + BYTE_OFFSET for b, c in enumerate(_byte_chars())}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([PAD_TOKENS[0], EOS_TOKENS[0]])
  return tok.to_str()


def write_hf_tokenizer(metadata: dict, directory: str, out: str) -> bool:
  """Writes a prepared data set's tokenizer as the files transformers' AutoTokenizer reads
  (tokenizer.json, tokenizer_config.json) into `out`; False when it has none it can write."""
  from tokenizers import Tokenizer

  if metadata["tokenizer"] == "byte":
    text = byte_tokenizer_json()
  elif metadata["tokenizer"] == HFTokenizer.name:
    with open(os.path.join(directory, TOKENIZER_FILE)) as f:
      text = f.read()
  else:
    return False
  tok = Tokenizer.from_str(text)
  with open(os.path.join(out, TOKENIZER_FILE), "w") as f:
    f.write(text)
  tokenizer_config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": tok.id_to_token(metadata["eos_id"]),
    "pad_token": tok.id_to_token(metadata["pad_id"]),
    "model_max_length": metadata["seq_len"],
    "clean_up_tokenization_spaces": False,
  }
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(tokenizer_config, f, indent=2)
  return True
