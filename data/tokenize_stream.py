"""Documents -> one stream of int32 tokens on disk, in input order, each document followed by eos;
tokenized in this process or by worker processes (the same bytes either way), with a progress line.

Empty documents and, for text tokenizers, documents that are not UTF-8 text are skipped and counted,
not fatal: a corpus of millions of files always has a few.
"""

import multiprocessing
import sys
import time

import numpy as np

from data.tokenizers import make_tokenizer
from errors import UserError

BATCH = 256  # Documents per task a worker takes.
PROGRESS_EVERY_S = 2.0
_tokenizer = None  # Each worker's own, built once from the spec.


def _start(spec: str) -> None:
  global _tokenizer
  _tokenizer = make_tokenizer(spec)


def _encode(batch: list[tuple[bytes, str]]) -> tuple[list, int]:
  """(token arrays, None for a document that is not text) and the batch's bytes."""
  out = []
  for document, where in batch:
    try:
      out.append(_tokenizer.encode(document, where))
    except UserError:  # Not UTF-8: the only thing a tokenizer refuses.
      out.append(None)
  return out, sum(len(d) for d, _ in batch)


def _batches(documents, stats: dict):
  """Lists of BATCH non-empty documents; empty ones are counted here."""
  batch = []
  for document in documents:
    if not document[0]:
      stats["empty"] += 1
      continue
    batch.append(document)
    if len(batch) == BATCH:
      yield batch
      batch = []
  if batch:
    yield batch


def tokenize_to_file(
  documents, spec: str, eos_id: int, path: str, total_bytes: int, workers: int = 0
) -> dict:
  """Writes every document's tokens and an eos to `path`; returns counts: documents, tokens, empty,
  not_text (skipped). `spec` makes the tokenizer (data.tokenizers.make_tokenizer) in each worker."""
  stats = {"documents": 0, "tokens": 0, "empty": 0, "not_text": 0}
  eos = np.asarray([eos_id], "<i4").tobytes()
  start = last = time.time()
  done_bytes = 0
  pool = None
  if workers:  # Spawned, not forked: the parent may hold threads (JAX, the tokenizer's own).
    pool = multiprocessing.get_context("spawn").Pool(workers, _start, (spec,))
    results = pool.imap(_encode, _batches(documents, stats))  # In order, whatever finishes first.
  else:
    _start(spec)
    results = map(_encode, _batches(documents, stats))
  try:
    with open(path, "wb") as out:
      for encoded, nbytes in results:
        for tokens in encoded:
          if tokens is None:
            stats["not_text"] += 1
            continue
          out.write(tokens.astype("<i4").tobytes() + eos)
          stats["documents"] += 1
          stats["tokens"] += len(tokens) + 1
        done_bytes += nbytes
        if time.time() - last >= PROGRESS_EVERY_S:
          last = time.time()
          _progress(stats, done_bytes, total_bytes, last - start)
  finally:
    if pool is not None:
      pool.terminate()
  return stats


def _progress(stats: dict, done: int, total: int, elapsed: float) -> None:
  rate = done / elapsed / 1e6
  eta = (total - done) / (done / elapsed) if done else 0.0
  print(
    f"prepare: {stats['documents']:,} documents, {stats['tokens']:,} tokens, {done / 1e6:,.1f} of "
    f"{total / 1e6:,.1f} MB ({rate:.1f} MB/s), eta {eta:.0f}s",
    file=sys.stderr,
    flush=True,
  )
