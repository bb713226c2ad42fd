"""Text -> tokens -> ArrayRecord shards that `data.source='arrayrecord'` trains on.

  python -m data.prepare --input='corpus/*.txt,extra.jsonl' --seq_len=N [--output=DIR]
      [--tokenizer=byte|PATH/tokenizer.json|PATH.model | --train_tokenizer=bpe:VOCAB]
      [--records_per_shard=K] [--eval_fraction=F] [--workers=N] [--jsonl_field=text] [--overwrite]
      [--examples=pairs|chat [--prompt_field=prompt] [--response_field=response]
       [--messages_field=messages] [--chat_template=plain|llama3]]

Output: DIR, or by default `datasets/NAME` at the repository root (git ignores `datasets/`), NAME from
the first input: the directory a glob reads (`corpus/*.txt` -> `datasets/corpus`) or a file's name
without its extension (`more.jsonl` -> `datasets/more`). An output inside the code (data/, model/,
trainer/, ...) is refused: git would list its shards and a fork could commit them.

Inputs: a comma-separated list of files, directories (every file under them) or glob patterns, read in
the order given (each sorted). A `.jsonl` file holds one document per line in its `text` field
(`--jsonl_field`); any other file is one document. Empty documents, and for a text tokenizer documents
that are not UTF-8, are skipped and counted (metadata.json's skipped_documents); no text at all is an
error. `--workers=N` tokenizes in N processes with the same output; long inputs print progress.

Tokens: the byte tokenizer (default) reserves id 0 for padding and id 1 for end-of-document, and maps
byte b to id b + 2 (vocab_size 258), so any bytes round-trip exactly. A path ending in `.json` is a
Hugging Face `tokenizers` file, which must name a padding and an end-of-document token (data/tokenizers.py
lists the names it looks for); `--train_tokenizer=bpe:VOCAB` trains a byte-level BPE of VOCAB ids on the
inputs instead (id 0 pads, id 1 ends a document). Either way the output holds the tokenizer as
`tokenizer.json`, which metadata.json names, so training and any later decoding use the same one. A
path ending in `.model` is a SentencePiece model (install sentencepiece): its own eos and pad ids.

Records: every document is followed by eos, the documents are concatenated, and the stream is cut into
records of exactly seq_len + 1 tokens with stride seq_len + 1 (records never overlap). Only the very
last record can be short: it is padded with pad_id, and metadata.json says how many of its tokens are
real. A record is stored as seq_len + 1 little-endian int32 values, raw bytes: nothing is pickled.

Fine-tuning examples (`--examples=pairs` or `chat`, .jsonl only): prompt/response pairs or chat
message lists, packed whole into records with a uint8 loss weight per token after the tokens, so the
loss counts the responses only (data/prepare_examples.py says how); metadata.json's `loss_weights`
is true. Train on them with data.packing=True.

Splits: the last records form `eval` (eval_fraction of them, at least one when there are two or more),
the rest `train`, so the two never overlap. Shards are `SPLIT-00000-of-0000N.array_record`.
The output is built in a sibling directory and renamed into place, so a crash never leaves a half
written dataset that looks complete.

Here: where the output goes, the steps in order, metadata.json and the command line. Reading the
inputs is data/prepare_inputs.py; splitting and writing the shards, data/prepare_shards.py.
"""

import functools
import glob
import json
import math
import os
import re
import shutil
import sys
import tempfile

import numpy as np

import exit_codes
from data import prepare_examples
from data.prepare_inputs import read_documents, resolve_inputs
from data.prepare_shards import SPLITS, split_sizes, stream_records, valid_in_last, write_shards
from data.tokenize_stream import tokenize_to_file
from data.tokenizers import (
  BYTE_VOCAB_SIZE,
  EOS_ID,
  PAD_ID,
  TOKENIZER_FILE,
  HFTokenizer,
  decode,
  decode_documents,
  make_tokenizer,
  train_bpe,
)
from errors import UserError

# Re-exported (SPLITS from data/prepare_shards.py): the readers of an output and the tests use these names.
__all__ = ["BYTE_VOCAB_SIZE", "EOS_ID", "PAD_ID", "SPLITS", "decode", "decode_documents", "prepare"]

VERSION = 1
METADATA = "metadata.json"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASETS_DIR = os.path.join(REPO_ROOT, "datasets")  # The default outputs' parent; in .gitignore.
# Directories of the repository's code: an output there would sit beside the code in `git status`.
CODE_DIRS = ("benchmarks", "configs", "data", "experiments", "launch", "model", "tests", "trainer")


