"""Fine-tuning on prompt/response examples (data.prepare --examples=pairs|chat): only the responses
carry loss weight; a prompt's targets change neither the loss nor the gradient; the sharded step
matches a reference that runs each example alone and weighs only its response; verify passes; and
training lowers the response loss."""

import json

import jax
import numpy as np
import pytest

from data import prepare
from data.arrayrecord import ArrayRecordSource
from data.tokenizers import ByteTokenizer
from tests import reference
from tests.conftest import tiny_config
from tests.objective_harness import run_steps
from trainer import components
from trainer.state import split


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  """Additions, prompt 'What is a plus b? ' and response 'a+b.': a task the tiny LM learns in steps."""
  root = tmp_path_factory.mktemp("pairs")
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(400):
    a, b = (int(x) for x in rng.integers(0, 50, 2))
    rows.append({"prompt": f"What is {a} plus {b}? ", "response": f"{a + b}."})
  rows.append({"prompt": "x" * 80, "response": "too long for a record"})
  (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  meta = prepare.prepare([str(root / "pairs.jsonl")], str(root / "ds"), seq_len=48, examples="pairs")
  return str(root / "ds"), meta, rows


def _config(path, **kw):
  return tiny_config(
    **{
      "data.source": "arrayrecord",
      "data.path": path,
      "data.seq_len": 48,
      "data.packing": True,
      "model.vocab_size": prepare.BYTE_VOCAB_SIZE,
      "eval_steps": 0,
      **kw,
    }
  )


def test_prepared_examples_weigh_only_responses_and_stay_whole(pairs, tmp_path):
  path, meta, rows = pairs
  assert meta["loss_weights"] and meta["skipped_documents"]["too_long"] == 1
  assert meta["num_documents"] == len(rows) - 1
  tok, seen = ByteTokenizer(), 0
  for split_name in ("train", "eval"):
    source = ArrayRecordSource(path, split_name, 48)
    for i in range(len(source)):
      record = source[i]
      for tokens, weights in reference.weighted_documents(record["tokens"], record["loss_weights"], 0, 1):
        text, weighted = tok.decode(tokens[:-1]), tok.decode(tokens[weights > 0][:-1])
        prompt = text[: len(text) - len(weighted)]
        assert {"prompt": prompt, "response": weighted} in rows  # Whole; only the response counts.
        assert tokens[-1] == meta["eos_id"] and weights[-1] == 1  # Its end is learned too.
        seen += 1
  assert seen == meta["num_documents"]

  # Chat messages with Llama 3's template: the assistant's content and its end-of-turn count.
  chat = tmp_path / "chat.jsonl"
  messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi"},
    {"role": "assistant", "content": "hi"},
  ]
  chat.write_text(json.dumps({"messages": messages}) + "\n")
  prepare.prepare([str(chat)], str(tmp_path / "c"), seq_len=256, examples="chat", chat_template="llama3")
  record = ArrayRecordSource(str(tmp_path / "c"), "train", 256)[0]
  assert tok.decode(record["tokens"][record["loss_weights"] > 0][:-1]) == "hi<|eot_id|>"
  assert tok.decode(record["tokens"]).startswith("<|begin_of_text|><|start_header_id|>system")

  # The same text split elsewhere between prompt and response: other weights, another fingerprint.
  moved = tmp_path / "moved.jsonl"
  shifted = [{"prompt": r["prompt"] + r["response"][0], "response": r["response"][1:]} for r in rows]
  moved.write_text("".join(json.dumps(r) + "\n" for r in shifted))
  other = prepare.prepare([str(moved)], str(tmp_path / "m"), seq_len=48, examples="pairs")
  assert other["fingerprint"] != meta["fingerprint"] and other["num_tokens"] == meta["num_tokens"]


def _loss_and_grads(comp, params, variables, batch):
  def loss(p):
    total, count, _ = comp.loss_sums(comp.mdef.merge(p, variables), batch, None)
    return total / count

  return jax.value_and_grad(loss)(params)


def test_a_prompt_target_changes_neither_loss_nor_gradient(pairs):
  path, meta, _ = pairs
  config = _config(path)
  comp = components.build(config)
  batch = components.local_batches(comp)(0)
  record = comp.sources.train[int(comp.plan.record_ids(0)[0])]
  params, variables = split(comp.mdef.merge(*jax.device_get(_init(comp, config))))
  base = _loss_and_grads(comp, params, variables, batch)
  prompt = np.flatnonzero((batch["weights"][0] == 0) & (batch["targets"][0] != meta["pad_id"]))[3]
  response = np.flatnonzero(batch["weights"][0] > 0)[0]
  assert record["loss_weights"][1 + prompt] == 0 and record["loss_weights"][1 + response] == 1
  for position, same in ((prompt, True), (response, False)):
    changed = {**batch, "targets": batch["targets"].copy()}
    changed["targets"][0, position] = (changed["targets"][0, position] + 7) % 200 + 2
    loss, grads = _loss_and_grads(comp, params, variables, changed)
    assert (float(loss) == float(base[0])) == same
    if same:
      for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def _init(comp, config):
  state = components.fresh_state(comp, config)
  return state.params, state.variables


def test_fine_tuning_matches_the_reference_lowers_the_response_loss_and_verifies(pairs, tmp_path):
  """(2,2,2) with 2 microbatches against a reference that runs each example alone and weighs only
  its response; 30 steps then lower that loss; verify passes on the data."""
  from trainer.modes.verify import verify

  path, meta, _ = pairs
  config = _config(path, steps=30, **{"optimizer.warmup_steps": 3, "microbatches": 2})
  theta0, metrics, _, comp = run_steps(config, jax.devices(), 30)
  params, adamw = theta0, reference.AdamW(theta0, config.optimizer)
  for t in range(2):
    records = [comp.sources.train[int(i)] for i in comp.plan.record_ids(t) if i >= 0]
    docs = [d for r in records for d in reference.weighted_documents(r["tokens"], r["loss_weights"], 0, 1)]
    loss, grads, count = reference.weighted_document_loss_and_grad(params, docs)
    assert metrics[t]["count"] == count, t
    assert abs(metrics[t]["loss"] - float(loss)) <= 1e-5 * abs(float(loss)), t
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
    np.testing.assert_allclose(flat(metrics[t]["grads"]), flat(grads), rtol=2e-3, atol=1e-6)
    params = adamw.update(params, grads, config.steps)
  first, last = metrics[0]["loss"], np.mean([m["loss"] for m in metrics[-3:]])
  assert last < 0.7 * first, (first, last)
  assert verify(_config(path), str(tmp_path / "verify"), steps=2)
