"""The input pipeline's contract: topology-independent global batches, every record once per epoch,
masked padding, exact continuation from any data position, packing that never crosses documents."""

import functools
import logging
import os

import jax
import numpy as np
import pytest
from absl import flags

from data import pipeline, prepare
from data.arrayrecord import ArrayRecordSource
from data.pipeline import PAD, BatchPlan, LocalBatches
from data.synthetic import EVAL, TRAIN, MarkovChain, MarkovSource
from experiments import lm

N, B, SEQ = 100, 16, 8  # 7 batches per epoch; batch 6 holds 4 valid rows.


def _lm(pad_id=None, eos_id=None):
  """The LM experiment's records -> inputs/targets/weights (with packing when eos_id is given)."""
  return functools.partial(lm.make_batch, pad_id=pad_id, eos_id=eos_id)


def _synthetic(n=N):
  return MarkovSource(MarkovChain(16, 0.5, seed=3), n, SEQ, seed=3, split=TRAIN)


def _concat(parts):
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _assert_batches_equal(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("processes", [2, 4])
def test_global_batch_is_the_same_for_any_process_count(processes):
  source, plan = _synthetic(), BatchPlan(N, B, seed=7)
  whole = LocalBatches(source, plan, (0, B), _lm())
  per = B // processes
  for t in range(9):  # Across the epoch boundary.
    parts = [LocalBatches(source, plan, (p * per, (p + 1) * per), _lm())(t) for p in range(processes)]
    _assert_batches_equal(_concat(parts), whole(t))


def test_process_rows_of_a_single_process_cover_the_batch():
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
  assert pipeline.process_rows(sharding, B) == (0, B)


def test_every_record_once_per_epoch_and_only_the_missing_rows_padded():
  plan = BatchPlan(N, B, seed=7)
  for epoch in range(2):
    ids = np.concatenate([plan.record_ids(epoch * 7 + k) for k in range(7)])
    assert sorted(ids[ids != PAD]) == list(range(N))
    assert (ids[-12:] == PAD).all() and (ids[:-12] != PAD).all()
  assert not np.array_equal(plan.record_ids(0), plan.record_ids(7))  # Reshuffled per epoch.
  batch = LocalBatches(_synthetic(), plan, (0, B), _lm())(6)
  np.testing.assert_array_equal(batch["weights"].sum(axis=1), [SEQ] * 4 + [0] * 12)
  assert plan.valid_rows(6) == 4 and plan.examples_before(8) == N + B


def test_held_out_records_differ_from_training_records():
  chain = MarkovChain(16, 0.5, seed=3)
  train, held_out = (MarkovSource(chain, 50, 32, 3, split) for split in (TRAIN, EVAL))
  train_rows = {train[i]["tokens"].tobytes() for i in range(50)}
  assert not train_rows & {held_out[i]["tokens"].tobytes() for i in range(50)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A small prepared ArrayRecord data set: documents of varied length, byte tokens."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  for i in range(40):
    words = rng.choice(["alpha", "beta", "gamma", "δέλτα", "end."], size=int(rng.integers(1, 12)))
    (root / f"doc{i:02d}.txt").write_text(" ".join(words))
  prepare.prepare([str(root / "*.txt")], str(root / "out"), seq_len=SEQ, eval_fraction=0.1)
  return str(root / "out")


def _iterate(local, start, stop, threads=0, workers=0):
  it = pipeline.local_batch_iterator(local, start, stop, threads=threads, prefetch=2, workers=workers)
  return list(it)


# Worker processes run make_batch as reader threads do: packed once is enough (each spawn costs ~4 s).
@pytest.mark.parametrize(
  "threads, workers, packed", [(0, 0, False), (2, 0, False), (1, 2, False), (0, 0, True), (2, 0, True)]
)
def test_resuming_at_any_step_yields_the_uninterrupted_batches(corpus, threads, workers, packed):
  """Grain's assert_equal_output_after_checkpoint, for our data position (the step)."""
  if workers:
    flags.FLAGS.mark_as_parsed()  # Grain's worker processes read absl flags.
  source = ArrayRecordSource(corpus, "train", SEQ)
  plan = BatchPlan(len(source), 4, seed=1)
  local = LocalBatches(source, plan, (0, 4), _lm(prepare.PAD_ID, prepare.EOS_ID if packed else None))
  steps = plan.batches_per_epoch + 3  # Crosses an epoch boundary.
  straight = _iterate(local, 0, steps)
  assert [t for t, _ in straight] == list(range(steps))
  for k in range(steps):
    resumed = (
      _iterate(local, k, steps, threads, workers)
      if k in (0, steps // 2, steps - 1)
      else _iterate(local, k, steps)
    )
    assert [t for t, _ in resumed] == list(range(k, steps))
    for (_, a), (_, b) in zip(resumed, straight[k:], strict=True):
      _assert_batches_equal(a, b)


def test_reader_threads_beyond_the_prefetch_all_read(corpus, caplog):
  """Grain runs no more reader threads than its buffer holds batches (and warns): the buffer grows to
  one batch ahead per thread, and the batches stay the same and in order."""
  source = ArrayRecordSource(corpus, "train", SEQ)
  local = LocalBatches(source, BatchPlan(len(source), 4, seed=1), (0, 4), _lm(prepare.PAD_ID))
  with caplog.at_level(logging.WARNING):
    threaded = list(pipeline.local_batch_iterator(local, 0, 6, threads=4, prefetch=2))
  assert not [r for r in caplog.records if "prefetch_buffer_size" in r.getMessage()]
  assert [t for t, _ in threaded] == list(range(6))
  for (_, a), (_, b) in zip(threaded, _iterate(local, 0, 6), strict=True):
    _assert_batches_equal(a, b)


def test_padding_tokens_are_never_targets(corpus):
  source = ArrayRecordSource(corpus, "eval", SEQ)  # Holds the stream's last, padded record.
  plan = BatchPlan(len(source), len(source), seed=0, shuffle=False)
  batch = LocalBatches(source, plan, (0, len(source)), _lm(prepare.PAD_ID))(0)
  assert (batch["targets"] == prepare.PAD_ID).any()
  np.testing.assert_array_equal(batch["weights"] == 0, batch["targets"] == prepare.PAD_ID)


def test_segments_restart_positions_after_each_document_end():
  eos = 1
  inputs = np.array([[5, 6, eos, 7, eos, 8, 9, 9]])
  seg = lm.segments(inputs, eos)
  np.testing.assert_array_equal(seg["segment_ids"], [[1, 1, 1, 2, 2, 3, 3, 3]])
  np.testing.assert_array_equal(seg["positions"], [[0, 1, 2, 0, 1, 0, 1, 2]])


def test_packed_attention_does_not_cross_documents():
  """The logits of a document packed after another equal those of the document alone."""
  from flax import nnx

  from model.transformer import Decoder, DecoderConfig

  with nnx.use_eager_sharding(False):
    shape = dict(vocab_size=16, embed_dim=16, num_layers=2, num_heads=2, mlp_dim=32, rope_base=1e4)
    model = Decoder(DecoderConfig(**shape, compute_dtype="float32"), rngs=nnx.Rngs(0))
  first, second = np.array([3, 4, 5, 1]), np.array([6, 7, 8, 9])
  packed = np.concatenate([first, second])[None]
  seg = lm.segments(packed, eos_id=1)
  together = model(packed, seg["positions"], seg["segment_ids"])
  alone = model(second[None])
  np.testing.assert_allclose(together[0, 4:], alone[0], rtol=1e-5, atol=1e-5)
  unmasked = model(packed)
  assert not np.allclose(unmasked[0, 4:], alone[0], atol=1e-3)  # Without segments it would leak.


def test_data_prepare_output_trains(corpus, tmp_path):
  from tests.conftest import tiny_config
  from trainer.train import train

  cfg = tiny_config(
    steps=3,
    global_batch_size=8,
    **{
      "data.source": "arrayrecord",
      "data.path": corpus,
      "data.seq_len": SEQ,
      "data.packing": True,
      "model.vocab_size": prepare.BYTE_VOCAB_SIZE,
    },
  )
  summary = train(cfg, str(tmp_path))
  assert summary["final_step"] == 3 and np.isfinite(summary["final_loss"]) and summary["loss_floor"] is None
  assert os.path.isdir(tmp_path / "checkpoints" / "3")


def test_device_prefetch_reports_a_stall_only_when_the_batch_was_not_ready():
  import time

  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

  def batches(delay):
    for t in range(3):
      time.sleep(delay)
      yield t, {"x": np.full((8, 2), t, np.float32)}

  slow = pipeline.DevicePrefetch(batches(0.2), sharding, 8, depth=1)
  assert [next(slow)[0] for _ in range(3)] == [0, 1, 2] and slow.last_starved_s > 0.1
  fast = pipeline.DevicePrefetch(batches(0.0), sharding, 8, depth=2)
  time.sleep(0.3)  # Both slots fill while "the step" runs.
  t, _, batch = next(fast)
  assert t == 0 and fast.last_starved_s == 0.0 and batch["x"].sharding == sharding
  fast.close()
  slow.close()
