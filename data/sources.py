"""What an experiment's data_sources() returns: the generic description of its data."""

import dataclasses
import hashlib
import json
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class DataSources:
  """Random-access sources and how their records become a batch.

  A source has `len()` and `[i]` -> a record, a dict of numpy arrays of fixed shapes (and, for speed,
  Grain's batched `__getitems__(indices)`). Records depend only on their index.
  """

  train: object  # Training records.
  eval: object  # Held-out records, disjoint from train (may be empty when eval_steps is 0).
  # Identifies the records (a hash of their recipe or contents): a checkpoint refuses to resume on data
  # with another fingerprint unless data.allow_changed_data is set.
  fingerprint: str
  # make_batch(records, valid) -> {name: array [rows, ...]}: `records` holds each key of a record
  # stacked over this process's rows (zeros on padding rows), `valid` is bool[rows], False on padding
  # rows. The batch must hold `weights` (float, any rank, first dimension rows) that are 0 on padding
  # rows and wherever an element must not count. A picklable callable (Grain worker processes call it).
  make_batch: Callable[[dict[str, np.ndarray], np.ndarray], dict[str, np.ndarray]]
  loss_floor: float | None = None  # Lowest reachable loss when known (e.g. synthetic data), else None.


def recipe_fingerprint(kind: str, recipe: list) -> str:
  """A fingerprint of generated data from what generates it: 'KIND-' and 16 hex digits."""
  return f"{kind}-" + hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]
