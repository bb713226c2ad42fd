"""The fault matrix: {restore, save, data read, metrics write} x {out of memory, EIO, ENOSPC, timeout,
truncated or altered file}, injected where the fault really arrives (Orbax's restore, Orbax's
background writer thread, the ArrayRecord reader, the kernel's /dev/full, the files themselves).

Every cell ends as the failure table (docs/runbooks/a-host-died.md) says: the documented exit code and one
line (trainer/cluster/failures.py, what main.py prints), no checkpoint renamed or deleted unless proven
damaged, no history of the kept steps lost, and a rerun without the fault continues bit for bit from the
newest whole checkpoint. Cells tested elsewhere: restore x out of memory and EIO, and a state too large for
the devices (tests/test_checkpoint_recovery.py), restore x an altered byte (the same file); metrics write x
ENOSPC on a real full tmpfs (tests/test_cli_errors.py: the disk fills after checkpoint 2, and the resumed
run's first write is its rewrite of metrics.jsonl), metrics x a line torn by a kill (tests/test_read_back.py).
Cells that cannot happen are left out: a save or a metrics write reads no file that could be truncated; data
read x ENOSPC (reads take no space)."""

import errno
import json
import os
import time

import jax
import numpy as np
import pytest

from data import prepare
from tests.conftest import tiny_config, train_losses
from trainer.cluster import failures
from trainer.train import train

STEPS = 8
TIMEOUT = ValueError("DEADLINE_EXCEEDED: tensorstore read timed out")  # As tensorstore raises one.


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  (root / "a.txt").write_bytes(bytes(range(32, 127)) * 40)
  prepare.prepare([str(root / "a.txt")], str(root / "data"), 16, records_per_shard=64)
  return str(root / "data")


def _cfg(data):
  overrides = {"data.source": "arrayrecord", "data.path": data, "model.vocab_size": 258}
  return tiny_config(steps=STEPS, **{"checkpoint.every": 2, **overrides})


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("straight"))
  train(_cfg(data), workdir)
  return train_losses(workdir)


def _orbax_restore_raises(fault):
  import orbax.checkpoint as ocp

  def restore(self, step, args=None, **kw):
    raise fault

  return lambda m, workdir: m.setattr(ocp.CheckpointManager, "restore", restore)


def _orbax_writer_raises(fault):
  """Orbax's background thread fails writing checkpoint 6 (its data item), as a failing disk would."""
  from trainer.checkpoint import store

  handlers = store.Checkpoints.item_handlers

  def failing():
    out = handlers()
    write = out["data"]._save_fn

    async def fail_at_6(x, directory):
      if "/6" in str(directory):
        raise fault
      await write(x, directory)

    out["data"]._save_fn = fail_at_6
    return out

  return lambda m, workdir: m.setattr(store.Checkpoints, "item_handlers", staticmethod(failing))


def _reader_raises(fault):
  """The ArrayRecord library's reads fail from the resumed run's first batch on."""
  from array_record.python.array_record_data_source import ArrayRecordDataSource

  def read(self, index):
    raise fault

  return lambda m, workdir: m.setattr(ArrayRecordDataSource, "__getitem__", read)


