"""data.prepare's speed with 1 process and with N workers on a generated corpus, measured in one run.

  .venv/bin/python benchmarks/prepare.py [--mb=200] [--workers=2] [--vocab=4096]

Writes a corpus of about --mb MB (text files of random words drawn from a Zipf law) to a temporary
directory, trains a byte-level BPE of --vocab ids on its first 10 MB, then prepares the whole corpus
with that tokenizer.json with 0 workers and with --workers, and prints MB/s for each, the speed-up,
and whether both outputs have the same fingerprint (they must).
"""

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data import prepare  # noqa: E402


def write_corpus(directory: str, megabytes: int) -> int:
  rng = np.random.default_rng(0)
  letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
  words = ["".join(rng.choice(letters, rng.integers(1, 9))) for _ in range(20_000)]
  p = 1.0 / np.arange(1, len(words) + 1)
  p /= p.sum()
  written, i = 0, 0
  while written < megabytes * 1_000_000:
    text = " ".join(rng.choice(words, 20_000, p=p)).encode()  # About 100 kB per file.
    with open(os.path.join(directory, f"doc{i:05}.txt"), "wb") as f:
      f.write(text)
    written += len(text)
    i += 1
  return written


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mb", type=int, default=200)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--vocab", type=int, default=4096)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    corpus = os.path.join(tmp, "corpus")
    os.makedirs(corpus)
    size = write_corpus(corpus, args.mb)
    sample = sorted(os.listdir(corpus))[: max(1, 10_000_000 // 100_000)]
    t0 = time.time()
    prepare.prepare(
      [os.path.join(corpus, f) for f in sample],
      os.path.join(tmp, "bpe"),
      1024,
      train_tokenizer=f"bpe:{args.vocab}",
    )
    trained_s, files = time.time() - t0, len(os.listdir(corpus))
    print(f"corpus {size / 1e6:.0f} MB in {files} files; BPE trained on 10 MB in {trained_s:.1f} s")
    tokenizer = os.path.join(tmp, "bpe", "tokenizer.json")
    results = {}
    for workers in (0, args.workers):
      t0 = time.time()
      meta = prepare.prepare(
        [corpus], os.path.join(tmp, f"out{workers}"), 1024, tokenizer=tokenizer, workers=workers
      )
      seconds = time.time() - t0
      results[workers] = (size / 1e6 / seconds, meta["fingerprint"])
      print(
        f"workers={workers}: {seconds:.1f} s, {results[workers][0]:.1f} MB/s, {meta['num_tokens']:,} tokens"
      )
  (one, f1), (many, f2) = results[0], results[args.workers]
  cores = os.cpu_count()
  print(
    f"speed-up {many / one:.2f}x with {args.workers} workers on {cores} cores; same fingerprint: {f1 == f2}"
  )


if __name__ == "__main__":
  main()
