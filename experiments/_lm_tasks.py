"""The LM's task evaluators (trainer/hooks.Evaluator): multiple-choice log-likelihood accuracy and
greedy-generation exact match on local JSON Lines tasks, `data.eval_tasks=PATH,PATH`, each named by
its file's stem, run at every evaluation on every process (the weights stay sharded; jit partitions).

A task's lines are all of one kind:
  multiple choice   {"context": str, "choices": [str, ...], "answer": int}   -> eval_NAME_acc, _acc_norm
  exact match       {"context": str, "target": str}                          -> eval_NAME_exact_match

Scored as lm-eval-harness 0.4.13 scores the same task through our Hugging Face export (in float32;
bfloat16 compute differs from it by bfloat16's rounding)
(tests/test_lm_eval_parity.py runs it) with, in its task YAML, `dataset_path: json`,
`doc_to_text: "{{context}}"`, and either `output_type: multiple_choice`, `doc_to_choice:
"{{choices}}"`, `doc_to_target: "{{answer}}"`, metric acc, or `output_type: generate_until`,
`doc_to_target: "{{target}}"`, `generation_kwargs: {until: ["\\n"], do_sample: false, max_gen_toks:
data.eval_max_new_tokens}`, metric exact_match; and `max_length=data.seq_len` in its model_args:
  - a choice is continuation " CHOICE" (lm-eval's target_delimiter); trailing spaces of the context
    move to the continuation, whose tokens are the whole pair's encoding after as many tokens as the
    context's own encoding has (a merge across the boundary goes as in lm-eval); special tokens as the
    tokenizer's post-processor adds them (a Llama 3 tokenizer.json: a BOS; ours: none) and none in
    decoded text (data/tokenizers.py encode_text, decode_text); an empty context is the
    end-of-document token; context and continuation keep their last seq_len + 1 tokens;
  - the answer is the choice of the highest summed log-likelihood (the first of equals); acc_norm
    divides each by its choice's length in characters;
  - generation is greedy over the whole vocabulary from the context's last seq_len - max_new_tokens
    tokens, ends at the end-of-document token, and is cut at the first newline; exact match compares
    strings as they are.
"""

import json
import os
import re

import numpy as np
from jax.experimental import multihost_utils

from errors import UserError

KINDS = {"multiple_choice": ("context", "choices", "answer"), "exact_match": ("context", "target")}
STOP = "\n"  # Generation ends at the first newline (lm-eval: until ["\n"]).
CHUNK = 32  # Items scored at a time: bounds the activations and caches a task's size would otherwise set,
LOGITS_BYTES = 2**30  # and fewer where their float32 logits [items, length, vocab] would pass this.


def read_task(path: str) -> tuple[str, list[dict]]:
  """(kind, records) of a JSON Lines task, checked: one `error:` line naming the file and line."""
  if not os.path.isfile(path):
    raise UserError(f"data.eval_tasks: no such file {path}")
  records, kinds = [], set()
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
      kind = next(
        (k for k, fields in KINDS.items() if isinstance(record, dict) and set(fields) <= set(record)), None
      )
      if kind is None or not _well_formed(kind, record):
        raise UserError(
          f'{path}:{n}: a task line is {{"context": str, "choices": [str, ...], "answer": index}} '
          f'or {{"context": str, "target": str}}'
        )
      kinds.add(kind)
      records.append(record)
  if not records or len(kinds) > 1:
    raise UserError(
      f"{path}: {'has no lines' if not records else 'mixes multiple-choice and exact-match lines'}"
    )
  return kinds.pop(), records


def _well_formed(kind: str, r: dict) -> bool:
  # A context of spaces alone would encode to nothing once its spaces move (lm-eval refuses it too).
  if not isinstance(r["context"], str) or (r["context"] and not r["context"].strip()):
    return False
  if kind == "exact_match":
    return isinstance(r["target"], str)
  choices = r["choices"]
  ok = isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
  return bool(ok) and isinstance(r["answer"], int) and 0 <= r["answer"] < len(choices)


def encode_pair(encode, context: str, continuation: str, eos_id: int) -> tuple[list[int], list[int]]:
  """(context ids, continuation ids) as lm-eval's causal models encode a pair."""
  if not context:
    return [eos_id], encode(continuation)
  spaces = len(context) - len(context.rstrip())
  if spaces:
    context, continuation = context[:-spaces], context[-spaces:] + continuation
  whole, head = encode(context + continuation), encode(context)
  return head, whole[len(head) :]


def _bucket(n: int) -> int:
  """Lengths padded to a few sizes: one compile serves many items."""
  return max(16, 1 << (n - 1).bit_length())


