"""The LM's task evaluators (experiments/_lm_tasks.py) score as lm-eval-harness 0.4.13 itself scores the
same local tasks through our Hugging Face export, offline: each choice's log-likelihood within 1e-4,
the same accuracy, the same generated text item by item and the same exact match; and a run with
data.eval_tasks reports them in its evaluation rows."""

import json
import os

import numpy as np
import pytest

from data import prepare, tokenizers
from experiments import _lm_tasks
from tests.conftest import read_jsonl, run_main, run_python

pytest.importorskip("lm_eval", reason="lm-eval-harness comes with the parity extra (make test installs it)")

SEQ_LEN, NEW_TOKENS = 32, 8
MULTIPLE_CHOICE = [
  {"context": f"line {i}: the cat sat on the", "choices": ["mat", "hat", "dog,"], "answer": i % 3}
  for i in range(5)
] + [
  {"context": "line 7: the cat sat ", "choices": ["on", "in"], "answer": 0},  # Its space moves.
  {"context": "", "choices": ["line", "über"], "answer": 1},
  {
    "context": "über",
    "choices": [" alles.", " a", "x"],
    "answer": 0,
  },  # Lengths differ: acc_norm.  # Empty: the end-of-document token.
]
CONTEXTS = ["line 3: the cat", "line 40: the", "über", "line 9: the cat sat on the mat, "]

LM_EVAL = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
out, tasks, model, seq_len = sys.argv[1:]
args = f"pretrained={model},dtype=float32,max_length={seq_len}"
r = simple_evaluate(model="hf", model_args=args, tasks=["mc", "em"], batch_size=1, device="cpu",
  task_manager=TaskManager(include_path=tasks), log_samples=True)
samples = {t: [s["resps"] for s in sorted(r["samples"][t], key=lambda s: s["doc_id"])] for t in ("mc", "em")}
json.dump({"results": r["results"], "samples": samples}, open(out, "w"))
"""


def _task_yaml(name: str, path: str, kind: str) -> str:
  head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
  head += 'test_split: test\ndoc_to_text: "{{context}}"\n'
  if kind == "multiple_choice":
    return head + 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
  return head + (
    'output_type: generate_until\ndoc_to_target: "{{target}}"\n'
    f'generation_kwargs:\n  until: ["\\n"]\n  do_sample: false\n  max_gen_toks: {NEW_TOKENS}\n'
    "metric_list:\n  - metric: exact_match\n"
  )


def _write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_task_evaluators_match_lm_eval_harness_through_the_export(tmp_path, monkeypatch):
  text = tmp_path / "text.txt"
  text.write_text("".join(f"line {i}: the cat sat on the mat, über alles.\n" for i in range(300)))
  data = str(tmp_path / "data")
  prepare.prepare([str(text)], data, seq_len=SEQ_LEN)
  mc, em = tmp_path / "mc.jsonl", tmp_path / "em.jsonl"
  _write_jsonl(mc, MULTIPLE_CHOICE)
  _write_jsonl(em, [{"context": c, "target": "-"} for c in CONTEXTS])

  # Our generations first, to make half the targets right: exact match is then neither 0 nor 1.
  from trainer.modes.export import load

  run = str(tmp_path / "run")
  flags = [
    "--config=configs/smoke_cpu.py:tiny",
    "--cpu_devices=8",
    f"--workdir={run}",
    "--config.steps=12",
    "--config.optimizer.learning_rate=0.01",
    "--config.data.source=arrayrecord",
    f"--config.data.path={data}",
    f"--config.data.seq_len={SEQ_LEN}",
    "--config.model.vocab_size=258",
    f"--config.data.eval_max_new_tokens={NEW_TOKENS}",
  ]
  trained = run_main(*flags, f"--config.data.eval_tasks={mc},{em}")
  assert trained.returncode == 0, trained.stderr
  loaded = load(run)
  model = _model(loaded)
  monkeypatch.setattr(_lm_tasks, "CHUNK", 8)  # Here several chunks; in the run's --mode=eval, one.
  tokenizer = tokenizers.ByteTokenizer()
  _, texts = _lm_tasks.score("exact_match", _lm_tasks.read_task(str(em))[1], model, tokenizer, loaded.config)
  _write_jsonl(
    em,
    [
      {"context": c, "target": t if i % 2 else t + "!"}
      for i, (c, t) in enumerate(zip(CONTEXTS, texts, strict=True))
    ],
  )
  ours_mc, lls = _lm_tasks.score("multiple_choice", MULTIPLE_CHOICE, model, tokenizer, loaded.config)
  ours_em, generated = _lm_tasks.score(
    "exact_match", _lm_tasks.read_task(str(em))[1], model, tokenizer, loaded.config
  )
  assert generated == texts and ours_em == {"exact_match": 0.5}

  evaluated = run_main(*flags, f"--config.data.eval_tasks={mc},{em}", "--mode=eval")  # The same weights.
  assert evaluated.returncode == 0, evaluated.stderr
  row = json.load(open(os.path.join(run, "eval.json")))
  assert (row["eval_mc_acc"], row["eval_em_exact_match"]) == (ours_mc["acc"], 0.5)
  [final] = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if "eval_mc_acc" in r]
  assert final["step"] == 12 and final["eval_mc_acc"] == ours_mc["acc"]

  hf = str(tmp_path / "hf")
  export = run_python("-m", "trainer.modes.export", f"--workdir={run}", "--format=hf", f"--out={hf}")
  assert export.returncode == 0, export.stderr
  tasks = tmp_path / "tasks"
  tasks.mkdir()
  (tasks / "mc.yaml").write_text(_task_yaml("mc", str(mc), "multiple_choice"))
  (tasks / "em.yaml").write_text(_task_yaml("em", str(em), "exact_match"))
  env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
  out = tmp_path / "lm_eval.json"
  theirs = run_python("-c", LM_EVAL, str(out), str(tasks), hf, str(SEQ_LEN), env=env, timeout=300)
  assert theirs.returncode == 0, theirs.stderr[-3000:]
  result = json.loads(out.read_text())
  their_lls = [[float(choice[0][0]) for choice in item] for item in result["samples"]["mc"]]
  for ours, their in zip(lls, their_lls, strict=True):
    np.testing.assert_allclose(ours, their, rtol=0, atol=1e-4)
  assert result["results"]["mc"]["acc,none"] == ours_mc["acc"]
  assert result["results"]["mc"]["acc_norm,none"] == ours_mc["acc_norm"]
  assert [item[0][0] for item in result["samples"]["em"]] == generated
  assert result["results"]["em"]["exact_match,none"] == 0.5


def _model(loaded):
  from trainer import components

  comp = components.build(loaded.config, with_data=False)
  return comp.mdef.merge(loaded.params, loaded.variables)
