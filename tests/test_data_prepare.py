"""data.prepare writes what data.arrayrecord reads back exactly; bad input is one `error:` line."""

import hashlib
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import uuid

import grain
import numpy as np
import pytest

from data import arrayrecord, prepare
from errors import UserError
from tests.conftest import REPO

SEQ_LEN = 7


def write_corpus(root, extra=b""):
  """A few .txt files and one .jsonl; returns (input patterns, documents in the order prepare reads them)."""
  txt = {
    "a.txt": b"Plain ASCII text.\nSecond line.\n",
    "b.txt": "Grüße, naïve café — 日本語のテキスト 🙂\n".encode() + extra,
    "c.txt": bytes(range(1, 256)),  # Every byte value but padding's: bytes need not be UTF-8.
  }
  for name, data in txt.items():
    (root / name).write_bytes(data)
  rows = [{"text": "first json doc"}, {"text": ""}, {"text": "ünïcödé\nwith newline"}, {"text": "x" * 40}]
  lines = [json.dumps(r, ensure_ascii=False) for r in rows]
  (root / "d.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n", encoding="utf-8")
  docs = [txt["a.txt"], txt["b.txt"], txt["c.txt"]] + [r["text"].encode() for r in rows if r["text"]]
  return [str(root / "*.txt"), str(root / "d.jsonl")], docs


def read_split(directory, split):
  source = arrayrecord.ArrayRecordSource(str(directory), split, SEQ_LEN)
  return [source[i]["tokens"] for i in range(len(source))]


def test_round_trip_is_exact_across_shards_and_splits(tmp_path):
  (tmp_path / "corpus").mkdir()
  inputs, docs = write_corpus(tmp_path / "corpus")
  out = tmp_path / "out"
  meta = prepare.prepare(inputs, str(out), SEQ_LEN, records_per_shard=4, eval_fraction=0.2)

  train, evals = read_split(out, "train"), read_split(out, "eval")
  assert all(r.dtype == np.int32 and r.shape == (SEQ_LEN + 1,) for r in train + evals)
  assert prepare.decode_documents(train + evals) == docs
  threaded = grain.MapDataset.source(arrayrecord.ArrayRecordSource(str(out), "train", SEQ_LEN))
  threaded = threaded.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
  assert [r["tokens"].tolist() for r in threaded] == [r.tolist() for r in train]  # Grain reader threads.

  num_tokens = sum(len(d) + 1 for d in docs)
  n = meta["num_records"]
  assert meta == json.loads((out / "metadata.json").read_text())
  assert (meta["num_documents"], meta["num_tokens"]) == (len(docs), num_tokens)
  assert (len(train), len(evals)) == (n["train"], n["eval"])
  assert n["train"] + n["eval"] == math.ceil(num_tokens / (SEQ_LEN + 1))
  assert n["eval"] == int(0.2 * (n["train"] + n["eval"])) >= 1
  assert (meta["vocab_size"], meta["pad_id"], meta["eos_id"], meta["tokenizer"]) == (258, 0, 1, "byte")
  for split in prepare.SPLITS:
    assert len(meta["shards"][split]) == math.ceil(n[split] / 4)
    assert sorted(meta["shards"][split]) == sorted(p.name for p in out.glob(f"{split}-*.array_record"))
  assert meta["shards"]["train"][0] == f"train-00000-of-{len(meta['shards']['train']):05d}.array_record"
  assert meta["valid_tokens_in_last_record"] == {
    "train": SEQ_LEN + 1,
    "eval": int(np.count_nonzero(evals[-1])),
  }
  records = b"".join(r.astype("<i4").tobytes() for r in train + evals)
  assert meta["fingerprint"] == hashlib.sha256(records).hexdigest()
  assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".array_record")) == ["metadata.json"]
  assert prepare.decode(np.append(train[0], 0)) == b"Plain AS"
  assert prepare.decode([67, 1, 0]) == b"A\n"


