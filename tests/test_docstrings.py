"""Comments and docstrings in trainer/ (trainer/cluster/ among it), model/, data/, experiments/ and
configs/ say what and why; measured figures live in the benchmarks' output and docs/results.md, where
their date, machine and command are, not in the code, where they go stale unseen. A recipe's docstring
keeps what to expect and the bounds a user checks, and names the results section with its figures."""

import ast
import glob
import io
import os
import re
import tokenize

from tests.conftest import REPO

_N = r"\d+(\.\d+)?"
# A ratio (0.989x), or a number with a unit of speed or time (355 ms, 22 GiB/s, 0.028 s per step); a run's
# length (6m04s, 8 s on 2 cores), a comparison (0.24 against 0.44 s), a measured size (608 MiB copy,
# 113 GB per device, a compile's "temporaries 32.6 GB"), MFU, a check's cost in steps, FLOPs, a loss to 3
# or more places (not a z-loss weight), or a number the text calls measured. A space may be a line break.
FIGURE = re.compile(
  (
    rf"\b{_N}x\b|\b{_N} ?(ms|GB/s|GiB/s|MB/s|MiB/s|tokens/s)\b|\b{_N} s (per|a) step"
    rf"|\b{_N}% (slower|faster)"
    rf"|\b\d+m\d+s\b|\b{_N} ?(s|ms|minutes?) on \d+ (idle |shared |loaded )?cores\b"
    rf"|\b{_N} against {_N} ?(s|ms|KiB|MiB|GiB|MB|GB)\b"
    rf"|\b{_N} ?(KiB|MiB|GiB|TiB|KB|MB|GB|TB) (copy|per (device|step|process|host))\b"
    rf"|\b(params|optimizer|step|arguments|temporaries|peak) {_N} ?(KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"
    rf"|\bMFU:? {_N}|\b{_N}% MFU\b|\b{_N}(-{_N})? steps per check\b|\bFLOPs:? {_N}e\d+|\b{_N}e\d+ FLOPs\b"
    r"|(?<!-)\bloss (of |at )?\d+\.\d{3,}\b"
    rf"|\bmeasured:? (at most |about )?{_N}|\b{_N}%? measured\b"
  )
  .replace(" ?", r"\s*")
  .replace(" ", r"\s+")
)


def _prose(path: str):
  """(line, text) of each comment and docstring in `path`."""
  source = open(path).read()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      yield token.start[0], token.string
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
      if doc := ast.get_docstring(node, clean=False):
        yield (node.body[0].lineno if node.body else 1), doc


def test_comments_and_docstrings_carry_no_measured_figures():
  found = []
  for folder in ("trainer", "model", "data", "experiments", "configs"):
    for path in glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True):
      for line, text in _prose(path):
        found += [f"{os.path.relpath(path, REPO)}:{line}: {m.group(0)}" for m in FIGURE.finditer(text)]
  assert not found, found


def test_the_pattern_finds_the_figures_it_names():
  for text in (
    "took 0.742x",
    "27 against 355 ms",
    "at 22 GiB/s",
    "0.028 s per step",
    "6% slower",
    "6m04s on 2 idle cores",
    "about 8 s on 2 cores",
    "about 2 minutes on 2 cores",
    "a 608 MiB copy over loopback",
    "0.24 against 0.44 s of CPU",
    "send 113 GB per device per step",
    "compiled step 33.0 GB",
    "temporaries 32.6 GB",
    "compiled step\n53.2 GB",
    "MFU 28.9%",
    "1.1-1.2 steps per check",
    "Model FLOPs 8.7e16 per step",
    "60 steps end at loss 7.0344",
    "final eval loss 3.106",
    "(0.8906 measured",
    "measured 3.056 against 3.022",
    "~5,300 tokens/s",
  ):
    assert FIGURE.search(text), text
  for text in (
    "a 2-layer model",
    "every 5 steps",
    "128-tiles",
    "3 s of compile",
    "router z-loss 0.001",
    "balance loss 0.01",
    "1 << 34  # 16 GiB: a bound",
    "8 GPUs (80 GB class)",
    "under an H100's 80 GB",
    "Mixtral 8x7B",
    "8x8 images",
    "0.5 GB per layer and pass on Qwen3-30B-A3B's shapes",
    "the step watchdog's budget (300 s and more)",
    "within 0.15 nats of the floor",
  ):
    assert not FIGURE.search(text), text
