"""Writes the docs' reference pages from the code, so that they cannot drift from it: every config key
from its declaration (trainer/config/trainer_keys.py, experiments/NAME_keys.py), the exit-code table
(exit_codes.py), the experiment contract (experiments/__init__.py) and every field a run writes
(trainer/observe/fields.py). `make docs` runs it before mkdocs; the pages are not committed (a fork's
own keys appear in its docs as it declares them), and tests/test_docs.py builds the docs with them.

  python docs/generate.py [DIR]    # writes DIR (docs/reference) /{config,exit-codes,contract,metrics}.md
"""

import dataclasses
import os
import sys

from markdown.extensions.toc import slugify

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import exit_codes  # noqa: E402
import experiments  # noqa: E402
from trainer import experiment as experiment_lib  # noqa: E402
from trainer.config import trainer_keys  # noqa: E402
from trainer.experiment import REQUIRED, Experiment  # noqa: E402
from trainer.observe import fields  # noqa: E402

OUT = os.path.join(REPO, "docs", "reference")
GENERATED = "<!-- Written by docs/generate.py from the code: edit the declarations, not this page. -->"
# A value no rule allows: its answer says what the rule allows.
_NOTHING = object()


def _cell(text: str) -> str:
  return str(text).replace("|", "\\|").replace("\n", " ")


def _resume(key) -> str:
  kind, why = key.on_resume.kind, key.on_resume.why
  return {"free": "free", "data": "data fingerprint"}.get(kind, f"{kind}: {why}")


def _table(declared: dict) -> list[str]:
  rows = ["| key | default | allowed | on resume | what it means |", "|---|---|---|---|---|"]
  for dotted, key in sorted(declared.items()):
    allowed = key.rule(_NOTHING) or ""
    cells = [
      f"`{dotted}`",
      f"`{_cell(repr(key.default))}`",
      _cell(allowed),
      _cell(_resume(key)),
      _cell(key.doc),
    ]
    rows.append(f"| {' | '.join(cells)} |")
  return rows


def config_page() -> str:
  lines = [
    "# Config keys",
    "",
    GENERATED,
    "",
    "Every key a config may set, declared once with its default, its rule (checked before anything is",
    "built: a mistake is one `error:` line), what resuming from a checkpoint with another value does",
    "(`free`: nothing; `changes`: a warning; `refused`: an `error:` unless `checkpoint.allow_changed_keys`",
    "names it; `data fingerprint`: the data position decides) and its meaning. Set one on the command line",
    "with `--config.KEY=VALUE`; a fork declares its own in `experiments/NAME_keys.py`.",
    "",
    "## The trainer's keys",
    "",
    *_table(trainer_keys.KEYS),
  ]
  for name in experiments.available():
    own = experiments.load_keys(name).KEYS
    lines += ["", f"## The `{name}` experiment's keys", "", *_table(own)]
  return "\n".join(lines) + "\n"


def exit_codes_page() -> str:
  return (
    "\n".join(
      [
        "# Exit codes",
        "",
        GENERATED,
        "",
        "What ended a process, whether the launchers (`launch/local.py`, the SLURM script, the Kubernetes",
        "JobSet) restart it, and what to do. `python -m exit_codes CODE` prints one row.",
        "",
        exit_codes.markdown(),
      ]
    )
    + "\n"
  )


def contract_page() -> str:
  rows = ["| name | required | default | what it is |", "|---|---|---|---|"]
  for f in dataclasses.fields(Experiment):
    if f.name == "module":
      continue
    required = f.name in REQUIRED
    default = f.default_factory() if f.default is dataclasses.MISSING and not required else f.default
    cells = [f"`{f.name}`", "yes" if required else "", "" if required else _cell(repr(default))]
    rows.append(f"| {' | '.join([*cells, _cell(f.metadata['doc'])])} |")
  intro = [
    "# The experiment contract",
    "",
    GENERATED,
    "",
    "An experiment module names its parts in one `EXPERIMENT = Experiment(...)` (trainer/experiment.py),",
    "which `trainer.experiment.load` reads; the optional ones take their default where it leaves them out.",
    "",
    *rows,
    "",
    "The keys beside it, and what the trainer guarantees in return (experiments/__init__.py):",
    "",
    "```text",
    experiments.__doc__.strip(),
    "```",
  ]
  return "\n".join(intro) + "\n"


