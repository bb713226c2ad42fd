"""What the docs claim about the compiled train step, read from its post-partitioning HLO (the program
each device runs, as --mode=inspect reads it): a mixture of experts on an expert axis exchanges its
routed rows by all-to-all and gathers none of them (docs/guides/moe.md); ring
attention at context 4 passes key/value chunks by collective-permute, the all-gather strategy gathers
them instead, and the loss never gathers the decoder's states over context; and blockwise attention
compiles no [L, L] array, whole or split over the context devices, at context 1 or 4 under either
strategy (docs/guides/long-context.md, model/context.py).
Each configuration compiles once and is asserted on several times; each claim has a control that
shows its check can fail."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import context as context_lib
from model.transformer import Decoder
from tests.conftest import tiny_config
from trainer.modes.inspect import compile_train_step, report
from trainer.observe.collectives import collectives

# The sequence length. No other dimension of these programs is 256, nor 64 (L / 4) at context 4: embed and
# vocab 32, mlp 48, batch 2 or 8 per device, tiles of 32, rows x tokens 512 per device.
L = 256
_SHAPE = re.compile(r"\b(?:pred|[sufc]\d+|bf16)\[([\d,]*)\]")


def _sequence_by_sequence(hlo: str, context: int) -> list[str]:
  """Every array shape in a device's HLO text with a dimension of L and another of L or, split over
  the context devices, L / context: an [L, L] array whole or sharded, as 'f32[2,2,256,256]'."""
  found = set()
  for m in _SHAPE.finditer(hlo):
    dims = [int(d) for d in m[1].split(",") if d]
    if L in dims:
      dims.remove(L)
      if L in dims or L // context in dims:
        found.add(m[0])
  return sorted(found)


def _compile(attention: str, context: int, strategy: str) -> tuple[str, dict[str, list[dict]]]:
  """(HLO text, {collective kind: its rows of inspect's table}) of the tiny LM's step at L tokens on
  8 devices: data 8 / context, attention in 32 x 32 tiles."""
  config = tiny_config(
    **{"data.seq_len": L, "model.attention": attention, "model.attention_block": 32}
    | {"model.context_attention": strategy, "mesh.context": context, "mesh.data": 8 // context}
    | {"mesh.fsdp": 1, "mesh.tensor": 1, "model.mlp_dim": 48}
  )
  comp, _, compiled = compile_train_step(config)
  hlo = compiled.as_text()
  table: dict[str, list[dict]] = {}
  for row in collectives(hlo, comp.mesh):
    table.setdefault(row["kind"], []).append(row)
  return hlo, table


_attention = functools.cache(_compile)  # One compile per configuration, whichever tests read it.


def test_the_search_finds_plain_attentions_sequence_by_sequence_scores(monkeypatch):
  """The controls: einsum's [B, G, H/G, L, L] scores at context 1 are found, and so are plain
  attention's at context 4, where GSPMD splits them to [B, H, L / 4, L]: an empty search means none."""
  hlo, _ = _attention("einsum", 1, "ring")
  assert f"f32[2,2,1,{L},{L}]" in _sequence_by_sequence(hlo, 1), _sequence_by_sequence(hlo, 1)

  def whole(q, k, v, positions, segment_ids, **_):  # In place of the chunks: [B, H, L, L] scores.
    scores = jnp.einsum("blhk,bmhk->bhlm", q, k, preferred_element_type=jnp.float32)
    causal = positions[:, None, :, None] >= positions[:, None, None, :]
    return jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(jnp.where(causal, scores, -1e30), -1), v)

  monkeypatch.setattr(context_lib, "attention", whole)
  hlo, _ = _compile("flash", 4, "ring")
  assert f"f32[8,2,{L // 4},{L}]" in _sequence_by_sequence(hlo, 4), _sequence_by_sequence(hlo, 4)


@pytest.mark.parametrize("context", [1, 4])
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_blockwise_attention_compiles_no_sequence_by_sequence_array(context, strategy):
  """Flash's tiles, forward and backward (at context 1 the strategy has nothing to pass: the same
  program, from the compilation cache)."""
  hlo, _ = _attention("flash", context, strategy)
  assert not _sequence_by_sequence(hlo, context), _sequence_by_sequence(hlo, context)


def test_ring_attention_at_context_4_passes_chunks_by_collective_permute():
  """ring: key/value chunks travel by collective-permute, each device holding L / 4 tokens of them at a
  time (never the whole sequence); all_gather: no permute, the chunks gathered over context instead."""
  hlo, table = _attention("flash", 4, "ring")
  assert [row["axes"] for row in table.get("collective-permute", [])] == [["context"]], table
  permuted = [line for line in hlo.splitlines() if re.search(r" collective-permute(-start)?\(", line)]
  shapes = [[int(d) for d in m[1].split(",") if d] for line in permuted for m in [_SHAPE.search(line)]]
  assert shapes and all(s[1] == L // 4 for s in shapes), shapes  # [B, L / context, ...]
  _, gathered = _attention("flash", 4, "all_gather")
  assert "collective-permute" not in gathered
  assert any(row["axes"] == ["context"] for row in gathered["all-gather"]), gathered


def test_a_context_axis_never_gathers_the_decoders_states_for_the_loss(monkeypatch):
  """The loss takes its targets in the order the context devices hold the states (model/transformer.py
  hidden_aux_and_order): no all-gather over context in ring's step. The control: the states put back
  in the sequence's order first are gathered whole over context ([B, L, D], dimension 1)."""
  _, table = _attention("flash", 4, "ring")
  assert not [row for row in table.get("all-gather", []) if "context" in row["axes"]], table
  ran_in = Decoder.hidden_aux_and_order

  def in_sequence_order(self, *args):
    h, aux, order = ran_in(self, *args)
    return jnp.take(h, np.argsort(order), axis=1), aux, None

  monkeypatch.setattr(Decoder, "hidden_aux_and_order", in_sequence_order)
  hlo, table = _compile("flash", 4, "ring")
  assert [row for row in table.get("all-gather", []) if row["axes"] == ["context"]], table
  assert re.search(rf"= f32\[\d+,{L},32\]\S* all-gather\(.*dimensions={{1}}", hlo)


def _moe(routing: str) -> dict:
  """inspect's report of the tiny LM with 8 experts, top 2, on configs/moe_smoke_cpu.py's mesh and
  strategy (data 2, fsdp 2, expert 2; fsdp)."""
  return report(
    tiny_config(
      **{"model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.expert_dim": 32}
      | {"model.moe.routing": routing, "sharding.strategy": "fsdp"}
      | {"mesh.data": 2, "mesh.fsdp": 2, "mesh.expert": 2, "mesh.tensor": 1}
    )
  )


def _over_expert(out: dict, kind: str) -> list[dict]:
  return [c for c in out["compiled"]["collectives"] if c["kind"] == kind and "expert" in c["axes"]]


def test_expert_parallel_capacity_routing_exchanges_by_all_to_all_and_gathers_no_routed_rows():
  """capacity: one all-to-all there and one back per layer and pass, moving exactly the routed rows'
  minimum, and no all-gather over the expert axis, which splits the batch and so the routed rows
  (fsdp's all-gathers of weights remain). The control: dropless, which the docs say XLA gathers rather
  than exchanges under an expert axis, shows such all-gathers and no all-to-all."""
  out = _moe("capacity")
  (exchange,) = _over_expert(out, "all-to-all")
  # There and back, forward and backward, in the one layer.
  assert exchange["axes"] == ["expert"] and exchange["count"] == 2 * 2 * 1, exchange
  traffic = out["traffic"]
  assert traffic["all_to_all_bytes_per_device"] == traffic["all_to_all_minimum_bytes_per_device"] > 0
  assert not _over_expert(out, "all-gather"), out["compiled"]["collectives"]
  assert any(c["kind"] == "all-gather" for c in out["compiled"]["collectives"])  # fsdp's, of weights.

  dropless = _moe("dropless")
  assert _over_expert(dropless, "all-gather") and not _over_expert(dropless, "all-to-all")
