"""Every file and function a message or docstring names exists: a path like
`trainer/config/trainer_keys.py`, or a call like `get_config()`, in a string literal of the code (an
error's advice, a docstring's pointer) is checked against the tree, so a renamed or removed one cannot
leave a message sending the user to it (the unknown-key error named an experiment's default_config()
long after keys moved to trainer/config/trainer_keys.py and experiments/NAME_keys.py)."""

import ast
import builtins
import os
import re

from tests.conftest import REPO

SOURCES = [
  "main.py",
  "errors.py",
  "trainer",
  "data",
  "model",
  "experiments",
  "launch",
  "configs",
  "benchmarks",
]
PATH = re.compile(r"(?<![\w./{}-])((?:[\w{}.-]+/)+[\w{}-]+\.py)\b")  # dir/name.py, repository-relative.
BARE = re.compile(r"(?<![\w./{}-])([\w-]+\.py)\b")  # name.py: some file of the tree has that name.
CALL = re.compile(r"(?<![\w.])(\w+)\(\)")  # name(): ours or a builtin (x.name() is not checked).
# A placeholder the reader fills in: an f-string's field, or a word in capitals (experiments/NAME.py,
# NAME_keys.py, configs/START.py).
PLACEHOLDER = re.compile(r"\{\}|(^|/)[A-Z]+(?=[_./]|$)")


def _python_files():
  for entry in SOURCES:
    if entry.endswith(".py"):
      yield entry
      continue
    for root, _, names in os.walk(os.path.join(REPO, entry)):
      yield from (os.path.relpath(os.path.join(root, n), REPO) for n in sorted(names) if n.endswith(".py"))


def _strings(tree):
  """(line, text) of every string literal; an f-string whole, each field as '{}'."""
  parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
      yield node.lineno, node.value
    elif isinstance(node, ast.JoinedStr):
      yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def test_every_file_and_function_a_string_names_exists():
  names = set()
  for _, dirs, files in os.walk(REPO):
    dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "datasets", "__pycache__")]
    names.update(files)
  trees = {}
  for source in [
    *_python_files(),
    *(os.path.join("tests", n) for n in os.listdir(os.path.join(REPO, "tests"))),
  ]:
    if source.endswith(".py"):
      with open(os.path.join(REPO, source)) as f:
        trees[source] = ast.parse(f.read(), source)
  defined = {
    n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.FunctionDef | ast.ClassDef)
  }
  missing, checked = [], 0
  for source in _python_files():
    for line, text in _strings(trees[source]):
      for path in PATH.findall(text):
        checked += 1
        if not PLACEHOLDER.search(path) and not os.path.exists(os.path.join(REPO, path)):
          missing.append(f"{source}:{line} names {path}")
      for name in BARE.findall(text):
        checked += 1
        if not PLACEHOLDER.search(name) and name not in names:
          missing.append(f"{source}:{line} names {name}")
      for name in CALL.findall(text):
        checked += 1
        if name not in defined and not hasattr(builtins, name):
          missing.append(f"{source}:{line} names {name}(), which nothing defines")
  assert checked > 200  # The scan finds the names that are there (299 when this was written).
  assert not missing, "\n".join(missing)


def test_the_scan_sees_paths_in_strings_and_f_strings_and_allows_placeholders():
  tree = ast.parse(
    'x = "see configs/nope.py"\ny = f"experiments/{name}.py and NAME_keys.py"\n"""doc a/b.py"""'
  )
  texts = [text for _, text in _strings(tree)]
  assert sorted(texts) == ["doc a/b.py", "experiments/{}.py and NAME_keys.py", "see configs/nope.py"]
  assert [PATH.findall(t) for t in sorted(texts)] == [["a/b.py"], ["experiments/{}.py"], ["configs/nope.py"]]
  assert PLACEHOLDER.search("experiments/{}.py") and PLACEHOLDER.search("NAME_keys.py")
  assert PLACEHOLDER.search("configs/START.py") and not PLACEHOLDER.search("configs/base.py")
  assert CALL.findall("the experiment's default_config(), not jax.devices()") == ["default_config"]
