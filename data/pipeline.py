"""The input pipeline: a deterministic global order, global batch t, and this process's slice of it.

Global batch t holds the same records in the same order whatever the number of processes or
devices (invariant 2): the order is a Grain shuffle keyed by (seed, epoch) over the record indices,
batch t is a fixed window of it, and a process reads only the contiguous rows its devices hold.
An epoch's last, partial batch is padded with zero-weight rows, never dropped or wrapped.
The data position is the step itself: batch t is a pure function of (seed, t).
"""

import dataclasses
import math
import queue
import threading
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from errors import UserError

# Grain (and the Orbax it imports) is imported only where records are read: --mode=inspect compiles
# from an experiment's example_batch without either.
if TYPE_CHECKING:
  import grain

PAD = -1  # Record id of a padding row.
_ORDER_STREAM = 0x6F72646572  # 'order'


def epoch_seed(seed: int, epoch: int) -> int:
  """A 32-bit shuffle seed for one epoch, hashed from (seed, epoch)."""
  return int(np.random.SeedSequence([seed, _ORDER_STREAM, epoch]).generate_state(1)[0])


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

  def _order(self, epoch: int) -> "grain.MapDataset":
    """The record order of one epoch, shuffled with a seed hashed from (seed, epoch) on a stream of its
    own: epoch e of seed s never repeats another (seed, epoch)'s order, and the order shares no random
    stream with whatever the seed also builds (a synthetic task, the init)."""
    import grain

    ds = grain.MapDataset.range(self.num_records)
    return ds.shuffle(seed=epoch_seed(self.seed, epoch)) if self.shuffle else ds

  def epoch(self, t: int) -> int:
    """The epoch global batch t belongs to."""
    return t // self.batches_per_epoch

  def record_ids(self, t: int) -> np.ndarray:
    """int64[global_batch_size]: record ids of global batch t, PAD for padding rows."""
    epoch, k = divmod(t, self.batches_per_epoch)
    start = k * self.global_batch_size
    stop = min(start + self.global_batch_size, self.num_records)
    order = self._order(epoch)
    ids = np.full(self.global_batch_size, PAD, np.int64)
    ids[: stop - start] = [order[j] for j in range(start, stop)]
    return ids

  def valid(self, t: int) -> np.ndarray:
    """bool[global_batch_size]: which rows of global batch t hold a record (False: padding)."""
    return self.record_ids(t) != PAD

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
    raise UserError(
      "this process's rows of the batch are not contiguous: order the mesh so that each process's "
      "devices are adjacent along the batch axes (mesh.dcn_* for several hosts)"
    )
  return lo, hi


class LocalBatches:
  """Callable t -> this process's rows of global batch t: the records read in one batched read (from
  the source as batch t's epoch reads it, `at_epoch`) and stacked (zeros on padding rows), turned into
  arrays by the experiment's `make_batch`, and checked against the contract (a `weights` array, zero on
  every padding row)."""

  def __init__(self, source, plan: BatchPlan, rows: tuple[int, int], make_batch):
    self.source, self.plan, self.rows, self.make_batch = source, plan, rows, make_batch
    self._blank = None  # Zeros shaped like one record: what a padding row holds.

  def __call__(self, t: int) -> dict[str, np.ndarray]:
    lo, hi = self.rows
    ids = self.plan.record_ids(int(t))[lo:hi]
    valid = ids != PAD
    if self._blank is None:
      self._blank = {k: np.zeros_like(np.asarray(v)) for k, v in read_records(self.source, [0])[0].items()}
    records = {k: np.zeros((hi - lo, *v.shape), v.dtype) for k, v in self._blank.items()}
    if valid.any():
      source = at_epoch(self.source, self.plan.epoch(int(t)))
      for k, rows in _stack(read_records(source, ids[valid])).items():
        records[k][valid] = rows
    return check_batch(self.make_batch(records, valid), valid, int(t))


def _stack(records: list[dict]) -> dict[str, np.ndarray]:
  return {k: np.stack([np.asarray(r[k]) for r in records]) for k in records[0]}