def default_output(inputs: list[str]) -> str:
  """datasets/NAME at the repository root, NAME from the first input (see the module docstring)."""
  first = next((p.strip() for p in inputs if p.strip()), "")
  parts = os.path.normpath(first).split(os.sep) if first else []
  if glob.has_magic(first):
    fixed = parts[: next(i for i, part in enumerate(parts) if glob.has_magic(part))]
    # `*.txt` or `../*.txt` name no directory themselves: use the one they resolve to.
    name = os.path.basename(os.path.abspath(os.sep.join(fixed) or os.curdir))
  else:
    name = os.path.splitext(parts[-1])[0] if parts else ""
  name = re.sub(r"[^\w.-]+", "_", name).strip("._") or "corpus"
  return os.path.join(DATASETS_DIR, name)


def _check_not_in_code(given: str, output: str) -> None:
  real = os.path.realpath(output)  # `..` and symbolic links cannot hide a code directory.
  for name in CODE_DIRS:
    code = os.path.realpath(os.path.join(REPO_ROOT, name))
    if os.path.commonpath([real, code]) == code:
      suggestion = os.path.relpath(os.path.join(DATASETS_DIR, os.path.basename(real)))
      raise UserError(
        f"--output={given} is inside the code directory {name}/, where git would list the shards and "
        f"a fork could commit them; write it outside the code, e.g. --output={suggestion} "
        "(git ignores datasets/), or leave --output out"
      )


def _check_output(output: str, overwrite: bool) -> None:
  if os.path.exists(output) and not os.path.isdir(output):
    raise UserError(f"--output={output} is a file; give a directory")
  if not os.path.isdir(output) or not os.listdir(output):
    return
  if not overwrite:
    raise UserError(
      f"--output={output} exists and is not empty; pass --overwrite or choose another directory"
    )
  if not os.path.isfile(os.path.join(output, METADATA)):
    # --overwrite replaces the whole directory: only do that to an earlier output of this tool.
    raise UserError(
      f"--output={output} has no {METADATA}, so it is not a data.prepare output; choose another"
    )