def test_fingerprint_follows_the_corpus(tmp_path):
  (tmp_path / "c1").mkdir()
  (tmp_path / "c2").mkdir()
  inputs1, _ = write_corpus(tmp_path / "c1")
  inputs2, _ = write_corpus(tmp_path / "c2", extra=b"!")
  first = prepare.prepare(inputs1, str(tmp_path / "o1"), SEQ_LEN)["fingerprint"]
  again = prepare.prepare(inputs1, str(tmp_path / "o2"), SEQ_LEN, records_per_shard=2)["fingerprint"]
  changed = prepare.prepare(inputs2, str(tmp_path / "o3"), SEQ_LEN)["fingerprint"]
  assert first == again != changed


def test_tiny_corpus_has_no_eval_split(tmp_path):
  (tmp_path / "one.txt").write_bytes(b"abc")
  meta = prepare.prepare([str(tmp_path / "one.txt")], str(tmp_path / "out"), 16)
  assert meta["num_records"] == {"train": 1, "eval": 0} and meta["valid_tokens_in_last_record"]["train"] == 4
  source = arrayrecord.ArrayRecordSource(str(tmp_path / "out"), "train", 16)
  assert source[0]["tokens"].tolist() == [99, 100, 101, 1] + [0] * 13
  assert pickle.loads(pickle.dumps(source))[0]["tokens"].tolist() == source[0]["tokens"].tolist()
  with pytest.raises(IndexError):
    source[1]
  with pytest.raises(UserError, match="no 'eval' records"):
    arrayrecord.ArrayRecordSource(str(tmp_path / "out"), "eval", 16)


def test_overwrite_replaces_only_an_earlier_output(tmp_path):
  (tmp_path / "t.txt").write_bytes(b"hello world")
  out = str(tmp_path / "out")
  prepare.prepare([str(tmp_path / "t.txt")], out, 2, records_per_shard=1)
  with pytest.raises(UserError, match="--overwrite"):
    prepare.prepare([str(tmp_path / "t.txt")], out, 2)
  meta = prepare.prepare([str(tmp_path / "t.txt")], out, 4, overwrite=True)
  assert sorted(os.listdir(out)) == sorted(
    ["metadata.json", *meta["shards"]["train"], *meta["shards"]["eval"]]
  )
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "keep.txt").write_text("not ours")
  with pytest.raises(UserError, match="not a data.prepare output"):
    prepare.prepare([str(tmp_path / "t.txt")], str(tmp_path / "other"), 4, overwrite=True)
  assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


@pytest.mark.parametrize(
  "make, kwargs, match",
  [
    (lambda d: None, {"inputs": ["{d}/nothing*.txt"]}, "matches no files"),
    (lambda d: (d / "e.txt").write_bytes(b""), {"inputs": ["{d}/e.txt"]}, "contain no text"),
    (
      lambda d: (d / "e.jsonl").write_text('{"text": ""}\n\n'),
      {"inputs": ["{d}/e.jsonl"]},
      "contain no text",
    ),
    (lambda d: (d / "j.jsonl").write_text('{"txt": "a"}\n'), {"inputs": ["{d}/j.jsonl"]}, "'text' field"),
    (lambda d: None, {"seq_len": 0}, "--seq_len must be >= 1"),
    (lambda d: None, {"workers": -1}, "--workers must be >= 0"),
    (lambda d: None, {"tokenizer": "gpt2"}, "--tokenizer"),
    (lambda d: (d / "out").mkdir() or (d / "out" / "x").write_text("x"), {}, "exists and is not empty"),
  ],
)
def test_bad_input_raises_user_error(tmp_path, make, kwargs, match):
  (tmp_path / "ok.txt").write_bytes(b"some text")
  make(tmp_path)
  args = {"inputs": [str(tmp_path / "ok.txt")], "output": str(tmp_path / "out"), "seq_len": 4}
  args.update(kwargs)
  args["inputs"] = [p.format(d=tmp_path) for p in args["inputs"]]
  with pytest.raises(UserError, match=match):
    prepare.prepare(**args)


