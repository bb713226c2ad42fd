"""A config key, declared once: its default, its one-line meaning, its rule, and what resuming from a
checkpoint with another value does. The config, the rules and the resume policy are derived from the
declarations (trainer/config/trainer_keys.py for the trainer's keys, experiments/NAME_keys.py for an
experiment's), so a key cannot exist without its rule and its resume class.

What resuming with a changed value does, one class per key:
  FREE          how the run is executed or reported, never what it optimizes (mesh, logging, ...):
                resumes silently.
  DATA          the experiment's data keys: the data fingerprint in the checkpoint's data position
                decides (`data.allow_changed_data`), so they are not judged twice.
  changes(what) accepted, with one warning saying what differs from the resumed step on.
  refused(why)  changes which examples later steps see or what is trained: an `error:` names the key;
                `checkpoint.allow_changed_keys=KEY,...` accepts it anyway, with a warning.
"""

import dataclasses

import ml_collections

from trainer.config.rules import Rule


@dataclasses.dataclass(frozen=True)
class Resume:
  kind: str  # "free", "data", "changes" or "refused".
  why: str = ""  # What differs ("changes"), or why it is refused ("refused").


def changes(what: str) -> Resume:
  return Resume("changes", what)


def refused(why: str) -> Resume:
  return Resume("refused", why)


FREE = Resume("free")
DATA = Resume("data")
MODEL = changes("the model computes differently")  # The usual class of model.* keys.
OPTIMIZER = changes("the optimizer's updates differ")  # ... and of optimizer.* keys.


@dataclasses.dataclass(frozen=True)
class Key:
  default: object
  rule: Rule
  on_resume: Resume
  doc: str  # One line: what the key means.
  # Whether the value can shape the compiled train step: checks.first_step's record of a passed program
  # is keyed by every such key's value (trainer/checks/checked_programs.py), since XLA prints a large
  # constant as {...} and two programs can fingerprint alike. False only where it never can.
  program: bool = True

  def __post_init__(self):
    if not callable(self.rule) or not isinstance(self.on_resume, Resume) or not self.doc.strip():
      raise TypeError(f"Key({self.default!r}): needs a rule, a resume class (keys.FREE, ...) and a doc line")
    if (allowed := self.rule(self.default)) is not None:
      raise ValueError(f"Key({self.default!r}): its default breaks its own rule ({allowed})")


def to_config(declared: dict[str, Key]) -> ml_collections.ConfigDict:
  """The nested config of dotted `declared` keys, at their defaults (unlocked)."""
  c = ml_collections.ConfigDict()
  for dotted, key in declared.items():
    node = c
    *path, leaf = dotted.split(".")
    for part in path:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    node[leaf] = key.default
  return c