def prepare(
  inputs: list[str],
  output: str | None,
  seq_len: int,
  tokenizer: str = "byte",
  records_per_shard: int = 16_384,
  eval_fraction: float = 0.01,
  overwrite: bool = False,
  train_tokenizer: str = "",
  workers: int = 0,
  jsonl_field: str = "text",
  examples: str = "",
  fields: dict | None = None,
  chat_template: str = "",
) -> dict:
  """Tokenizes the input files into ArrayRecord shards under `output`; returns the metadata written.
  `workers` > 0 tokenizes in that many processes, with the same output as 0 (this process).

  `output` None (or empty) means `default_output(inputs)`, datasets/NAME at the repository root.
  """
  if seq_len < 1:
    raise UserError(f"--seq_len must be >= 1 (got {seq_len})")
  if records_per_shard < 1:
    raise UserError(f"--records_per_shard must be >= 1 (got {records_per_shard})")
  if workers < 0:
    raise UserError(f"--workers must be >= 0 (got {workers}; 0 tokenizes in this process)")
  if not 0 <= eval_fraction < 1:
    raise UserError(f"--eval_fraction must be in [0, 1) (got {eval_fraction})")
  if examples and examples not in prepare_examples.EXAMPLES:
    raise UserError(f"--examples={examples}: use {' or '.join(prepare_examples.EXAMPLES)} (or leave it out)")
  if chat_template and chat_template not in prepare_examples.TEMPLATES:
    raise UserError(f"--chat_template={chat_template}: use one of {', '.join(prepare_examples.TEMPLATES)}")
  if examples and workers:
    raise UserError("--workers tokenizes documents; --examples are tokenized in this process: drop --workers")
  if chat_template and not examples:
    raise UserError("--chat_template renders --examples=pairs or chat; give --examples too")
  fields = {"prompt": "prompt", "response": "response", "messages": "messages"} | (fields or {})
  given = output or default_output(inputs)
  output = os.path.abspath(given)
  _check_not_in_code(given, output)
  _check_output(output, overwrite)
  files = resolve_inputs(inputs)
  if train_tokenizer and tokenizer != "byte":
    raise UserError("give --tokenizer=FILE or --train_tokenizer=bpe:VOCAB, not both")
  bpe_vocab = _bpe_vocab(train_tokenizer) if train_tokenizer else None
  tok = None if train_tokenizer else make_tokenizer(tokenizer)

  parent = os.path.dirname(output)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.partial-", dir=parent)
  os.chmod(staging, 0o755)  # mkdtemp makes it private; the renamed output is read by other jobs' users.
  try:
    read = functools.partial(_read, files, jsonl_field, examples, fields, chat_template)
    if bpe_vocab:  # Trained on the inputs, then used as if given.
      train_bpe(read(text=True), bpe_vocab, os.path.join(staging, TOKENIZER_FILE))
      tok = HFTokenizer(os.path.join(staging, TOKENIZER_FILE))
    elif tok.name == HFTokenizer.name:
      shutil.copyfile(tok.model, os.path.join(staging, TOKENIZER_FILE))
    record_len = seq_len + 1
    raw = os.path.join(staging, "tokens.tmp")  # On disk: corpora larger than memory work.
    weights_raw = os.path.join(staging, "weights.tmp")  # Examples' loss weights, beside their tokens.
    if examples:
      stats = prepare_examples.pack(read(), tok, record_len, raw, weights_raw)
      stats.update(empty=0, not_text=0)
      num_records = stats["records"]
    else:
      total_bytes = sum(os.path.getsize(f) for f in files)
      stats = tokenize_to_file(read(), tok.model or "byte", tok.eos_id, raw, total_bytes, workers)
      num_records = math.ceil(stats["tokens"] / record_len)
    num_docs, num_tokens = stats["documents"], stats["tokens"]
    if not num_docs and examples and stats["too_long"]:
      raise UserError(
        f"none of the {stats['too_long']} examples fits a record of --seq_len + 1 = {record_len} tokens; "
        "raise --seq_len"
      )
    if not num_docs:
      raise UserError(
        f"the inputs contain no text ({stats['empty']} empty and {stats['not_text']} non-UTF-8 "
        "documents skipped); check --input"
      )
    sizes = split_sizes(num_records, eval_fraction)
    if examples:
      tokens = np.memmap(raw, "<i4", mode="r", shape=(num_records, record_len))
      weights = np.memmap(weights_raw, np.uint8, mode="r", shape=(num_records, record_len))
      record = lambda i: tokens[i].tobytes() + weights[i].tobytes()
      last_valid = int(np.sum(tokens[-1] != tok.pad_id))
    else:
      tokens = np.memmap(raw, "<i4", mode="r", shape=(num_tokens,))
      record = stream_records(tokens, tok.pad_id, record_len)
      last_valid = num_tokens - (num_records - 1) * record_len  # Real tokens in the stream's last record.
    shards, fingerprint = write_shards(record, sizes, records_per_shard, staging)
    for tmp in (raw, weights_raw):
      if os.path.exists(tmp):
        os.remove(tmp)
    skipped = {"empty": stats["empty"], "not_text": stats["not_text"]}
    if examples:
      skipped["too_long"] = stats["too_long"]
    metadata = {
      "version": VERSION,
      "seq_len": seq_len,
      "record_format": "seq_len + 1 little-endian int32 tokens per record"
      + (", then seq_len + 1 uint8 loss weights (1: the token is a target that counts)" if examples else ""),
      # Per-token loss weights (prompt/response examples): the loss counts only weighted targets.
      "loss_weights": bool(examples),
      "examples": examples or "documents",
      "vocab_size": tok.vocab_size,
      "tokenizer": tok.name,
      # The data set's own copy (relative: the directory may move), or a SentencePiece model's path.
      "tokenizer_model": TOKENIZER_FILE if tok.name == HFTokenizer.name else tok.model,
      "pad_id": tok.pad_id,
      "eos_id": tok.eos_id,
      "inputs": [os.path.abspath(f) for f in files],
      "num_documents": num_docs,
      "skipped_documents": skipped,
      "num_tokens": num_tokens,
      "num_records": sizes,
      "valid_tokens_in_last_record": valid_in_last(sizes, record_len, last_valid),
      "shards": shards,
      "fingerprint": fingerprint,
    }
    with open(os.path.join(staging, METADATA), "w") as f:
      json.dump(metadata, f, indent=2)
      f.write("\n")
    if os.path.isdir(output):
      shutil.rmtree(output)  # Empty, or an earlier output with --overwrite (checked above).
    os.replace(staging, output)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return metadata


