"""Builds the train and held-out sources named by `data.source`."""

import dataclasses

from data import synthetic
from trainer.errors import UserError


@dataclasses.dataclass(frozen=True)
class DataSources:
  train: object  # Random-access source: len() and [i] -> {'tokens': int32[seq_len + 1]}.
  eval: object  # Held-out records, disjoint from train.
  loss_floor: float | None  # Lowest reachable loss (nats/token) when known, e.g. synthetic data.


def make_sources(config) -> DataSources:
  d = config.data
  if d.source == "synthetic":
    if d.vocab_size > config.model.vocab_size:
      raise UserError(f"data.vocab_size={d.vocab_size} exceeds model.vocab_size={config.model.vocab_size}")
    chain = synthetic.MarkovChain(d.vocab_size, d.markov_concentration, config.seed)
    make = lambda n, split: synthetic.MarkovSource(chain, n, d.seq_len, config.seed, split)
    return DataSources(
      train=make(d.num_examples, synthetic.TRAIN),
      eval=make(d.eval_examples, synthetic.EVAL),
      loss_floor=chain.entropy_rate(),
    )
  raise UserError(f"data.source={d.source!r} is not supported yet; use 'synthetic'")
