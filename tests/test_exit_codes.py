"""One table of exit codes (exit_codes.py): the classification gives each class of error its code, and
the docs' runbook (docs/runbooks/a-host-died.md), the SLURM script and the Kubernetes JobSet say what
the table says."""

import errno
import os
import re
import subprocess
import sys

import pytest

import exit_codes
from launch.k8s import render as k8s
from tests.conftest import REPO
from tests.test_k8s_pathways import PATHWAYS
from tests.test_k8s_render import BASE
from trainer import cadence
from trainer.cluster import failures

USER, TRANSIENT, RESOURCES = exit_codes.USER_EXIT, exit_codes.TRANSIENT_EXIT, exit_codes.RESOURCES_EXIT


@pytest.mark.parametrize(
  "number, code",
  [
    # A limit of the machine: the same machine with the same limits fails the same way.
    (errno.ENOMEM, RESOURCES),
    (errno.EMFILE, RESOURCES),
    (errno.ENFILE, RESOURCES),
    # The network and the storage: transient (a dropped network mount is ENOTCONN).
    (errno.ENOTCONN, TRANSIENT),
    (errno.EHOSTUNREACH, TRANSIENT),
    (errno.ECONNREFUSED, TRANSIENT),
    (errno.EPIPE, TRANSIENT),
    (errno.ENOLCK, TRANSIENT),
    (errno.EIO, TRANSIENT),
    (errno.ENOSPC, TRANSIENT),  # A full disk: space freed elsewhere fixes it, as before.
    # A path the user gave.
    (errno.ENOENT, USER),
    (errno.EACCES, USER),
  ],
)
def test_each_class_of_os_error_gets_its_exit_code_alone_and_wrapped(number, code):
  error = OSError(number, os.strerror(number), "/runs/x/checkpoints")
  line, got = failures.error_line(error, None)
  assert got == code and "\n" not in line, (errno.errorcode[number], line)
  wrapped = RuntimeError("async save failed")  # As Orbax or Grain re-raise a worker thread's error.
  wrapped.__cause__ = error
  assert failures.error_line(wrapped, None)[1] == code, errno.errorcode[number]


def test_the_outermost_exception_with_a_class_decides():
  """XLA's out of memory raised while handling a missing file is out of memory, not the user's."""
  oom = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB")
  oom.__context__ = FileNotFoundError(errno.ENOENT, "No such file or directory", "/x")
  line, code = failures.error_line(oom, None)
  assert code == RESOURCES and "out of memory" in line
  too_many = failures.error_line(OSError(errno.EMFILE, "Too many open files"), "/runs/x")[0]
  assert "ulimit -n" in too_many


def test_a_dropped_mount_during_a_restore_is_not_damage():
  """trainer/checkpoint/store.py sets aside an unproven checkpoint whose read failed with no kind."""
  assert (
    failures.failure_kind(OSError(errno.ENOTCONN, "Transport endpoint is not connected")) == "environment"
  )
  assert failures.failure_kind(OSError(errno.ENOMEM, "Cannot allocate memory")) == "resources"
  assert failures.failure_kind(FileNotFoundError(errno.ENOENT, "missing")) is None  # Possibly damage.


def _markdown_rows(text: str, header: str) -> list[list[str]]:
  lines = text.splitlines()
  start = lines.index(header) + 2  # The header and its |---| line.
  rows = []
  for line in lines[start:]:
    if not line.startswith("|"):
      break
    rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
  return rows


def test_the_runbooks_tables_agree_with_the_exit_code_table():
  with open(os.path.join(REPO, "docs", "runbooks", "a-host-died.md")) as f:
    text = f.read()
  rows = _markdown_rows(text, exit_codes.markdown().splitlines()[0])
  expected = [[str(r.code), r.name, "yes" if r.restart else "no", r.hint] for r in exit_codes.TABLE]
  other = exit_codes.OTHER
  assert rows == [*expected, ["other", other.name, "yes" if other.restart else "no", other.hint]]
  # Each fault's exit codes are the table's, and its "restarted" cell says what the first one's row does.
  faults = _markdown_rows(text, "| fault | where | what happens | exit | restarted | work lost |")
  assert len(faults) > 10
  bound = f"up to {cadence._steps(cadence.lost_steps(1, 1))}"  # The tiers' worst case, copies every step.
  assert sum(lost.startswith(bound) for *_, lost in faults) >= 8
  for fault, _, _, exit_cell, restarted, lost in faults:
    assert lost, fault  # Each fault says how much work it costs.
    assert not lost.startswith("up to ") or lost.startswith(bound), (fault, lost)
    codes = [int(c) for c in re.findall(r"(?<![\w-])\d+", exit_cell)]
    assert all(c in exit_codes.BY_CODE or c == exit_codes.FAILED_EXIT for c in codes), fault
    if codes:
      row = exit_codes.BY_CODE.get(codes[0], exit_codes.OTHER)
      says = restarted.startswith("yes") if row.restart else restarted.startswith(("never", "not as is"))
      assert says, (fault, exit_cell, restarted)


@pytest.mark.parametrize("variant", [BASE, PATHWAYS], ids=["gpu", "pathways"])
def test_the_jobset_fails_on_exactly_the_codes_the_table_does_not_restart(variant):
  never = sorted(r.code for r in exit_codes.TABLE if not r.restart and r.code != exit_codes.FINISHED_EXIT)
  [jobset] = [o for o in k8s.render(**variant) if o["kind"] == "JobSet"]
  policies = [r["template"]["spec"].get("podFailurePolicy") for r in jobset["spec"]["replicatedJobs"]]
  values = [rule["onExitCodes"]["values"] for p in policies if p for rule in p["rules"]]
  assert values and all(sorted(v) == never for v in values), values


def _sbatch_ending(tmp_path, code: int) -> str:
  """Runs launch/slurm/train.sbatch's decision after srun, for one task that wrote `code`, with
  scontrol stubbed; returns its log."""
  with open(os.path.join(REPO, "launch/slurm/train.sbatch")) as f:
    script = f.read()
  ending = script[script.index("# srun returns one code for every task") :]
  bin_dir, workdir = tmp_path / "bin", tmp_path / "run"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "scontrol").write_text('#!/bin/sh\necho "scontrol $*"\n')
  (bin_dir / "scontrol").chmod(0o755)
  (workdir / "exit_codes").mkdir(parents=True, exist_ok=True)
  (workdir / "exit_codes" / "0").write_text(f"{code}\n")
  (workdir / "failure_restarts").unlink(missing_ok=True)
  env = dict(
    os.environ,
    PATH=f"{bin_dir}:{os.environ['PATH']}",
    WORKDIR=str(workdir),
    PY=sys.executable,
    SLURM_JOB_ID="7",
  )
  env.pop("MAX_RESTARTS", None)
  prelude = f'log() {{ echo "[sbatch] $*"; }}\nrequeue=""\nrc={code}\n'
  result = subprocess.run(
    ["bash", "-c", prelude + ending], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
  )
  return result.stdout + result.stderr


def test_the_sbatch_script_requeues_by_the_table_and_prints_its_hint(tmp_path):
  for row in [r for r in exit_codes.TABLE if r.code != exit_codes.FINISHED_EXIT] + [exit_codes.OTHER]:
    log = _sbatch_ending(tmp_path, row.code)
    if row.restart:
      assert "scontrol requeue 7" in log and "restart 1/3" in log, (row, log)
    else:
      line = f"not requeueing: a process exited {row.code} ({row.name}: {row.hint}); see its error: line"
      assert line in log and "scontrol" not in log, (row, log)
