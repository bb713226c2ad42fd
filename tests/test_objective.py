"""The sharded update optimizes the objective of one device, checked against an independent
reference (tests/reference.py) on many meshes, strategies and microbatch counts: each matches the
reference within 1e-5, so every mesh follows every other's trajectory.

The data set has 100 records and the global batch 16: batch 6 holds 4 valid rows and 12 padding
rows, so on 8-way data parallelism six devices hold only padding. Steps 1..8 cross that batch and
the epoch boundary after it.
"""

import math

import jax
import numpy as np
import pytest

from tests import reference
from tests.conftest import tiny_config
from tests.objective_harness import run_steps

STEPS = 8


def _config(mesh, strategy, microbatches, **kw):
  data, fsdp, tensor = mesh
  return tiny_config(
    steps=STEPS,
    microbatches=microbatches,
    **{
      "data.num_examples": 100,
      "mesh.data": data,
      "mesh.fsdp": fsdp,
      "mesh.tensor": tensor,
      "sharding.strategy": strategy,
      **kw,
    },
  )


def _norm(tree):
  return math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(tree)))


def _ratio(a, b, scale):
  return _norm(jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y, np.float64), a, b)) / scale


def _valid_tokens(comp, t):
  ids = comp.plan.record_ids(t)
  return np.stack([comp.sources.train[int(i)]["tokens"] for i in ids if i >= 0])


# The model's switches ride on combinations that run anyway: grouped-query attention (4 query heads
# sharing 2 key/value heads; multi-query), scanned layers with remat, jax.nn.dot_product_attention,
# a chunked loss, tied embeddings and z-loss. The reference knows none of them but the objective.
_MODEL = {
  ((8, 1, 1), "dp", 1): {"model.num_heads": 4, "model.num_kv_heads": 1},
  ((1, 8, 1), "fsdp", 1): {"model.num_layers": 2, "model.scan_layers": True, "model.remat": "full"},
  ((2, 2, 2), "fsdp_tp", 4): {"model.scan_layers": True, "model.remat": "dots_no_batch"},
  ((4, 1, 2), "fsdp_tp", 2): {
    "model.num_heads": 4,
    "model.num_kv_heads": 2,
    "model.attention": "xla",
    "model.loss_chunk": 4,
    "model.remat": "block_outputs",
  },
  ((2, 2, 2), "dp", 2): {"model.tie_embeddings": True, "model.z_loss": 1e-2, "model.num_kv_heads": 1},
}


# Each strategy, mesh shape and microbatch count at least once (zero1 on (8, 1, 1) with 2 microbatches).
@pytest.mark.parametrize(
  "mesh, strategy, microbatches",
  [
    ((8, 1, 1), "dp", 1),
    ((8, 1, 1), "zero1", 2),
    ((1, 8, 1), "fsdp", 1),
    ((2, 2, 2), "fsdp_tp", 4),
    ((2, 2, 2), "dp", 2),
    ((4, 1, 2), "fsdp_tp", 2),
    ((1, 1, 1), "dp", 4),
  ],
)
def test_sharded_step_matches_independent_reference(mesh, strategy, microbatches):
  config = _config(mesh, strategy, microbatches, **_MODEL.get((mesh, strategy, microbatches), {}))
  devices = jax.devices()[: math.prod(mesh)]
  theta0, metrics, state, comp = run_steps(config, devices, STEPS)
  assert comp.plan.valid_rows(6) == 4  # The padded batch is among the steps.

  params, adamw = theta0, reference.AdamW(theta0, config.optimizer)
  for t in range(STEPS):
    loss, grads = reference.loss_and_grad(params, _valid_tokens(comp, t), config.model.z_loss)
    assert abs(metrics[t]["loss"] - float(loss)) <= 1e-5 * abs(float(loss)), t
    assert _ratio(metrics[t]["grads"], grads, _norm(grads)) <= 1e-3, t
    assert metrics[t]["count"] == comp.plan.valid_rows(t) * config.data.seq_len
    params = adamw.update(params, grads, config.steps)
  moved = _ratio(params, theta0, 1.0)
  assert moved > 0
  assert _ratio(jax.device_get(state.params), params, moved) <= 1e-3
  if (mesh, strategy) == ((8, 1, 1), "dp"):
    _assert_summed_means_would_grow(comp, theta0, config.model.z_loss)


