"""Every field a run writes is declared in trainer/observe/fields.py, which docs/reference/metrics.md is
written from, and every declared field is written: one tiny run (evaluations, a hook, an evaluator and
a profile window on) and the rows a restart and a rollback write, checked both ways. A field added to a
row without its line there fails here; so does a declared field no run writes any more."""

import importlib.util
import itertools
import os
import re
import types

from experiments import lm
from tests.conftest import REPO, patch_experiment, read_jsonl, tiny_config
from trainer import rundir
from trainer.checkpoint import restore
from trainer.hooks import Evaluator, Hook
from trainer.observe import fields, recovery_time
from trainer.train import train

# Declared fields this run leaves out, and why; every other one must be in what it wrote.
NOT_HERE = {
  ("train", "mfu"): "logical CPU devices have no peak",
  ("train", "stragglers"): "one process",
  ("startup", "restore"): "a fresh run: nothing restored",
  ("startup", "first_step_check"): "tiny_config turns checks.first_step off",
  **{
    ("eval", f.name): "no EMA, no named held-out sets"
    for f in fields.ROWS["eval"].fields
    if "SET" in f.name or "NAME" in f.name
  },
}


# Reading rows against the declaration.


def kind_of(file: str, row: dict) -> str | None:
  """Which of fields.ROWS a row of `file` is: by its event; without one, a train row (it has a loss) or an
  evaluation's in metrics.jsonl, a window's in a process's file. None: no declared kind."""
  event = row.get("event")
  if event is not None:
    return next((k for k, r in fields.ROWS.items() if r.file == file and r.event == event), None)
  if file == fields.METRICS:
    return "train" if "loss" in row else "eval"
  return {fields.PROCESS: "window", fields.SUMMARY: "summary"}.get(file)


def declared(kind: str, with_also: bool = True) -> tuple:
  rows = fields.ROWS[kind]
  if not rows.also or not with_also:
    return rows.fields
  return rows.fields + tuple(f for f in fields.ROWS[rows.also].fields if f.name not in ("step", "time"))


def _values(placeholder: str, names: dict) -> tuple[str, ...]:
  return tuple(fields.FIXED.get(placeholder, names.get(placeholder, ())))


def expand(name: str, names: dict) -> list[str]:
  """Every key a field's name stands for, given `names` {placeholder: the run's names}; a placeholder
  without names stands for none."""
  parts = re.split(r"([A-Z]+)", name)
  choices = [[p] if i % 2 == 0 else _values(p, names) for i, p in enumerate(parts)]
  return ["".join(c) for c in itertools.product(*choices)]


def field_for(kind: str, key: str, names: dict):
  """The field of `kind` that declares `key`, or None."""
  return next((f for f in declared(kind) if key in expand(f.name, names)), None)


def _items(f, value) -> list:
  if not f.of or value is None:
    return []
  if not f.each:
    return [value]
  return list(value.values()) if isinstance(value, dict) else list(value)


def walk(kind: str, row: dict, names: dict, path: str = ""):
  """(key, its field or None) for every key of a `kind` row, a nested value's as FIELD.KEY."""
  for key, value in row.items():
    f = field_for(kind, key, names)
    yield path + key, f
    for item in _items(f, value) if f is not None else ():
      yield from walk(f.of, item, names, f"{path}{key}.")


def undeclared(kind: str, row: dict, names: dict) -> list[str]:
  """The keys of a `kind` row that no field declares (a nested value's as FIELD.KEY)."""
  return [key for key, f in walk(kind, row, names) if f is None]


def missing(kind: str, row: dict, names: dict) -> list[str]:
  """The keys of the fields every `kind` row has (no `when`) that this one lacks (nested: FIELD.KEY)."""
  always = [f for f in declared(kind, with_also=not fields.ROWS[kind].also_when) if not f.when]
  out = []
  for f in always:
    for key in expand(f.name, names):
      if key not in row:
        out.append(key)
        continue
      for item in _items(f, row[key]):
        out += [f"{key}.{k}" for k in missing(f.of, item, names)]
  return out


