"""The docs tree (mkdocs.yml, docs/): it builds with --strict, so a broken link or a page left out of
the navigation fails here, and its reference pages, written from the code by docs/generate.py, list
every declared config key, every exit code and the experiment contract."""

import dataclasses
import os
import shutil
import subprocess
import sys

import exit_codes
import experiments
from tests.conftest import REPO
from trainer.config import trainer_keys
from trainer.experiment import Experiment


def test_the_docs_build_strictly_with_a_reference_written_from_the_code(tmp_path):
  shutil.copytree(os.path.join(REPO, "docs"), tmp_path / "docs", ignore=shutil.ignore_patterns("reference"))
  shutil.copytree(
    os.path.join(REPO, "docs", "reference"),
    tmp_path / "docs" / "reference",
    ignore=shutil.ignore_patterns("config.md", "exit-codes.md", "contract.md"),
  )
  shutil.copy(os.path.join(REPO, "mkdocs.yml"), tmp_path)
  env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
  run = lambda *argv: subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # noqa: E731
  r = run(sys.executable, os.path.join(REPO, "docs", "generate.py"), str(tmp_path / "docs" / "reference"))
  assert r.returncode == 0, r.stderr
  r = run(sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site"))
  assert r.returncode == 0, r.stdout + r.stderr
  assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()

  config = (tmp_path / "docs" / "reference" / "config.md").read_text()
  declared = dict(trainer_keys.KEYS)
  for name in experiments.available():
    declared |= experiments.load_keys(name).KEYS
  assert [k for k in declared if f"| `{k}` |" not in config] == []
  codes = (tmp_path / "docs" / "reference" / "exit-codes.md").read_text()
  assert [r.code for r in exit_codes.TABLE if f"\n| {r.code} | {r.name} |" not in codes] == []
  contract = (tmp_path / "docs" / "reference" / "contract.md").read_text()
  assert all(f"`{f.name}`" in contract for f in dataclasses.fields(Experiment) if f.name != "module")


def test_a_broken_link_fails_the_build(tmp_path):
  """--strict is what makes the test above mean anything: a link to a missing page must fail. (With
  --quiet, MkDocs 1.6 counts no warnings and --strict passes anything: neither the test nor make docs
  passes it.)"""
  shutil.copytree(os.path.join(REPO, "docs"), tmp_path / "docs")
  shutil.copy(os.path.join(REPO, "mkdocs.yml"), tmp_path)
  subprocess.run(
    [sys.executable, os.path.join(REPO, "docs", "generate.py"), str(tmp_path / "docs" / "reference")],
    check=True,
  )
  with open(tmp_path / "docs" / "index.md", "a") as f:
    f.write("\nSee [a page that is not there](guides/nowhere.md).\n")
  r = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
    cwd=tmp_path,
    env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode != 0 and "nowhere.md" in r.stdout + r.stderr, r.stdout + r.stderr
