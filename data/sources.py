"""What an experiment's data_sources() returns: the generic description of its data."""

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class DataSources:
  """Random-access sources and how their records become a batch.

  A source has `len()` and `[i]` -> a record, a dict of numpy arrays of fixed shapes (and, for speed,
  Grain's batched `__getitems__(indices)`). Records depend only on their index, or, for a source that
  offers `at_epoch(epoch)` -> the source as that epoch reads it, on (epoch, index) (data/mixture.py).
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
  # More held-out sets by name (each data set of a mixture, say), evaluated like `eval`: eval_NAME_loss.
  eval_sets: dict = dataclasses.field(default_factory=dict)


def recipe_fingerprint(kind: str, recipe: list, order: int | None = None) -> str:
  """A fingerprint of generated data from what generates it: 'KIND-' and 16 hex digits of the recipe's
  hash. With `order`, the version of the code's order over those records, 'KIND-orderN-HASH': a change
  of order alone keeps the hash, so a refused resume can say that the order changed (order_change)."""
  version = "" if order is None else f"order{order}-"
  return f"{kind}-{version}" + hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]


_VERSIONED = re.compile(r"(?P<kind>\w+)-(?:order(?P<order>\d+)-)?(?P<hash>[0-9a-f]{16})")


def order_change(old: str, new: str) -> str | None:
  """Why two fingerprints of one kind of data differ when the order over the records changed (one
  without a version is order 1), else None."""
  a, b = _VERSIONED.fullmatch(str(old)), _VERSIONED.fullmatch(str(new))
  if not (a and b and a["kind"] == b["kind"]) or (a["order"] or "1") == (b["order"] or "1"):
    return None
  same = "the same records, " if a["hash"] == b["hash"] else "other records, and "
  return (
    f"{same}the {a['kind']}'s order changed (order version {a['order'] or 1} -> {b['order'] or 1}): "
    "this code reads them in another order, so the run would not go on with its batches"
  )
