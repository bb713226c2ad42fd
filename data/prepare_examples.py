"""Prompt/response examples for fine-tuning (`data.prepare --examples=pairs|chat`): each becomes tokens
with a loss weight per token, 1 where the token is a target that counts (the response, and the eos
that ends it) and 0 elsewhere (the prompt, the template's role headers), so the loss counts response
tokens only.

  pairs  a .jsonl line {"prompt": ..., "response": ...} (--prompt_field, --response_field); with a
         --chat_template, rendered as a user turn and an assistant turn.
  chat   a .jsonl line {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
         (--messages_field), rendered with --chat_template (default 'plain'); every assistant
         message's content and end-of-turn text count.

Each piece is tokenized on its own and the pieces concatenated (a BPE never merges across a prompt
and its response). Examples are packed whole into records of seq_len + 1 tokens in input order, each
ending in eos, the rest of a record padded with weight 0: an example never spans two records, and
with data.packing each attends only to itself. An example longer than a record is skipped and
counted (metadata.json's skipped_documents.too_long).
"""

import numpy as np

from data.prepare_inputs import jsonl_rows
from errors import UserError

EXAMPLES = ("pairs", "chat")
# A template gives each role the text before and after its content, and "" what begins an example.
# 'llama3' is Llama 3's chat format (its markers are special tokens of its tokenizer.json).
TEMPLATES = {
  "plain": {
    "": ("", ""),
    "system": ("System: ", "\n\n"),
    "user": ("User: ", "\n"),
    "assistant": ("Assistant: ", "\n"),
  },
  "llama3": {
    "": ("<|begin_of_text|>", ""),
    **{
      role: (f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")
      for role in ("system", "user", "assistant")
    },
  },
}


def pieces(row: dict, where: str, kind: str, fields: dict, template: str) -> list[tuple[str, int]]:
  """(text, weight) pieces of one example."""
  if kind == "pairs":
    texts = [row.get(fields["prompt"]), row.get(fields["response"])]
    if not all(isinstance(t, str) for t in texts):
      raise UserError(
        f"{where} needs string {fields['prompt']!r} and {fields['response']!r} fields "
        "(--prompt_field, --response_field name others)"
      )
    if not template:
      return [(texts[0], 0), (texts[1], 1)]
    messages = [{"role": "user", "content": texts[0]}, {"role": "assistant", "content": texts[1]}]
  else:
    messages = row.get(fields["messages"])
    if not isinstance(messages, list) or not messages:
      raise UserError(f"{where} has no list of messages in {fields['messages']!r} (--messages_field)")
  roles = TEMPLATES[template or "plain"]
  out = [(roles[""][0], 0)]
  for m in messages:
    role = m.get("role") if isinstance(m, dict) else None
    if not role or role not in roles or not isinstance(m.get("content"), str):
      names = sorted(r for r in roles if r)
      raise UserError(f"{where}: a message must be {{'role': one of {names}, 'content': text}}")
    before, after = roles[m["role"]]
    counts = int(m["role"] == "assistant")
    out += [(before, 0), (m["content"], counts), (after, counts)]
  if not any(w for text, w in out if text):
    raise UserError(f"{where} has no assistant message: nothing of it would count in the loss")
  return out


def read_examples(path: str, kind: str, fields: dict, template: str):
  """Yields (pieces, where) of each line of a .jsonl file."""
  if not path.endswith(".jsonl"):
    raise UserError(f"--examples={kind} reads .jsonl files; {path} is not one")
  for row, where in jsonl_rows(path):
    yield pieces(row, where, kind, fields, template), where


def encode(tok, parts: list[tuple[str, int]], where: str) -> tuple[np.ndarray, np.ndarray]:
  """Tokens and their weights of one example, ending in eos (weight 1: the model learns to stop)."""
  ids, weights = [], []
  for text, weight in parts:
    if text:
      piece = tok.encode(text.encode("utf-8"), where)
      ids.append(piece)
      weights.append(np.full(len(piece), weight, np.uint8))
  ids.append(np.asarray([tok.eos_id], np.int32))
  weights.append(np.ones(1, np.uint8))
  return np.concatenate(ids).astype(np.int32), np.concatenate(weights)


def pack(examples, tok, record_len: int, tokens_path: str, weights_path: str) -> dict:
  """Packs encoded examples whole into records (in order) written to two raw files, int32 tokens and
  uint8 weights; returns counts: records, documents, tokens, too_long."""
  stats = {"records": 0, "documents": 0, "tokens": 0, "too_long": 0}
  row_t, row_w, used = np.full(record_len, tok.pad_id, "<i4"), np.zeros(record_len, np.uint8), 0
  with open(tokens_path, "wb") as out_t, open(weights_path, "wb") as out_w:

    def flush():
      nonlocal used
      out_t.write(row_t.tobytes())
      out_w.write(row_w.tobytes())
      row_t.fill(tok.pad_id)
      row_w.fill(0)
      stats["records"] += 1
      used = 0

    for parts, where in examples:
      ids, weights = encode(tok, parts, where)
      if len(ids) > record_len:
        stats["too_long"] += 1
        continue
      if used + len(ids) > record_len:
        flush()
      row_t[used : used + len(ids)], row_w[used : used + len(ids)] = ids, weights
      used += len(ids)
      stats["documents"] += 1
      stats["tokens"] += len(ids)
    if used:
      flush()
  return stats
