"""A checkpoint's saved tree against the train state a restore fills in, read from the metadata before
any array is: a model or EMA change is a UserError naming what differs, never "damage" that would set
the checkpoint aside; a checkpoint written before the train state kept variables and an EMA apart
restores when the model has neither, and is refused, saying so, when it has one.
"""

import dataclasses
from collections.abc import Callable

import jax

from errors import UserError
from trainer.state import TrainState, path_keys

# The parts of the train state that follow the model and ema.decay, and what one leaf of each is.
_PARTS = {"params": "parameter", "variables": "variable", "ema": "averaged parameter"}


def paths_and_shapes(tree) -> dict[str, tuple]:
  """{'params/blocks/0/attn/wq': shape, ...} of a tree of arrays, shapes or metadata."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out["/".join(path_keys(path))] = tuple(leaf.shape)
  return out


def restore_target(step: int, saved, target: TrainState) -> tuple[object, Callable]:
  """(what to hand Orbax, restored -> TrainState) for checkpoint `step` whose state metadata is
  `saved`; raises UserError when the trees differ. Unreadable metadata (None): the target as is, and
  the restore itself judges."""
  if saved is None:
    return target, lambda restored: restored
  fields = [f.name for f in dataclasses.fields(TrainState)]
  missing = [f for f in fields if f not in saved.tree]
  filled = [f for f in missing if jax.tree.leaves(getattr(target, f))]
  if filled:
    raise UserError(
      f"checkpoint {step} was written before the train state kept {' and '.join(missing)} apart, and "
      f"this model has {'/'.join(filled)} to restore: resume it with the trainer that wrote it, or "
      "start a new --workdir"
    )
  _check_parts(step, paths_and_shapes(saved.tree), paths_and_shapes(target))  # Old trees too.
  if not missing:
    return target, lambda restored: restored
  # Nothing of the missing parts to fill in: restore the old tree, and add them empty.
  present = {f: getattr(target, f) for f in fields if f in saved.tree}
  return present, lambda restored: TrainState(**restored, **{f: getattr(target, f) for f in missing})


def _check_parts(step: int, saved: dict, wanted: dict) -> None:
  for part, what in _PARTS.items():
    have, want = (
      {p[len(part) + 1 :] for p in paths if p.startswith(part + "/")} for paths in (saved, wanted)
    )
    for name in sorted(have & want):
      if saved[f"{part}/{name}"] != wanted[f"{part}/{name}"]:
        raise UserError(
          f"checkpoint {step}: {what} {name} has shape {saved[f'{part}/{name}']} but the model now has "
          f"{wanted[f'{part}/{name}']}; restore the model config or use a new --workdir"
        )
    if part == "ema" and bool(have) != bool(want):
      now, then = ("0", "above 0") if have else ("above 0", "0")
      raise UserError(
        f"checkpoint {step} was saved with ema.decay {then}, and it is {now} now: the checkpoint "
        f"{'holds an' if have else 'has no'} average of the params; set ema.decay as it was, or use a new "
        "--workdir"
      )
    for kind, which in (("has no", want - have), ("has a", have - want)):
      if which:
        hint = "the model has none by that name" if kind == "has a" else "the model needs it"
        raise UserError(
          f"checkpoint {step} {kind} {what} {min(which)} ({hint}); restore the model config or use a new "
          "--workdir"
        )
