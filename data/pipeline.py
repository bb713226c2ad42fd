"""The input pipeline: a deterministic global order, global batch t, and this process's slice of it.

Global batch t holds the same records in the same order whatever the number of processes or
devices (invariant 2): the order is a Grain shuffle keyed by (seed, epoch) over the record indices,
batch t is a fixed window of it, and a process reads only the contiguous rows its devices hold.
An epoch's last, partial batch is padded with zero-weight rows, never dropped or wrapped.
The data position is the step itself: batch t is a pure function of (seed, t).
"""

import dataclasses
import math

import grain
import jax
import numpy as np

PAD = -1  # Record id of a padding row.


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """Which record fills each row of global batch t."""

  num_records: int
  global_batch_size: int
  seed: int
  shuffle: bool = True

  @property
  def batches_per_epoch(self) -> int:
    return math.ceil(self.num_records / self.global_batch_size)

  def _order(self) -> grain.MapDataset:
    # Indexing past the end continues into the next epoch, reshuffled with the epoch in the seed.
    ds = grain.MapDataset.range(self.num_records)
    return ds.shuffle(seed=self.seed) if self.shuffle else ds

  def record_ids(self, t: int) -> np.ndarray:
    """int64[global_batch_size]: record ids of global batch t, PAD for padding rows."""
    epoch, k = divmod(t, self.batches_per_epoch)
    start = k * self.global_batch_size
    stop = min(start + self.global_batch_size, self.num_records)
    order = self._order()
    ids = np.full(self.global_batch_size, PAD, np.int64)
    ids[: stop - start] = [order[epoch * self.num_records + j] for j in range(start, stop)]
    return ids

  def examples_before(self, t: int) -> int:
    """Valid examples in global batches [0, t)."""
    epochs, k = divmod(t, self.batches_per_epoch)
    return epochs * self.num_records + min(k * self.global_batch_size, self.num_records)

  def valid_rows(self, t: int) -> int:
    epoch_pos = (t % self.batches_per_epoch) * self.global_batch_size
    return max(0, min(self.global_batch_size, self.num_records - epoch_pos))


def process_rows(sharding: jax.sharding.Sharding, global_batch_size: int) -> tuple[int, int]:
  """The contiguous rows [lo, hi) of the global batch that this process's devices hold."""
  index_map = sharding.addressable_devices_indices_map((global_batch_size, 1))
  starts = [idx[0].start or 0 for idx in index_map.values()]
  stops = [global_batch_size if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
  lo, hi = min(starts), max(stops)
  covered = np.zeros(global_batch_size, bool)
  for a, b in zip(starts, stops, strict=True):
    covered[a:b] = True
  if not covered[lo:hi].all():
    raise ValueError("this process's batch rows are not contiguous; reorder the mesh devices")
  return lo, hi


class LocalBatches:
  """Callable t -> this process's rows of global batch t: inputs, targets, weights (numpy)."""

  def __init__(self, source, plan: BatchPlan, rows: tuple[int, int], seq_len: int):
    self.source, self.plan, self.rows, self.seq_len = source, plan, rows, seq_len

  def __call__(self, t: int) -> dict[str, np.ndarray]:
    lo, hi = self.rows
    ids = self.plan.record_ids(int(t))[lo:hi]
    seq = self.seq_len
    tokens = np.zeros((hi - lo, seq + 1), np.int32)
    for row, rid in enumerate(ids):
      if rid != PAD:
        tokens[row] = self.source[int(rid)]["tokens"]
    weights = np.broadcast_to((ids != PAD)[:, None], (hi - lo, seq)).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def local_batch_iterator(local_batches: LocalBatches, start: int, stop: int, threads: int, prefetch: int):
  """Yields (t, local batch) for t in [start, stop), prepared ahead by Grain's reader threads."""
  ds = grain.MapDataset.range(start, stop).map(lambda t: (t, local_batches(t)))
  if threads == 0:
    return iter(ds)
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)))


def to_global(local: dict[str, np.ndarray], sharding, global_batch_size: int) -> dict[str, jax.Array]:
  """Assembles the global jax.Array batch from every process's local rows."""
  return {
    k: jax.make_array_from_process_local_data(sharding, v, (global_batch_size,) + v.shape[1:])
    for k, v in local.items()
  }