def check_batch(batch, valid: np.ndarray, t: int) -> dict[str, np.ndarray]:
  """The experiment's batch, as the contract says: arrays over the rows, and `weights` that are zero
  on padding rows (else padding would count)."""
  rows = len(valid)
  if not isinstance(batch, dict) or "weights" not in batch:
    keys = f" with keys {sorted(batch)}" if isinstance(batch, dict) else ""
    raise UserError(
      f"make_batch must return a dict of arrays that includes 'weights' (0 on padding rows); "
      f"got {type(batch).__name__}{keys}"
    )
  for k, v in batch.items():
    if not isinstance(v, np.ndarray) or v.ndim == 0 or v.shape[0] != rows:
      shape = getattr(v, "shape", type(v).__name__)
      raise UserError(f"make_batch: batch[{k!r}] must be a numpy array with {rows} rows first; got {shape}")
  if np.any(batch["weights"].reshape(rows, -1)[~valid] != 0):
    raise UserError(
      f"make_batch: global batch {t} has non-zero weights on padding rows (valid=False): they would count"
    )
  return batch


def at_epoch(source, epoch: int):
  """The source as `epoch` reads it: one whose records move on from epoch to epoch (a mixture reads
  each data set on from where the last epoch stopped) offers `at_epoch(epoch)`; any other is the same
  in every epoch."""
  return source.at_epoch(epoch) if hasattr(source, "at_epoch") else source


def read_records(source, indices) -> list:
  """Records at `indices`, in one batched read when the source offers Grain's __getitems__."""
  indices = [int(i) for i in indices]
  if hasattr(source, "__getitems__"):
    return list(source.__getitems__(indices))
  return [source[i] for i in indices]


class _Numbered:
  """t -> (t, local batch t); a class, not a lambda, so Grain worker processes can receive it."""

  def __init__(self, local_batches: LocalBatches):
    self.local_batches = local_batches

  def __call__(self, t):
    return int(t), self.local_batches(int(t))


def local_batch_iterator(
  local_batches: LocalBatches, start: int, stop: int, threads: int, prefetch: int, workers: int = 0
):
  """Yields (t, local batch) for t in [start, stop) in order, prepared ahead by Grain's reader
  threads or worker processes. Order and content never depend on threads or workers."""
  import grain

  ds = grain.MapDataset.range(start, stop).map(_Numbered(local_batches))
  if threads == 0 and workers == 0:
    return iter(ds)
  # Grain runs no more reader threads than its buffer holds batches: at least one batch ahead per thread.
  threads = max(threads, 1)
  it = ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(prefetch, threads)))
  if workers:
    it = it.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=workers))
  return iter(it)


class DevicePrefetch:
  """Iterator of (t, local batch, global jax.Array batch): a background thread assembles the next
  `depth` batches on the devices while the current step runs, so the loop never waits for the
  host-to-device copy (on CPU devices that copy otherwise queues behind the running step)."""

  _END = object()

  def __init__(self, batches, sharding, global_batch_size: int, depth: int = 2):
    self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self.last_starved_s = 0.0  # How long the last __next__ waited for a batch that was not ready.
    self._closed = threading.Event()
    args = (batches, sharding, global_batch_size)
    self._thread = threading.Thread(target=self._fill, args=args, daemon=True, name="device_prefetch")
    self._thread.start()

  def _fill(self, batches, sharding, global_batch_size):
    try:
      for t, local in batches:
        if not self._put((t, local, to_global(local, sharding, global_batch_size))):
          return
      self._put(self._END)
    except BaseException as e:  # Re-raised in the training loop, not lost in this thread.
      self._put(e)

  def _put(self, item) -> bool:
    """Waits for room, unless the loop has closed us (then the thread ends instead of blocking)."""
    while not self._closed.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def __iter__(self):
    return self

  def __next__(self):
    try:
      item = self._queue.get_nowait()
      self.last_starved_s = 0.0
    except queue.Empty:  # The pipeline fell behind: this wait is the input stall.
      t0 = time.perf_counter()
      item = self._queue.get()
      self.last_starved_s = time.perf_counter() - t0
    if item is self._END:
      raise StopIteration
    if isinstance(item, BaseException):
      raise item
    return item

  def close(self) -> None:
    self._closed.set()
    self._thread.join(timeout=5)


def to_global(local: dict[str, np.ndarray], sharding, global_batch_size: int) -> dict[str, jax.Array]:
  """Assembles the global jax.Array batch from every process's local rows."""
  return {
    k: jax.make_array_from_process_local_data(sharding, v, (global_batch_size,) + v.shape[1:])
    for k, v in local.items()
  }


def global_spec(local: dict[str, np.ndarray], sharding, global_batch_size: int) -> dict:
  """ShapeDtypeStructs of the global batch that `local` is this process's part of (for compiling)."""
  return {
    k: jax.ShapeDtypeStruct((global_batch_size,) + v.shape[1:], v.dtype, sharding=sharding)
    for k, v in local.items()
  }