def _assert_summed_means_would_grow(comp, params, z_loss):
  """The failure mode the step avoids, computed with the reference: per-device means summed make the
  gradient grow with the device count. Batch 6 has 4 valid rows: on 8 devices, 2 hold data."""
  ids = comp.plan.record_ids(6).reshape(8, 2)  # [device, rows]
  tokens = lambda rows: np.stack([comp.sources.train[int(i)]["tokens"] for i in rows if i >= 0])
  shard_grads = [
    reference.loss_and_grad(params, tokens(rows), z_loss)[1] for rows in ids if (rows >= 0).any()
  ]
  summed_means = jax.tree.map(lambda *g: sum(g), *shard_grads)
  global_mean = reference.loss_and_grad(params, _valid_tokens(comp, 6), z_loss)[1]
  assert _norm(summed_means) > 1.5 * _norm(global_mean)


def test_bfloat16_compute_matches_one_device_within_its_tolerance():
  cfg = _config((2, 2, 2), "fsdp_tp", 1, **{"model.compute_dtype": "bfloat16"})
  _, sharded, _, _ = run_steps(cfg, jax.devices(), 4)
  _, single, _, _ = run_steps(cfg, jax.devices()[:1], 4)
  for a, b in zip(sharded, single, strict=True):
    assert abs(a["loss"] - b["loss"]) <= 2e-3 * abs(b["loss"])


def test_same_mesh_is_bitwise_reproducible():
  cfg = _config((2, 2, 2), "fsdp_tp", 2)
  _, first, s1, _ = run_steps(cfg, jax.devices(), 3)
  _, second, s2, _ = run_steps(cfg, jax.devices(), 3)
  assert [m["loss"] for m in first] == [m["loss"] for m in second]
  for a, b in zip(
    jax.tree.leaves(jax.device_get(s1.params)), jax.tree.leaves(jax.device_get(s2.params)), strict=True
  ):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("packing,context", [(True, 1), (False, 1), (True, 4)])
def test_packed_padded_documents_match_a_reference_that_runs_each_document_alone(tmp_path, packing, context):
  """Real prepared records: documents of many lengths, each followed by eos, the last record padded.
  The reference sees only the stored tokens, cut into documents (packing) and at the first pad: no
  weights, masks, segment ids or positions. Two steps cover the whole epoch, the second partly padding.
  Packed, the masks go through jax.nn.dot_product_attention and a scanned model; with a context axis,
  the sequence is split over 4 devices, reordered early and late chunks, and attended by a ring."""
  from data import prepare

  rng = np.random.default_rng(0)
  for i in range(40):
    (tmp_path / f"doc{i:02}.txt").write_bytes(bytes(rng.integers(97, 123, rng.integers(2, 20)).tolist()))
  meta = prepare.prepare([str(tmp_path / "doc*.txt")], str(tmp_path / "ds"), seq_len=16, eval_fraction=0)
  train_records = meta["num_records"]["train"]
  assert 16 < train_records < 32 and meta["valid_tokens_in_last_record"]["train"] < 17
  split = {"mesh.context": context, "mesh.fsdp": 1, "mesh.tensor": 1, "model.attention": "flash"}
  config = _config(
    (2, 2, 2),
    "fsdp_tp",
    2,
    **{
      "data.source": "arrayrecord",
      "data.path": str(tmp_path / "ds"),
      "data.packing": packing,
      "model.vocab_size": prepare.BYTE_VOCAB_SIZE,
      "eval_steps": 0,
      **({"model.attention": "xla", "model.scan_layers": True} if packing else {}),
      **(split | {"model.attention_block": 2} if context > 1 else {}),
    },
  )
  theta0, metrics, state, comp = run_steps(config, jax.devices(), 2)
  params, adamw = theta0, reference.AdamW(theta0, config.optimizer)
  eos = meta["eos_id"] if packing else None
  for t in range(2):
    rows = [comp.sources.train[int(i)]["tokens"] for i in comp.plan.record_ids(t) if i >= 0]
    docs = [d for row in rows for d in reference.documents(np.asarray(row), meta["pad_id"], eos)]
    loss, grads, count = reference.document_loss_and_grad(params, docs)
    assert metrics[t]["count"] == count, t
    assert abs(metrics[t]["loss"] - float(loss)) <= 1e-5 * abs(float(loss)), t
    assert _ratio(metrics[t]["grads"], grads, _norm(grads)) <= 1e-3, t
    params = adamw.update(params, grads, config.steps)
  assert _ratio(jax.device_get(state.params), params, _ratio(params, theta0, 1.0)) <= 1e-3
