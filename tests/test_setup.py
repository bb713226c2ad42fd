"""`make`'s set-up finds a Python 3.12+ (launch/find_python.sh) and remakes a .venv of an older one;
.ci/run names the root-only tests that skipped, from their markers (tests/needs_root.py)."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

FIND = os.path.join(REPO, "launch", "find_python.sh")


def _version(python: str) -> tuple[int, int] | None:
  try:
    out = subprocess.run(
      [python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True, timeout=30
    )
  except OSError:
    return None
  return tuple(map(int, out.stdout.split())) if out.returncode == 0 else None


def _old_python() -> str | None:
  for p in ("/usr/bin/python3", "/usr/bin/python3.11", "/usr/bin/python3.10"):
    if os.path.exists(p) and (v := _version(p)) and v < (3, 12):
      return p
  return None


def _exe(path, body: str) -> None:
  with open(path, "w") as f:
    f.write(f"#!/bin/sh\n{body}\n")
  os.chmod(path, 0o755)


def _find(bin_dir, **env) -> subprocess.CompletedProcess:
  base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(bin_dir)}
  return subprocess.run(["sh", FIND], env={**base, **env}, capture_output=True, text=True, timeout=60)


def test_find_python_takes_the_first_that_runs_then_pyenv_then_says_how(tmp_path):
  old = _old_python()
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  # pyenv's shims: present on the PATH, refusing without PYENV_VERSION.
  for name in ("python3.13", "python3.12"):
    _exe(bin_dir / name, f"echo 'pyenv: {name}: command not found' >&2; exit 127")
  _exe(bin_dir / "python3", f'exec {old or "false"} "$@"')  # An older python3, or one that fails.
  r = _find(bin_dir)
  assert r.returncode == 1 and r.stdout == "", r
  [line] = r.stderr.splitlines()  # One line, saying how to get one.
  assert line.startswith("error: the template needs Python 3.12 or newer") and "PYTHON=" in line, line

  # An interpreter installed under pyenv is found through `pyenv root`: the oldest 3.12+ that runs.
  root = tmp_path / "pyenv"
  versions = ("3.11.7", "3.12.0", "3.12.1", "3.13.0")
  for version in versions:
    (root / "versions" / version / "bin").mkdir(parents=True)
  if old:
    os.symlink(old, root / "versions" / "3.11.7" / "bin" / "python3")  # Runs, but too old.
  _exe(root / "versions" / "3.12.0" / "bin" / "python3", "exit 1")  # Installed but broken: skipped.
  for version in ("3.12.1", "3.13.0"):
    os.symlink(sys.executable, root / "versions" / version / "bin" / "python3")
  listing = "\\n".join(versions)
  _exe(bin_dir / "pyenv", f'[ "$1" = root ] && echo {root}; [ "$1" = versions ] && printf "{listing}\\n"')
  r = _find(bin_dir)
  assert r.returncode == 0 and r.stdout.strip() == str(root / "versions" / "3.12.1" / "bin" / "python3"), r

  # A python3.13 that runs wins over everything after it; PYTHON wins over all, and a bad one is refused.
  os.symlink(sys.executable, bin_dir / "python3.13.real")
  _exe(bin_dir / "python3.13", f'exec {bin_dir / "python3.13.real"} "$@"')
  assert _find(bin_dir).stdout.strip() == str(bin_dir / "python3.13")
  assert _find(bin_dir, PYTHON=sys.executable).stdout.strip() == sys.executable
  r = _find(bin_dir, PYTHON=str(bin_dir / "python3.12"))
  assert r.returncode == 1 and r.stderr.startswith("error: PYTHON=") and len(r.stderr.splitlines()) == 1, r


def test_a_venv_of_an_older_python_is_made_again(tmp_path):
  """`make -q setup` (is the set-up up to date?) with a stamp newer than the pins: a .venv of a
  Python 3.12+ is kept; one of an older Python, or without pip, is remade."""
  if shutil.which("make") is None:
    pytest.skip("no make on this machine")

  def up_to_date(python: str) -> bool:
    venv = tmp_path / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    # Without pip of its own but seeing the interpreter's: fast, and `import pip` works as in a real one.
    subprocess.run([python, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True)
    (venv / ".installed").touch()
    r = subprocess.run(["make", "-q", f"VENV={venv}", "setup"], cwd=REPO, capture_output=True, timeout=60)
    return r.returncode == 0

  base = getattr(sys, "_base_executable", sys.executable)
  assert up_to_date(base)
  if old := _old_python():
    assert not up_to_date(old)
  os.remove(tmp_path / "venv" / "bin" / "python")  # Half made: no interpreter.
  r = subprocess.run(["make", "-q", f"VENV={tmp_path / 'venv'}", "setup"], cwd=REPO, capture_output=True)
  assert r.returncode != 0


def test_make_train_installs_only_trainings_dependencies_and_make_test_adds_the_parity_extra(tmp_path):
  """`make train` installs the project alone (no test tools, no torch); `make test` adds the dev and
  parity extras (torch, transformers and lm-eval, for tests/test_hf_parity.py and test_lm_eval_parity.py)."""
  if shutil.which("make") is None:
    pytest.skip("no make on this machine")

  def installs(target: str) -> list[str]:
    r = subprocess.run(["make", "-n", f"VENV={tmp_path}", target], cwd=REPO, capture_output=True, text=True)
    return [line.split("constraints.txt ")[1] for line in r.stdout.splitlines() if "pip install" in line]

  assert installs("train") == ["."]
  assert installs("test") == [".", "'.[dev]'", "'.[dev,parity]'"]
  with open(os.path.join(REPO, "pyproject.toml")) as f:
    pyproject = f.read()
  dependencies = pyproject.split("dependencies = [")[1].split("]")[0]
  assert not any(name in dependencies for name in ("torch", "transformers", "lm_eval", "datasets"))


@pytest.mark.parametrize("skipped", [0, 2])
def test_ci_run_runs_make_test_and_then_names_the_root_only_tests_that_skipped(tmp_path, skipped):
  """.ci/run runs `make test` alone; the tests that need root and skipped (the run writes them to
  NEEDS_ROOT_SKIPS) come after it as WARNING lines on stderr, and none: nothing. make's exit status is
  .ci/run's. `id` and `make` are stand-ins on the PATH."""
  with open(os.path.join(REPO, ".ci", "run")) as f:
    assert "tests/test_" not in f.read()  # No list by hand: a new root-only test could be left off one.
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _exe(bin_dir / "id", "echo 1000")
  lines = [f"tests/test_x.py::test_{i}: cannot mount a tmpfs here (needs root)" for i in range(skipped)]
  writes = "".join(f'echo "{line}" >> "$NEEDS_ROOT_SKIPS"; ' for line in lines)
  _exe(bin_dir / "make", f'echo "make $*"; {writes}exit 3')
  env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
  r = subprocess.run([os.path.join(REPO, ".ci", "run")], env=env, capture_output=True, text=True, timeout=60)
  assert r.returncode == 3 and r.stdout == "make test\n", r
  if not skipped:
    assert r.stderr == "", r
    return
  head, *named = r.stderr.splitlines()
  assert head.startswith("WARNING: these tests need root and SKIPPED") and "uid 1000" in head, r.stderr
  assert named == [f"WARNING:   {line}" for line in lines], r.stderr