def test_default_output_is_a_git_ignored_datasets_dir(tmp_path):
  name = f"books-{uuid.uuid4().hex[:8]}"
  (tmp_path / name).mkdir()
  (tmp_path / name / "t.txt").write_bytes(b"hello world")
  expected = os.path.join(REPO, "datasets", name)
  assert prepare.default_output([f"{tmp_path}/{name}/*.txt", "more.jsonl"]) == expected
  assert prepare.default_output(["notes/more.jsonl"]) == os.path.join(REPO, "datasets", "more")
  try:
    ok = run_cli(f"--input={tmp_path}/{name}/*.txt", "--seq_len=2")  # No --output.
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith(f"to {expected}"), ok.stdout + ok.stderr
    assert os.path.isfile(os.path.join(expected, "metadata.json"))
    if os.path.isdir(os.path.join(REPO, ".git")) and shutil.which("git"):  # A checkout, not a copy.
      status = subprocess.run(["git", "status", "--porcelain", "--", expected], cwd=REPO, capture_output=True)
      assert status.returncode == 0 and status.stdout == b"", status.stdout  # Ignored: nothing to commit.
  finally:
    shutil.rmtree(expected, ignore_errors=True)
    try:
      os.rmdir(os.path.join(REPO, "datasets"))  # Leaves no empty datasets/ behind.
    except OSError:
      pass


def remove_strays(name):
  """Removes and returns what a run wrote under a unique `name` into the checkout's code directories."""
  found = []
  for code in ("data", "tests", "trainer"):
    for entry in os.listdir(os.path.join(REPO, code)):
      if name in entry:  # The output, or its `.NAME.partial-*` staging directory.
        found.append(f"{code}/{entry}")
        shutil.rmtree(os.path.join(REPO, code, entry))
  return found


@pytest.mark.parametrize("inside", ["data/{name}", "tests/{name}/y", "configs/../trainer/{name}", "model"])
def test_output_inside_the_code_is_refused(tmp_path, inside):
  (tmp_path / "t.txt").write_bytes(b"hello world")
  name = f"corpus-{uuid.uuid4().hex[:8]}"
  try:
    with pytest.raises(UserError, match=r"inside the code directory \w+/.*--output=\S*datasets/"):
      prepare.prepare([str(tmp_path / "t.txt")], os.path.join(REPO, inside.format(name=name)), 4)
  finally:
    assert remove_strays(name) == []


def test_sentencepiece_missing_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "sentencepiece", None)  # Makes `import sentencepiece` fail.
  (tmp_path / "t.txt").write_bytes(b"text")
  with pytest.raises(UserError, match="pip install sentencepiece"):
    prepare.prepare([str(tmp_path / "t.txt")], str(tmp_path / "out"), 4, tokenizer=str(tmp_path / "sp.model"))


def test_metadata_checks_name_the_config_key(tmp_path):
  with pytest.raises(UserError, match="data.path"):
    arrayrecord.load_metadata(str(tmp_path / "missing"))
  with pytest.raises(UserError, match="data.path=.* has no metadata.json"):
    arrayrecord.load_metadata(str(tmp_path))
  meta = {"seq_len": 8, "vocab_size": 258, "tokenizer": "byte"}
  arrayrecord.check_compatible(meta, 8, 258)
  with pytest.raises(UserError, match="set data.seq_len=8"):
    arrayrecord.check_compatible(meta, 16, 512)
  with pytest.raises(UserError, match="set model.vocab_size>=258"):
    arrayrecord.check_compatible(meta, 8, 256)


def run_cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "data.prepare", *args], cwd=REPO, capture_output=True, text=True, timeout=60
  )


def assert_one_error_line(result, fragment):
  assert result.returncode == 2, result.stdout + result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], result.stderr
  assert "Traceback" not in result.stderr