def _title(kind: str) -> str:
  """A kind's heading: its anchor is what the fields whose values it declares link to."""
  rows = fields.ROWS[kind]
  if not rows.file:
    return f"`{kind}`"
  if rows.event is not None:
    where = "process " if rows.file == fields.PROCESS else ""
    return f'`"event": "{rows.event}"` {where}rows'
  return {"train": "Train rows", "eval": "Evaluation rows", "window": "Window rows"}.get(kind, "The summary")


def _anchor(kind: str) -> str:
  return "#" + slugify(_title(kind).replace("`", ""), "-")


def _fields_table(declared) -> list[str]:
  rows = ["| field | when | what it means |", "|---|---|---|"]
  for f in declared:
    doc = f.doc
    if f.of:
      doc += f" {'Each item' if f.each else 'Its keys'}: [{_title(f.of)}]({_anchor(f.of)})."
    cells = [f"`{f.name}`", _cell(f.when or "always"), _cell(doc)]
    rows.append(f"| {' | '.join(cells)} |")
  return rows


def _kind_section(kind: str) -> list[str]:
  rows = fields.ROWS[kind]
  lines = [f"### {_title(kind)}", "", rows.doc, "", *_fields_table(rows.fields)]
  if rows.also:
    when = f"when {rows.also_when}" if rows.also_when else "always"
    also = f"[{_title(rows.also).lower()}]({_anchor(rows.also)})"
    lines += ["", f"And, {when}: the fields of {also}, step and time excepted."]
  return [*lines, ""]


def metrics_page() -> str:
  legend = ["| in a name | stands for |", "|---|---|"]
  legend += [f"| `{name}` | {_cell(doc)} |" for name, doc in fields.PLACEHOLDERS.items()]
  lines = [
    "# Metrics a run writes",
    "",
    GENERATED,
    "",
    "Every field of `metrics.jsonl` (process 0), `processes/process_I.jsonl` (each process) and",
    "`summary.json`, declared once in `trainer/observe/fields.py` with its meaning;",
    "tests/test_metrics_reference.py trains a tiny run and checks that it writes these fields and no others.",
    "Where the files are: [What a run writes](outputs.md). A row's `event` names its kind; a row without",
    "one is a train or evaluation row (metrics.jsonl: a train row has `loss`) or a window's (a process's",
    "file). A field marked `always` is in every row of its kind. Upper-case words in a name stand for",
    "names the run chooses:",
    "",
    *legend,
    "",
  ]
  for file in (fields.METRICS, fields.PROCESS, fields.SUMMARY, ""):
    lines += [f"## `{file}`" if file else "## Nested values", ""]
    for kind, rows in fields.ROWS.items():
      if rows.file == file:
        lines += _kind_section(kind)
  lines += [
    "## The experiments' metrics",
    "",
    "What `METRIC` stands for in the experiments of this tree: the metrics their `loss_sums` return, as",
    "their `METRICS` declare them (a fork's metrics are `METRIC`s too, declared or not).",
    "",
  ]
  for name in experiments.available():
    own = experiment_lib.load(name).METRICS
    lines += [f"### `{name}`", ""]
    lines += _fields_table(own) if own else ["It declares no METRICS."]
    lines.append("")
  return "\n".join(lines)


PAGES = {
  "config.md": config_page,
  "exit-codes.md": exit_codes_page,
  "contract.md": contract_page,
  "metrics.md": metrics_page,
}


def main(out: str = OUT) -> None:
  os.makedirs(out, exist_ok=True)
  for name, page in PAGES.items():
    with open(os.path.join(out, name), "w") as f:
      f.write(page())


if __name__ == "__main__":
  main(*sys.argv[1:])
