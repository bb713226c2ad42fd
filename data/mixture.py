"""A weighted mixture of random-access sources as one random-access source (`data.source='mixture'`).

Record i of mixture epoch e is a pure function of (e, i): the index space is cut into blocks of BLOCK
records, and every block holds each source's quota (its weight times BLOCK, rounded by largest
remainder) in one fixed layout that spreads each source evenly over the block (any stretch of it holds
the sources in about their shares). Each source is read through in order across epochs: epoch e goes
on where epoch e - 1 stopped, and a source starts again only once all its records are used. So a
source weighted below its size (not read through within a mixture epoch, which is as long as all
sources together) gets to all its records in later epochs, and one weighted above its size repeats
its records evenly (their read counts differ by at most 1). The mixture is deterministic and
independent of topology like any source, resumes exactly (the data position is the step, and the
trainer hands the epoch to `at_epoch`), and the trainer's seeded shuffle of its indices mixes the
sources within every batch.

Each record carries `source`, the index of the source it came from, so the experiment can report
each source's share of a batch (the LM: `share_NAME` in the metrics).
"""

import copy
import os
import re

import numpy as np

from errors import UserError

BLOCK = 1024
# The version of the order above, in the mixture's fingerprint: a run saved under another order is
# refused on resume, naming the change. 1: every epoch read the same records of each source; 2: each
# source's position carries on from one epoch to the next.
ORDER = 2


def parse(spec: str) -> list[tuple[str, float]]:
  """'PATH:WEIGHT,PATH:WEIGHT' -> [(path, weight)], weights normalized to sum to 1."""
  out = []
  for item in filter(None, (s.strip() for s in spec.split(","))):
    path, sep, weight = item.rpartition(":")
    try:
      value = float(weight) if sep else -1.0
    except ValueError:
      value = -1.0
    if not path or not value > 0:
      raise UserError(f"data.mixture item {item!r}: use PATH:WEIGHT with a weight > 0")
    out.append((path, value))
  if len(out) < 2:
    raise UserError(f"data.mixture={spec!r}: name at least two PATH:WEIGHT data sets, comma-separated")
  total = sum(w for _, w in out)
  return [(p, w / total) for p, w in out]


def names(spec: str) -> list[str]:
  """Each source's name in the metrics: its directory's name (made unique by its position)."""
  found = [re.sub(r"\W+", "_", os.path.basename(os.path.normpath(p))) or "data" for p, _ in parse(spec)]
  return [n if found.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(found)]


def quotas(weights: list[float], block: int = BLOCK) -> list[int]:
  """Records of each source per block: weight x block, rounded by largest remainder, at least 1."""
  exact = [w * block for w in weights]
  counts = [max(1, int(x)) for x in exact]
  order = sorted(range(len(weights)), key=lambda k: (counts[k] - exact[k], k))
  k = 0
  while sum(counts) < block:
    counts[order[k % len(order)]] += 1
    k += 1
  while sum(counts) > block:  # Only where "at least 1" rounded up: never below one record.
    largest = max((j for j in range(len(counts)) if counts[j] > 1), key=lambda j: (counts[j] - exact[j], j))
    counts[largest] -= 1
  return counts


def layout(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """(source, its rank among that source's records) of each position of a block: each position goes
  to the source furthest behind its share so far, so every source is spread evenly."""
  block, taken = sum(counts), [0] * len(counts)
  source_at, rank_at = np.empty(block, np.int32), np.empty(block, np.int64)
  for p in range(block):
    k = max(range(len(counts)), key=lambda j: (counts[j] * (p + 1) / block - taken[j], -j))
    source_at[p], rank_at[p] = k, taken[k]
    taken[k] += 1
  assert taken == counts, (taken, counts)  # The largest deficit never runs a source past its quota.
  return source_at, rank_at


class MixtureSource:
  """Random access over `sources` by `weights`; record i is the source's record plus `source`."""

  def __init__(self, sources: list, weights: list[float], with_loss_weights: bool = False, ids=None):
    """`ids`: what each source's records carry as `source` (default 0, 1, ...): a split that lacks
    some data sets still names the others as the whole mixture does. Weights are normalized."""
    self.sources, self.ids = sources, list(ids if ids is not None else range(len(sources)))
    self.counts = quotas([w / sum(weights) for w in weights])
    self.source_at, self.rank_at = layout(self.counts)
    self.length = sum(len(s) for s in sources)
    # Records each source gives one mixture epoch: its position moves on by this much per epoch.
    whole, rest = divmod(self.length, BLOCK)
    self.per_epoch = [whole * c + int(np.sum(self.source_at[:rest] == k)) for k, c in enumerate(self.counts)]
    self.epoch = 0
    # Some sources weigh their tokens (prompt/response examples): the others' every token counts.
    self.with_loss_weights = with_loss_weights

  def __len__(self) -> int:
    return self.length

  def at_epoch(self, epoch: int) -> "MixtureSource":
    """This mixture as mixture epoch `epoch` reads it (the pipeline asks for each batch's epoch); a
    shallow copy sharing the sources and layout."""
    view = copy.copy(self)
    view.epoch = int(epoch)
    return view

  def locate(self, index: int) -> tuple[int, int]:
    """(source, record of that source) of mixture record `index` in this view's epoch: the source's
    records taken before (in earlier epochs and earlier blocks, then earlier in this block), cycled."""
    block, at = divmod(int(index), BLOCK)
    k = int(self.source_at[at])
    taken = self.epoch * self.per_epoch[k] + block * self.counts[k] + int(self.rank_at[at])
    return k, taken % len(self.sources[k])

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if not 0 <= int(index) < self.length:
      raise IndexError(index)
    k, j = self.locate(index)
    record = dict(self.sources[k][j])
    if self.with_loss_weights and "loss_weights" not in record:
      record["loss_weights"] = np.ones(record["tokens"].shape, np.uint8)
    record["source"] = np.int32(self.ids[k])
    return record

  def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
    return [self[i] for i in indices]

  def passes(self) -> list[float]:
    """How many times each source is read through in one mixture epoch."""
    return [n / len(s) for n, s in zip(self.per_epoch, self.sources, strict=True)]