def _rows_a_restart_and_a_rollback_write(monkeypatch) -> list[dict]:
  """A recovery row (launch/local.py's LAUNCH_RECOVERY) and a rollback's event, made as the loop makes
  them, without the restart or the NaN."""
  info = {"restart": 1, "cause": "killed by SIGKILL", "process": 1, "processes": 2, "died_at": 100.0}
  info["ended_at"] = 101.0
  startup = {"imports": 1.0, "build": 1.0, "restore": 1.0, "compile": 1.0}
  recovery = recovery_time.row(info, 102.0, startup, 110.0, step=4)
  monkeypatch.setattr(
    restore, "restore_or_init", lambda *a, **k: types.SimpleNamespace(state=types.SimpleNamespace(step=2))
  )
  ckpt = types.SimpleNamespace(wait=lambda: None)
  rollback = restore.roll_back(ckpt, None, None, None, None, bad=4, batch_offset=0, now=120.0).event
  return [recovery, rollback]


def test_a_run_writes_the_declared_fields_and_no_others(tmp_path, monkeypatch):
  metrics = set()  # What METRIC stands for: the names the experiment's loss_sums returned.
  loss_sums = lm.EXPERIMENT.loss_sums

  def recording(model, batch, rng=None, config=None):
    total, count, sums = loss_sums(model, batch, rng, config)
    metrics.update(sums)
    return total, count, sums

  def probe(ctx):
    ctx.writer.scalar("value", 1.0)

  patch_experiment(
    monkeypatch,
    lm,
    loss_sums=recording,
    hooks=lambda config: [Hook("probe", probe, every=3)],
    evaluators=lambda config: [Evaluator("task", lambda ctx: {"score": 1.0})],
  )
  workdir = str(tmp_path)
  config = tiny_config(eval_every=3, **{"profile.start_step": 1, "profile.steps": 1})
  summary = train(config, workdir)

  names = {"UNIT": [lm.UNIT], "METRIC": sorted(metrics), "TASK": ["task"], "SCORE": ["score"]}
  names |= {"HOOK": ["probe"], "KEY": ["value"]}
  written = [(fields.METRICS, r) for r in read_jsonl(rundir.metrics(workdir))]
  written += [(fields.PROCESS, r) for r in read_jsonl(rundir.process_log(workdir, 0))]
  written += [(fields.SUMMARY, summary)]
  written += [(fields.METRICS, r) for r in _rows_a_restart_and_a_rollback_write(monkeypatch)]

  problems, seen = [], set()
  for file, row in written:
    kind = kind_of(file, row)
    if kind is None:
      problems.append(f"{file}: a row of no declared kind: {row}")
      continue
    problems += [f"{file}, {kind} row: {key} is not declared" for key in undeclared(kind, row, names)]
    problems += [f"{file}, {kind} row: {key} is missing" for key in missing(kind, row, names)]
    seen |= {id(f) for _, f in walk(kind, row, names) if f is not None}
  problems = list(dict.fromkeys(problems))  # Once each, not once per row or device.
  assert problems == [], "\n".join(problems)
  kinds = {kind_of(file, row) for file, row in written}
  assert kinds >= {"train", "eval", "start", "hook", "process_start", "window", "checkpoint", "profile"}
  unseen = [
    (kind, f.name)
    for kind, rows in fields.ROWS.items()
    for f in rows.fields
    if id(f) not in seen and (kind, f.name) not in NOT_HERE
  ]
  assert unseen == [], f"declared, but this run wrote none: {unseen}"
  # The experiment's own metrics are declared too (the tiny LM's: accuracy).
  lm_metrics = {k for f in lm.EXPERIMENT.METRICS for k in expand(f.name, {})}
  assert metrics and metrics <= lm_metrics, metrics


def test_a_field_nobody_declared_is_found():
  row = {"step": 1, "time": 0.0, "event": "start", "processes": 1, "new_field": 2}
  assert undeclared(kind_of(fields.METRICS, row), row, {}) == ["new_field"]
  assert missing("start", {"step": 1, "event": "start"}, {}) == ["time", "processes"]


def test_the_metrics_page_lists_every_declared_field():
  spec = importlib.util.spec_from_file_location("generate", os.path.join(REPO, "docs", "generate.py"))
  generate = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(generate)
  page = generate.metrics_page()
  for kind, rows in fields.ROWS.items():
    assert all(f"| `{f.name}` |" in page for f in rows.fields), kind