def _truncated_array_file(m, workdir):
  """Checkpoint 4's largest array file loses its second half (a torn copy, a failing disk)."""
  state = os.path.join(workdir, "checkpoints", "4", "state")
  files = [os.path.join(r, n) for r, _, names in os.walk(state) for n in names if "/d/" in r + "/"]
  path = max(files, key=os.path.getsize)
  os.truncate(path, os.path.getsize(path) // 2)


MATRIX = {
  # cell: (inject, exit code or None for a run that falls back and finishes, words in the line)
  "restore x ENOSPC": (
    _orbax_restore_raises(OSError(errno.ENOSPC, "No space left on device")),
    3,
    "left as is",
  ),
  "restore x timeout": (_orbax_restore_raises(TIMEOUT), 3, "DEADLINE_EXCEEDED"),
  "restore x truncated file": (_truncated_array_file, None, "checkpoint 4 is damaged"),
  "save x out of memory": (_orbax_writer_raises(MemoryError("host allocation failed")), 5, "out of memory"),
  "save x EIO": (_orbax_writer_raises(OSError(errno.EIO, "Input/output error")), 3, "(EIO)"),
  "save x ENOSPC": (
    _orbax_writer_raises(OSError(errno.ENOSPC, "No space left on device")),
    3,
    "no space left",
  ),
  "save x timeout": (_orbax_writer_raises(TimeoutError("write deadline exceeded")), 3, "TimeoutError"),
  "data read x out of memory": (_reader_raises(MemoryError("cannot allocate")), 5, "out of memory"),
  "data read x EIO": (_reader_raises(OSError(errno.EIO, "Input/output error")), 3, "(EIO)"),
  "data read x timeout": (_reader_raises(TimeoutError("read timed out")), 3, "TimeoutError"),
}


@pytest.fixture(scope="module")
def four_steps(data, tmp_path_factory):
  """A run stopped at step 4 (checkpoints 2 and 4), copied for each cell: a run's files hold no
  absolute paths, so a copy resumes as the original would."""
  workdir = str(tmp_path_factory.mktemp("four_steps"))
  train(_cfg(data), workdir, stop_after=4)
  return workdir


@pytest.mark.parametrize("cell", list(MATRIX))
def test_fault_matrix(cell, data, straight, four_steps, tmp_path, monkeypatch, capsys):
  import shutil

  inject, code, words = MATRIX[cell]
  workdir = str(tmp_path / "run")
  shutil.copytree(four_steps, workdir)
  kept = {r["step"]: r for r in _rows(workdir) if "loss" in r}
  with monkeypatch.context() as m:
    inject(m, workdir)
    if code is None:  # Proven damage: reported, set aside, and the run goes on from checkpoint 2.
      train(_cfg(data), workdir)
      assert words in capsys.readouterr().out
      assert any(n.startswith("damaged-4-") for n in os.listdir(os.path.join(workdir, "checkpoints")))
      assert train_losses(workdir) == straight
      return
    with pytest.raises(BaseException) as e:
      train(_cfg(data), workdir)
  line, exit_code = failures.error_line(e.value, workdir) or (f"unclassified: {e.value!r}", 1)
  assert exit_code == code and words in line and "\n" not in line, (cell, line)
  names = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  assert [n for n in names if n.isdigit()][:2] == ["2", "4"] and not any("damaged" in n for n in names)
  rows = {r["step"]: r for r in _rows(workdir) if "loss" in r}
  assert all(rows.get(s) == r for s, r in kept.items()), cell  # The kept steps' history is whole.
  _settled(os.path.join(workdir, "checkpoints"))
  train(_cfg(data), workdir)  # The fault gone: the same command.
  assert train_losses(workdir) == straight, cell


def _settled(directory, quiet_s=1.0, timeout_s=30.0):
  """Until nothing under `directory` changes for `quiet_s`: tensorstore's writer threads of a save
  that failed in another item go on in this process (a real run's process has exited by then)."""

  def size(path):
    try:
      return os.path.getsize(path)
    except FileNotFoundError:  # Removed by a writer thread since the walk: still changing.
      return -1

  listing = lambda: sorted((r, n, size(os.path.join(r, n))) for r, _, ns in os.walk(directory) for n in ns)
  deadline, last, since = time.time() + timeout_s, None, time.time()
  while time.time() < deadline:
    now = listing()
    if now != last:
      last, since = now, time.time()
    elif time.time() - since >= quiet_s:
      return
    time.sleep(0.1)


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_the_classification_reads_the_cause_through_library_wrappers():
  """An OSError or a status word inside what a library re-raised decides, as it would alone."""
  wrapped = RuntimeError("async save failed")
  wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
  assert failures.error_line(wrapped, None)[1] == failures.TRANSIENT_EXIT
  oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB")
  assert failures.error_line(oom, None)[1] == failures.RESOURCES_EXIT
  assert failures.error_line(ValueError("a bug"), None) is None  # Unclassified: its traceback reports it.
  np.testing.assert_equal(failures.error_line(OSError(errno.EACCES, "denied", "/x"), None)[1], 2)


def test_data_read_x_truncated_shard_is_a_user_error_naming_it(data, straight, tmp_path):
  """A shard cut short (a torn copy of the data set): one line naming it and what to do, exit 2 (a
  restart would read the same bytes), the run's files untouched; with the shard whole again the same
  command continues bit for bit."""
  import shutil

  copy, workdir = str(tmp_path / "data"), str(tmp_path / "run")
  shutil.copytree(data, copy)
  train(_cfg(copy), workdir, stop_after=4)
  shard = os.path.join(copy, sorted(n for n in os.listdir(copy) if n.startswith("train"))[0])
  os.truncate(shard, os.path.getsize(shard) // 2)
  before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  with pytest.raises(BaseException) as e:
    train(_cfg(copy), workdir)
  line, code = failures.error_line(e.value, workdir)
  assert code == 2 and os.path.basename(shard) in line and "re-run" in line, line
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before
  shutil.copy(os.path.join(data, os.path.basename(shard)), shard)
  train(_cfg(copy), workdir)
  assert train_losses(workdir) == straight
