"""Comments and docstrings in trainer/, model/, data/ and experiments/ say what and why; measured figures
live in the benchmarks' output and docs/results.md, where their date, machine and command are, not
in the code, where they go stale unseen."""

import ast
import glob
import io
import os
import re
import tokenize

from tests.conftest import REPO

# A ratio (0.989x), or a number with a unit of speed or time (355 ms, 22 GiB/s, 0.028 s per step).
FIGURE = re.compile(
  r"\b\d+(\.\d+)?x\b|\b\d+(\.\d+)? ?(ms|GB/s|GiB/s|MB/s|MiB/s|tokens/s)\b|\b\d+(\.\d+)? s (per|a) step"
  r"|\b\d+(\.\d+)?% (slower|faster)"
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
  for folder in ("trainer", "model", "data", "experiments"):
    for path in glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True):
      for line, text in _prose(path):
        found += [f"{os.path.relpath(path, REPO)}:{line}: {m.group(0)}" for m in FIGURE.finditer(text)]
  assert not found, found


def test_the_pattern_finds_the_figures_it_names():
  for text in ("took 0.742x", "27 against 355 ms", "at 22 GiB/s", "0.028 s per step", "6% slower"):
    assert FIGURE.search(text), text
  for text in ("a 2-layer model", "every 5 steps", "128-tiles", "3 s of compile"):
    assert not FIGURE.search(text), text