PROBE = """
import os

import pytest


@pytest.fixture(scope="module")
def namespaces():
  pytest.skip("network namespaces cannot be made here (needs root)")


@pytest.mark.needs_root
def test_marked_in_a_fixture(namespaces):
  pass


@pytest.mark.needs_root
def test_marked():
  pytest.skip("cannot mount a tmpfs here (needs root)")


@pytest.mark.needs_root
def test_marked_that_runs():
  assert "NEEDS_ROOT_SKIPS" not in os.environ  # Taken out: a pytest a test starts writes nothing.


def test_unmarked():
  pytest.skip("a 256 KiB tmpfs needs root and mount")


def test_skipped_for_another_reason():
  pytest.skip("this machine has nvidia-smi")
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one_process", "xdist"])
def test_root_only_skips_are_named_from_their_markers_and_an_unmarked_one_fails(tmp_path, workers):
  """tests/needs_root.py on a probe: the tests marked needs_root that skipped, and only those, are
  listed in the summary and written to NEEDS_ROOT_SKIPS (.ci/run's warnings); a skip that says root
  without the marker fails, so no root-only test can be left out of the list. Alike when xdist's
  workers run the tests (make test)."""
  (tmp_path / "test_probe.py").write_text(PROBE)
  listed = tmp_path / "skips"
  plugins = ["-p", "tests.needs_root", "-p", "no:cacheprovider", *workers]
  r = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", *plugins, "test_probe.py"],
    cwd=tmp_path,
    env={**os.environ, "PYTHONPATH": REPO, "NEEDS_ROOT_SKIPS": str(listed)},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 1 and "1 failed, 1 passed, 3 skipped" in r.stdout, r.stdout + r.stderr
  assert sorted(listed.read_text().splitlines()) == [
    "test_probe.py::test_marked: cannot mount a tmpfs here (needs root)",
    "test_probe.py::test_marked_in_a_fixture: network namespaces cannot be made here (needs root)",
  ]
  assert "needs root: 2 skipped, untested here" in r.stdout, r.stdout
  assert "test_probe.py::test_unmarked skipped for want of root" in r.stdout, r.stdout
  assert "without @pytest.mark.needs_root" in r.stdout, r.stdout
