"""The layout holds: imports go one way (no cycle between the trainer's modules, nor between its
subpackages, nor between model/'s; config/ needs nothing else of the trainer and no JAX; only
trainer/run.py reaches up to the modes and the run; model/ and data/ import nothing of the trainer),
checked on the source with `ast`, without importing anything."""

import ast
import glob
import os

from tests.conftest import REPO

TOP = ("trainer.run", "trainer.train")  # What the entry points call; nothing below may import them.
# What may reach up to the modes: the dispatch.
ENTRY_POINTS = ("trainer.run",)


def _module(path: str) -> str:
  rel = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
  return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, modules: set[str]) -> set[str]:
  """The trainer modules (and top-level packages) `path` imports, anywhere in the file."""
  found = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      found |= {
        f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names
      }
  return found


def _graph() -> dict[str, set[str]]:
  paths = glob.glob(os.path.join(REPO, "trainer", "**", "*.py"), recursive=True)
  modules = {_module(p) for p in paths}
  return {_module(p): _imports(p, modules) for p in paths}


def _assert_acyclic(edges: dict[str, set[str]], what: str) -> None:
  state: dict[str, int] = {}

  def visit(m, path):
    if state.get(m) == 1:
      raise AssertionError(f"{what} cycle: " + " -> ".join([*path[path.index(m) :], m]))
    if state.get(m) != 2:
      state[m] = 1
      for n in sorted(edges.get(m, ())):
        visit(n, [*path, m])
      state[m] = 2

  for m in sorted(edges):
    visit(m, [])


def test_the_trainer_modules_import_each_other_without_a_cycle():
  graph = _graph()
  edges = {
    m: {i for i in imports if i in graph and i != m and i != "trainer"} for m, imports in graph.items()
  }
  _assert_acyclic(edges, "import")


def test_config_needs_no_jax_and_nothing_else_of_the_trainer():
  for m, imports in _graph().items():
    if m.startswith("trainer.config"):
      wrong = [
        i for i in imports if i.split(".")[0] in ("jax", "flax", "orbax", "optax", "grain", "model", "data")
      ]
      wrong += [i for i in imports if i.startswith("trainer.") and not i.startswith("trainer.config")]
      assert not wrong, (m, wrong)


def test_nothing_below_the_entry_points_imports_them_or_the_modes():
  for m, imports in _graph().items():
    if m in TOP or m.startswith("trainer.modes"):
      continue
    up = [i for i in imports if i in TOP or i.startswith("trainer.modes")]
    assert not up or m in ENTRY_POINTS, (m, up)


def _folder(module: str) -> str | None:
  """trainer.cluster.watchdog -> trainer.cluster; None for a module directly under trainer/."""
  parts = module.split(".")
  return ".".join(parts[:2]) if len(parts) > 2 and parts[0] == "trainer" else None


def test_the_trainer_folders_import_each_other_one_way():
  """Subpackage by subpackage too: observe/ uses cluster/ (gathering a profile), so cluster/ must not
  use observe/ back (the clock hands the watchdog its phase order instead)."""
  graph = _graph()
  edges: dict[str, set[str]] = {}
  for m, imports in graph.items():
    for i in imports:
      here, there = _folder(m), _folder(i)
      if i in graph and here and there and here != there:
        edges.setdefault(here, set()).add(there)
  _assert_acyclic(edges, "folder")


def test_model_and_data_import_nothing_of_the_trainer():
  """model/ and data/ sit below the trainer: what reads a run (experiments/sample.py) lives above it,
  and the exit codes they share with it sit beside errors.py."""
  for path in glob.glob(os.path.join(REPO, "model", "*.py")) + glob.glob(os.path.join(REPO, "data", "*.py")):
    up = [i for i in _imports(path, set()) if i == "trainer" or i.startswith("trainer.")]
    assert not up, (path, up)


def test_the_bottom_modules_import_nothing_of_the_project():
  """errors.py and exit_codes.py are what every folder may import: they import none of them."""
  for name in ("errors.py", "exit_codes.py"):
    found = _imports(os.path.join(REPO, name), set())
    assert not {i.split(".")[0] for i in found} & {"trainer", "model", "data", "experiments", "launch"}, found


def test_the_model_modules_import_each_other_without_a_cycle():
  """The Hugging Face layouts too: hf_llama.py and hf_moe.py build on hf_common.py, not on each other."""
  paths = glob.glob(os.path.join(REPO, "model", "*.py"))
  modules = {_module(p) for p in paths}
  edges = {_module(p): {i for i in _imports(p, modules) if i in modules} - {_module(p)} for p in paths}
  _assert_acyclic(edges, "import")
