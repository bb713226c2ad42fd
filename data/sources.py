"""Builds the train and held-out sources named by `data.source`."""

import dataclasses
import hashlib
import json

from data import synthetic
from trainer.errors import UserError


@dataclasses.dataclass(frozen=True)
class DataSources:
  train: object  # Random-access source: len() and [i] -> {'tokens': int32[seq_len + 1]}.
  eval: object  # Held-out records, disjoint from train.
  loss_floor: float | None  # Lowest reachable loss (nats/token) when known, e.g. synthetic data.
  fingerprint: str  # Identifies the records; a checkpoint refuses to resume on other data.
  pad_id: int | None = None  # Token that fills a record's unused tail: never a target.
  eos_id: int | None = None  # End-of-document token: where packed documents are separated.


def make_sources(config) -> DataSources:
  d = config.data
  if d.source == "synthetic":
    if d.packing:
      raise UserError("data.packing needs documents; the synthetic source has none (use arrayrecord)")
    if d.vocab_size > config.model.vocab_size:
      raise UserError(f"data.vocab_size={d.vocab_size} exceeds model.vocab_size={config.model.vocab_size}")
    chain = synthetic.MarkovChain(d.vocab_size, d.markov_concentration, config.seed)
    make = lambda n, split: synthetic.MarkovSource(chain, n, d.seq_len, config.seed, split)
    recipe = [d.vocab_size, d.markov_concentration, config.seed, d.num_examples, d.seq_len]
    return DataSources(
      train=make(d.num_examples, synthetic.TRAIN),
      eval=make(d.eval_examples, synthetic.EVAL),
      loss_floor=chain.entropy_rate(),
      fingerprint="synthetic-" + hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16],
    )
  if d.source == "arrayrecord":
    from data import arrayrecord

    metadata = arrayrecord.load_metadata(d.path)
    arrayrecord.check_compatible(metadata, d.seq_len, config.model.vocab_size)
    return DataSources(
      train=arrayrecord.ArrayRecordSource(d.path, "train", d.seq_len),
      # An empty held-out split is allowed; components.build refuses it only when eval_steps > 0.
      eval=arrayrecord.ArrayRecordSource(d.path, "eval", d.seq_len)
      if metadata["num_records"]["eval"]
      else (),
      loss_floor=None,
      fingerprint=metadata["fingerprint"],
      pad_id=metadata["pad_id"],
      eos_id=metadata["eos_id"],
    )
  raise UserError(f"data.source={d.source!r}: use 'synthetic' or 'arrayrecord'")
