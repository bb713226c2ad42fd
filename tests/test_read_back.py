"""Files the project reads back, incomplete or torn: one `error:` line naming what is missing (or the
row skipped, where a kill can tear it), never a KeyError or AttributeError from deep inside."""

import json
import subprocess
import sys

import pytest

from data import arrayrecord, prepare
from errors import UserError
from launch import restart_policy
from tests.conftest import REPO, run_main
from trainer import rundir
from trainer.checkpoint import store
from trainer.observe import metrics


def _prepared(tmp_path):
  (tmp_path / "a.txt").write_bytes(b"A few words of text for a tiny data set. " * 40)
  out = tmp_path / "data"
  prepare.prepare([str(tmp_path / "a.txt")], str(out), 16)
  return out


def _edit_metadata(directory, edit):
  path = directory / prepare.METADATA
  metadata = json.loads(path.read_text())
  edit(metadata)
  path.write_text(json.dumps(metadata))


def test_metadata_with_the_right_version_but_a_key_missing_is_one_error_line_naming_it(tmp_path):
  data = _prepared(tmp_path)
  _edit_metadata(data, lambda m: m.pop("seq_len"))
  result = run_main(
    "--config=configs/smoke_cpu.py:tiny",
    f"--workdir={tmp_path / 'run'}",
    "--cpu_devices=1",
    "--config.data.source=arrayrecord",
    f"--config.data.path={data}",
    "--config.data.seq_len=16",
    "--config.model.vocab_size=258",
  )
  assert result.returncode == 2, result.stdout + result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "has no 'seq_len'" in errors[0] and "data.prepare" in errors[0], result.stderr
  assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
  "edit, named",
  [
    (lambda m: m["num_records"].pop("eval"), "num_records has no 'eval'"),
    (lambda m: m.update(shards=[]), "shards holds a list, not a JSON object"),
    (lambda m: [m.pop(k) for k in ("pad_id", "fingerprint")], "has no 'pad_id' (nor fingerprint)"),
  ],
)
def test_every_part_of_metadata_the_reader_uses_is_checked(tmp_path, edit, named):
  data = _prepared(tmp_path)
  _edit_metadata(data, edit)
  with pytest.raises(UserError, match=named.replace("(", r"\(").replace(")", r"\)")):
    arrayrecord.load_metadata(str(data))


def test_a_data_position_missing_a_key_names_it():
  saved = {"version": store.DATA_POSITION_VERSION, "step": 4, "next_batch": 4, "num_records": 9}
  with pytest.raises(UserError, match="checkpoint 4's data position has no 'batch_offset'"):
    store.check_data_position(saved, 4, comp=None, allow_changed_data=False)
  with pytest.raises(UserError, match="has no 'version'"):
    store.check_data_position({}, 4, comp=None, allow_changed_data=False)


def test_torn_or_foreign_rows_are_skipped_where_a_kill_can_leave_them(tmp_path):
  """metrics.jsonl after a kill, or edited: a torn line, a list, a number. A resume's truncation keeps
  every whole row and drops only those; the launcher's and the recovery row's readers skip them."""
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": 1, "loss": 2.0}, {"step": 2, "event": "recovery"}, {"step": 3, "loss": 1.0}]
  path.write_text(f'{json.dumps(rows[0])}\n[1, 2]\n7\n{json.dumps(rows[1])}\n{json.dumps(rows[2])}\n{{"st')
  assert rundir.read_jsonl(str(path)) == rows
  metrics.truncate_jsonl(str(path), after_step=2)
  assert rundir.read_jsonl(str(path)) == rows[:2] and path.read_text().count("\n") == 2
  (tmp_path / "processes").mkdir()
  (tmp_path / "processes" / "process_0.jsonl").write_text('["start"]\n"x"\n')
  assert restart_policy.past_startup(str(tmp_path), 0, since=0) is False
  for bad in ("[1]", "{", '"text"'):
    (tmp_path / "summary.json").write_text(bad)
    assert rundir.read_json_object(str(tmp_path / "summary.json")) is None


def test_the_report_names_a_row_without_its_step_in_one_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"loss": 1.5}\n')
  (tmp_path / "summary.json").write_text("[]")  # Not an object: read as no summary.
  result = subprocess.run(
    [sys.executable, "-m", "trainer.observe.report", f"--workdir={tmp_path}"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode == 1, result.stdout + result.stderr
  assert (
    result.stderr.strip()
    == f"error: {tmp_path}/metrics.jsonl line 2 has no 'step'; the trainer did not write this row: remove it"
  )