def _read(files, jsonl_field, examples, fields, chat_template, text: bool = False):
  """The inputs' documents as (bytes, where), or with `examples` their examples as (pieces, where);
  `text`: either as (bytes, where) of their whole text, for training a tokenizer."""
  for name in files:
    if not examples:
      yield from read_documents(name, jsonl_field)
      continue
    for parts, where in prepare_examples.read_examples(name, examples, fields, chat_template):
      yield ("".join(t for t, _ in parts).encode("utf-8"), where) if text else (parts, where)


def _bpe_vocab(spec: str) -> int:
  kind, _, size = spec.partition(":")
  if kind != "bpe" or not size.isdigit():
    raise UserError(f"--train_tokenizer={spec!r}: use bpe:VOCAB, e.g. bpe:32768")
  return int(size)


def _define_flags():
  # Defined only when run as a program, so importing this module adds nothing to main.py's flags.
  from absl import flags

  flags.DEFINE_string("input", None, "Comma-separated files or globs; .jsonl uses each line's 'text'.")
  flags.DEFINE_string(
    "output", None, "Directory to write the shards and metadata.json to (default: datasets/NAME)."
  )
  flags.DEFINE_integer("seq_len", None, "Tokens the model sees per example; records hold seq_len + 1.")
  flags.DEFINE_string(
    "tokenizer", "byte", "'byte', a Hugging Face tokenizer.json, or a SentencePiece .model."
  )
  flags.DEFINE_string("train_tokenizer", "", "bpe:VOCAB: train a byte-level BPE on the inputs and use it.")
  flags.DEFINE_integer("records_per_shard", 16_384, "Records per ArrayRecord shard.")
  flags.DEFINE_float("eval_fraction", 0.01, "Fraction of records (the last ones) held out as 'eval'.")
  flags.DEFINE_bool("overwrite", False, "Replace an existing output of this tool.")
  flags.DEFINE_integer("workers", 0, "Tokenize in N worker processes (0: this one); the output is the same.")
  flags.DEFINE_string("jsonl_field", "text", "The field of each .jsonl line that holds its document.")
  flags.DEFINE_string("examples", "", "pairs | chat: .jsonl prompt/response examples, responses weighted.")
  flags.DEFINE_string("prompt_field", "prompt", "--examples=pairs: the field of the prompt.")
  flags.DEFINE_string("response_field", "response", "--examples=pairs: the field of the response.")
  flags.DEFINE_string("messages_field", "messages", "--examples=chat: the field of the message list.")
  flags.DEFINE_string("chat_template", "", "plain | llama3: how messages become text (chat: plain).")


def _fail(message: str):
  print("error: " + " ".join(str(message).split()), file=sys.stderr)
  sys.exit(exit_codes.USER_EXIT)


def _parse_flags(argv):
  from absl import flags

  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(e)


def main(argv):
  from absl import flags

  f = flags.FLAGS
  if len(argv) > 1:
    _fail(f"unexpected arguments {argv[1:]}; every option is a --flag=value")
  try:
    if not f.input:
      raise UserError("--input is required: comma-separated text or .jsonl files or globs")
    if f.seq_len is None:
      raise UserError("--seq_len is required: the tokens per example the model will see")
    inputs = f.input.split(",")
    output = f.output or default_output(inputs)
    metadata = prepare(
      inputs,
      output,
      f.seq_len,
      tokenizer=f.tokenizer,
      records_per_shard=f.records_per_shard,
      eval_fraction=f.eval_fraction,
      overwrite=f.overwrite,
      train_tokenizer=f.train_tokenizer,
      workers=f.workers,
      jsonl_field=f.jsonl_field,
      examples=f.examples,
      fields={"prompt": f.prompt_field, "response": f.response_field, "messages": f.messages_field},
      chat_template=f.chat_template,
    )
  except UserError as e:
    _fail(e)
  except OSError as e:
    _fail(f"{e.strerror or e}: {e.filename}" if e.filename else e)
  n = metadata["num_records"]
  what = "examples" if metadata["loss_weights"] else "documents"
  print(
    f"wrote {n['train']} train and {n['eval']} eval records of {metadata['seq_len'] + 1} tokens "
    f"({metadata['num_documents']} {what}, {metadata['num_tokens']} tokens, "
    f"{sum(metadata['skipped_documents'].values())} skipped as empty, not text or too long, "
    f"vocab {metadata['vocab_size']}) "
    f"to {os.path.abspath(output)}"
  )


if __name__ == "__main__":
  from absl import app

  _define_flags()
  app.run(main, flags_parser=_parse_flags)