def _chunks(rows: list[list[int]], fn, vocab: int = 0) -> np.ndarray:
  """fn(tokens int32[n, bucket], lengths int32[n]) on the rows padded on the right, n rows at a time
  (CHUNK, fewer where `vocab`'s float32 logits would pass LOGITS_BYTES; the last chunk filled with
  one-token rows: one program for every chunk), as host arrays on every process."""
  width = _bucket(max(map(len, rows)))
  n = max(1, min(CHUNK, LOGITS_BYTES // (width * vocab * 4))) if vocab else CHUNK
  out = []
  for at in range(0, len(rows), n):
    tokens, lengths = np.zeros((n, width), np.int32), np.ones(n, np.int32)
    for i, r in enumerate(rows[at : at + n]):
      tokens[i, : len(r)], lengths[i] = r, len(r)
    out.append(np.asarray(multihost_utils.process_allgather(fn(tokens, lengths), tiled=True)))
  return np.concatenate(out)[: len(rows)]


def loglikelihoods(
  model, pairs: list[tuple[list[int], list[int]]], max_len: int, vocab: int = 0
) -> np.ndarray:
  """Summed log-likelihood of each continuation after its context, in float64."""
  from model import kv_cache

  rows = [(ctx + cont)[-(max_len + 1) :] for ctx, cont in pairs]
  if too_long := [i for i, (_, cont) in enumerate(pairs) if not 0 < len(cont) <= max_len]:
    raise UserError(
      f"a choice of item {too_long[0]} encodes to {len(pairs[too_long[0]][1])} tokens: each must be 1 to "
      f"data.seq_len={max_len}"
    )
  score = lambda tokens, _: kv_cache.token_logprobs(model, tokens)[0]
  logp = _chunks(rows, score, vocab).astype(np.float64)
  # Token j of a row is predicted at position j - 1; the continuation is the row's last len(cont) tokens.
  ends = [(len(r) - len(c) - 1, len(r) - 1) for r, (_, c) in zip(rows, pairs, strict=True)]
  return np.array([logp[i, lo:hi].sum() for i, (lo, hi) in enumerate(ends)])


def continuations(model, prompts: list[list[int]], new_tokens: int) -> np.ndarray:
  """Greedy continuations [items, new_tokens] of prompts of any lengths."""
  from model import kv_cache

  return _chunks(prompts, lambda tokens, lengths: kv_cache.greedy(model, tokens, lengths, new_tokens))


def score(kind: str, records: list[dict], model, tokenizer, config) -> tuple[dict, list]:
  """({metric: value}, per-item results: the choices' log-likelihoods, or the generated text)."""
  encode = tokenizer.encode_text
  seq_len, eos = config.data.seq_len, tokenizer.eos_id
  if kind == "multiple_choice":
    pairs = [encode_pair(encode, r["context"], " " + c, eos) for r in records for c in r["choices"]]
    flat, items, at = loglikelihoods(model, pairs, seq_len, config.model.vocab_size), [], 0
    for r in records:
      items.append(flat[at : at + len(r["choices"])].tolist())
      at += len(r["choices"])
    # acc_norm: each log-likelihood divided by its choice's length in characters, as lm-eval does.
    norm = [np.array(ll) / [len(c) for c in r["choices"]] for ll, r in zip(items, records, strict=True)]
    acc = [int(np.argmax(ll)) == r["answer"] for ll, r in zip(items, records, strict=True)]
    acc_norm = [int(np.argmax(ll)) == r["answer"] for ll, r in zip(norm, records, strict=True)]
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(acc_norm))}, items
  new = config.data.eval_max_new_tokens
  prompts = [(encode(r["context"]) if r["context"] else [eos])[-(seq_len - new) :] for r in records]
  texts = []
  for row in continuations(model, prompts, new):
    ends = np.flatnonzero(row == eos)
    texts.append(tokenizer.decode_text(row[: ends[0] if ends.size else len(row)]).split(STOP)[0])
  return {
    "exact_match": float(np.mean([t == r["target"] for t, r in zip(texts, records, strict=True)]))
  }, texts


def evaluators(config) -> list:
  """One Evaluator per file of data.eval_tasks, named by its stem."""
  from trainer.hooks import Evaluator

  paths = [p.strip() for p in config.data.eval_tasks.split(",") if p.strip()]
  tokenizer = _tokenizer(config) if paths else None
  made = []
  for path in paths:
    kind, records = read_task(path)

    def fn(ctx, kind=kind, records=records, tokenizer=tokenizer):
      return score(kind, records, ctx.model(), tokenizer, ctx.config)[0]

    made.append(Evaluator(task_name(path), fn))
  return made


def task_name(path: str) -> str:
  return re.sub(r"\W+", "_", os.path.splitext(os.path.basename(path))[0], flags=re.ASCII) or "task"


def _tokenizer(config):
  """The data set's own tokenizer (a mixture's data sets share one)."""
  from data import arrayrecord, mixture, tokenizers

  d = config.data
  if d.source not in ("arrayrecord", "mixture"):
    raise UserError(f"data.eval_tasks needs text data with a tokenizer (data.source={d.source!r} has none)")
  path = d.path if d.source == "arrayrecord" else mixture.parse(d.mixture)[0][0]
  return tokenizers.for_dataset(arrayrecord.load_metadata(path), path)
