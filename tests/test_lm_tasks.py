"""experiments/_lm_tasks.py's input: a malformed task file or key is one `error:` line naming the file
and line; context/continuation pairs are encoded as lm-eval-harness encodes them (the scores
themselves are held against lm-eval in tests/test_lm_eval_parity.py)."""

import pytest

from errors import UserError
from experiments import _lm_tasks, lm
from tests.conftest import tiny_config


@pytest.mark.parametrize(
  "lines, problem",
  [
    (['{"context": "a", "target": "b"}', "{not json"], r"t.jsonl:2: not JSON"),
    (['{"context": "a", "choices": ["b"], "answer": 1}'], r"t.jsonl:1: a task line is"),
    (['{"context": "a", "choices": [], "answer": 0}'], r"t.jsonl:1: a task line is"),
    (['{"context": 3, "target": "b"}'], r"t.jsonl:1: a task line is"),
    (['{"context": "  ", "target": "b"}'], r"t.jsonl:1: a task line is"),  # Spaces alone encode to nothing.
    (['{"context": "a", "target": "b"}', '{"context": "a", "choices": ["b"], "answer": 0}'], "mixes"),
    ([""], "has no lines"),
  ],
)
def test_a_malformed_task_is_one_error_naming_its_line(tmp_path, lines, problem):
  (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
  with pytest.raises(UserError, match=problem):
    _lm_tasks.read_task(str(tmp_path / "t.jsonl"))
  with pytest.raises(UserError, match="no such file"):
    _lm_tasks.read_task(str(tmp_path / "missing.jsonl"))


def test_tasks_need_a_tokenizer_and_room_for_the_context():
  with pytest.raises(UserError, match="the synthetic source has none"):
    lm.check_config(tiny_config(**{"data.eval_tasks": "t.jsonl"}))
  config = tiny_config(
    **{"data.eval_tasks": "t.jsonl", "data.source": "arrayrecord", "data.eval_max_new_tokens": 16}
  )
  with pytest.raises(UserError, match="data.eval_max_new_tokens=16 must be below data.seq_len=16"):
    lm.check_config(config)


def test_pairs_are_encoded_as_lm_eval_encodes_them():
  # A toy tokenizer that merges "ab". The continuation is the whole pair's encoding after as many tokens
  # as the context's own, even where a merge crosses the boundary (lm-eval's _encode_pair).
  def encode(text):
    out, i = [], 0
    while i < len(text):
      if text.startswith("ab", i):
        out.append(100)
        i += 2
      else:
        out.append(ord(text[i]))
        i += 1
    return out

  assert _lm_tasks.encode_pair(encode, "x", "aby", eos_id=1) == ([ord("x")], [100, ord("y")])
  assert _lm_tasks.encode_pair(encode, "xa", "bc", eos_id=1) == ([ord("x"), ord("a")], [ord("c")])
  assert _lm_tasks.encode_pair(encode, "x  ", "y", eos_id=1) == ([ord("x")], [32, 32, ord("y")])
  assert _lm_tasks.encode_pair(encode, "", "y", eos_id=1) == ([1], [ord("y")])


def test_task_text_is_encoded_and_decoded_as_transformers_does_with_a_bos_post_processor(tmp_path):
  """A tokenizer.json whose post-processor adds a BOS (as Llama 3's does): the tasks' encoding carries
  it, as the export's AutoTokenizer (what lm-eval calls) does, and decoded text has no special token."""
  transformers = pytest.importorskip("transformers")
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

  from data import tokenizers

  vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {c: 3 + i for i, c in enumerate(tokenizers._byte_chars())}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
  tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  ours = tokenizers.HFTokenizer(path)
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
  text = "the cat, über"
  assert ours.encode_text(text) == theirs.encode(text) and ours.encode_text(text)[0] == 2
  ids = [2, *ours.encode_text(text)[1:], 0, 1]
  assert ours.decode_text(ids) == theirs.decode(ids, skip_special_tokens=True) == text
  byte = tokenizers.ByteTokenizer()
  assert byte.decode_text([0, *byte.encode_text(text), 1]) == text