def test_cli(tmp_path):
  (tmp_path / "t.txt").write_bytes("Grüße\n".encode())
  out = str(tmp_path / "out")
  ok = run_cli(f"--input={tmp_path}/t.txt", f"--output={out}", "--seq_len=2")
  assert ok.returncode == 0 and "wrote 2 train and 1 eval records" in ok.stdout, ok.stdout + ok.stderr
  assert_one_error_line(run_cli(f"--input={tmp_path}/t.txt", f"--output={out}", "--seq_len=2"), "--overwrite")
  assert_one_error_line(
    run_cli(f"--input={tmp_path}/*.md", f"--output={out}2", "--seq_len=2"), "matches no files"
  )
  assert_one_error_line(run_cli(f"--input={tmp_path}/t.txt", f"--output={out}2", "--seq_len=0"), "--seq_len")
  assert_one_error_line(run_cli(f"--output={out}2", "--seq_len=2"), "--input is required")
  assert_one_error_line(run_cli(f"--input={tmp_path}/t.txt", "--seq_len=x"), "seq_len")


def test_cli_refuses_an_output_inside_data(tmp_path):
  (tmp_path / "t.txt").write_bytes(b"hello world")
  name = f"corpus-{uuid.uuid4().hex[:8]}"
  try:
    result = run_cli(f"--input={tmp_path}/t.txt", f"--output=data/{name}", "--seq_len=2")
    assert_one_error_line(result, f"--output=data/{name} is inside the code directory data/")
    assert f"--output=datasets/{name} " in result.stderr
  finally:
    assert remove_strays(name) == []


def test_workers_give_the_same_bytes_and_skipped_documents_are_counted(tmp_path):
  """A directory (walked, sorted) of 600 text files, an empty one, one that is not UTF-8 and a .jsonl
  with its own field: 1 process and 4 workers write the same shards, and the skips are counted."""
  corpus = tmp_path / "corpus"
  (corpus / "sub").mkdir(parents=True)
  rng = np.random.default_rng(0)
  for i in range(600):
    (corpus / "sub" / f"{i:03}.txt").write_text(" ".join(rng.choice(["ab", "cd", "ef", "gh"], 20)))
  (corpus / "empty.txt").write_bytes(b"")
  (corpus / "garbage.bin").write_bytes(b"\xff\xfe\x00 binary")
  (corpus / "rows.jsonl").write_text('{"body": "a row"}\n{"body": ""}\n')
  metas = [
    prepare.prepare(
      [str(corpus)], str(tmp_path / f"out{w}"), 16, train_tokenizer="bpe:300", workers=w, jsonl_field="body"
    )
    for w in (0, 4)
  ]
  assert metas[0]["fingerprint"] == metas[1]["fingerprint"]
  assert metas[0]["num_documents"] == 601 and metas[0]["skipped_documents"] == {"empty": 2, "not_text": 1}
  for name in sorted(os.listdir(tmp_path / "out0")):
    assert (tmp_path / "out0" / name).read_bytes() == (tmp_path / "out4" / name).read_bytes(), name


def test_a_sentencepiece_model_trained_here_tokenizes_with_its_own_pad_and_eos(tmp_path):
  import sentencepiece

  rng = np.random.default_rng(0)
  text = "\n".join(" ".join(rng.choice(["alpha", "beta", "gamma", "delta"], 12)) for _ in range(200))
  (tmp_path / "t.txt").write_text(text)
  prefix = str(tmp_path / "sp")
  sentencepiece.SentencePieceTrainer.train(
    input=str(tmp_path / "t.txt"), model_prefix=prefix, vocab_size=16, pad_id=0, eos_id=1, unk_id=2, bos_id=-1
  )
  meta = prepare.prepare([str(tmp_path / "t.txt")], str(tmp_path / "out"), 16, tokenizer=prefix + ".model")
  sp = sentencepiece.SentencePieceProcessor(model_file=prefix + ".model")
  assert (meta["tokenizer"], meta["vocab_size"], meta["pad_id"], meta["eos_id"]) == (
    "sentencepiece",
    16,
    0,
    1,
  )
  assert meta["num_tokens"] == len(sp.encode(text)) + 1  # The document and its eos.
