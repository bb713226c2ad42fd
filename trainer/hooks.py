"""Periodic work a fork adds beside training without opening trainer/: sampling a few generations,
logging an image, an extra metric, a downstream evaluation. The experiment's optional
`hooks(config) -> list[Hook]` names them (experiments/__init__.py); the loop runs each due one after
the step's row, save and evaluation, in the clock's "hooks" phase (goodput books it apart).

A Hook runs every `every` steps and/or about every `every_s` seconds (on logging steps, decided by
process 0 a window ahead: trainer/cadence.py), on every process (`on="all"`: collectives allowed, the
state as the devices hold it) or on process 0 only (`on="process_0"`: the state gathered to host
copies on every process first, since process 0 cannot read other processes' shards). What it writes
through `ctx.writer` lands in metrics.jsonl (one `"event": "hook"` row per run of a hook, keys
`NAME/KEY`) and TensorBoard; images also as PNGs under WORKDIR/hooks/NAME/. A hook that raises ends
the run with one `error:` line naming it (exit 8, never restarted), after the step it ran at is saved:
every process agrees first that it failed, so all of them save and stop together.

An Evaluator (the experiment's optional `evaluators(config)`) is run the same way by evaluation
(trainer/evaluate.py) at every evaluation, for each weight set, and returns its metrics for the
evaluation's row instead of writing them.
"""

import dataclasses
import os
import re
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

import exit_codes
from errors import UserError
from trainer.cadence import ByClock, itstime
from trainer.cluster import multihost


@dataclasses.dataclass(frozen=True)
class Hook:
  name: str  # Unique; names the metrics (NAME/KEY) and the error line.
  fn: Callable[["HookContext"], None]
  every: int = 0  # Steps; 0: not by steps.
  every_s: float = 0.0  # Seconds, on logging steps; 0: not by the clock.
  on: str = "all"  # "all" processes (collectives allowed) or "process_0" (host copies, process 0 only).


@dataclasses.dataclass(frozen=True)
class Evaluator:
  """A named evaluation beside eval_loss (a downstream task, say), run at every evaluation (eval_every,
  the final step, --mode=eval) on each weight set evaluation scores: fn(ctx) -> {metric: number}, in
  the evaluation's row as eval_NAME_METRIC (eval_ema_NAME_METRIC for the params' average). ctx as a
  hook's, with ctx.params the set's weights, ctx.ema {} and ctx.writer None."""

  name: str  # A word (letters, digits, _): names the metrics and the error line.
  fn: Callable[["HookContext"], dict]
  on: str = "all"  # As Hook.on.


@dataclasses.dataclass
class HookContext:
  step: int
  params: Any  # The weights: arrays on the devices (on="all") or host copies (on="process_0").
  variables: Any  # The model's other variables, likewise.
  ema: Any  # The params' moving average, likewise ({}: ema.decay is 0).
  config: Any
  writer: "HookWriter | None"
  model_def: Any  # state.ModelDef: `ctx.model()` merges the weights back into the model.

  def model(self, ema: bool = False):
    """The model (nnx) with these weights, or with their moving average."""
    return self.model_def.merge(self.ema if ema else self.params, self.variables)


class HookWriter:
  """Scalars, text and images of one run of a hook: one metrics row, and TensorBoard (process 0)."""

  def __init__(self, name: str, step: int, log, workdir: str):
    self._name, self._step, self._log, self._workdir = name, step, log, workdir
    self.row: dict = {}  # NAME/KEY -> a number, a text or an image's path under the workdir.
    self._board: dict = {"scalars": {}, "texts": {}, "images": {}}

  def scalar(self, key: str, value: float) -> None:
    self.row[self._key(key)] = self._board["scalars"][self._key(key)] = float(value)

  def text(self, key: str, value: str) -> None:
    self.row[self._key(key)] = self._board["texts"][self._key(key)] = str(value)

  def image(self, key: str, image) -> None:
    """`image`: [H, W] or [H, W, 3 or 4], floats in [0, 1] or uint8; also a PNG under WORKDIR/hooks/."""
    image = np.asarray(image)
    if not self._log.is_main:
      return
    from matplotlib import image as mpimg

    folder = os.path.join(self._workdir, "hooks", self._name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{key.replace('/', '_')}_step{self._step}.png")
    mpimg.imsave(path, image, cmap="gray" if image.ndim == 2 else None)
    self.row[self._key(key)] = os.path.relpath(path, self._workdir)
    self._board["images"][self._key(key)] = image

  def _key(self, key: str) -> str:
    return f"{self._name}/{key}"

  def flush(self) -> None:
    if self.row:
      self._log.write(
        {"step": self._step, "time": time.time(), "event": "hook", "hook": self._name, **self.row}
      )
      self._log.write_tensorboard(self._step, **self._board)


class HookFailed(UserError):
  """A hook raised: the fork's code, which a restart would run into again."""

  exit_code = exit_codes.HOOK_EXIT


def load(experiment, config) -> list[Hook]:
  """The experiment's hooks, checked: one `error:` line for a malformed one."""
  return _checked(experiment, config, Hook)


def load_evaluators(experiment, config, taken=()) -> list[Evaluator]:
  """The experiment's evaluators, checked; `taken`: metric prefixes already in use (held-out sets)."""
  return _checked(experiment, config, Evaluator, taken)


def _checked(experiment, config, cls: type, taken=()) -> list:
  """What the experiment's `hooks` or `evaluators` (by `cls`) returns, each checked."""
  kind = cls.__name__.lower()
  attr = f"{kind}s"  # The experiment's hooks() or evaluators().
  make = experiment.hooks if cls is Hook else experiment.evaluators
  made = list(make(config)) if make is not None else []
  names = set(taken)
  for h in made:
    if not isinstance(h, cls):
      raise UserError(
        f"{experiment.module}.{attr}() returned {h!r}: each must be a trainer.hooks.{cls.__name__}"
      )
    if problem := _problem(h, names):
      raise UserError(f"{kind} {h.name!r} of {experiment.module}: {problem}")
    names.add(h.name)
  return made


def _problem(hook: Hook | Evaluator, names: set) -> str | None:
  if hook.name in names:
    return "its name is used twice"
  if hook.on not in ("all", "process_0"):
    return "on must be 'all' or 'process_0'"
  if isinstance(hook, Hook) and (hook.every < 0 or hook.every_s < 0 or not (hook.every or hook.every_s)):
    return "every and every_s must be >= 0, and one of them > 0"
  if isinstance(hook, Evaluator) and not re.fullmatch(r"\w+", hook.name, re.ASCII):
    return "name it with a word"
  return None


class Hooks:
  """The run's hooks and their clocks."""

  def __init__(self, hooks: list[Hook], config, workdir: str, model_def, log, timeout_s: float):
    self.hooks, self.config, self.workdir, self.model_def, self.log = hooks, config, workdir, model_def, log
    self.timeout_s = timeout_s
    self.clocks = {h.name: ByClock(f"hook/{h.name}", h.every_s, config.log_every, timeout_s) for h in hooks}

  def begin(self, step: int, attempt: int) -> None:
    for c in self.clocks.values():
      c.begin(step, attempt)

  def due(self, step: int, last_step: int) -> list[Hook]:
    """The hooks due at `step` (the same on every process); their clocks decide the next logging step."""
    due = [h for h in self.hooks if itstime(step, h.every) or self.clocks[h.name].due(step)]
    for h in due:
      self.clocks[h.name].ran()
    if itstime(step, self.config.log_every, last_step, last=True):
      for c in self.clocks.values():
        c.decide(step)
    return due

  def run(self, hook: Hook, step: int, state) -> None:
    """Runs `hook` at `step`; HookFailed on every process if it raised on any."""
    writer = HookWriter(hook.name, step, self.log, self.workdir)

    def body(params, variables, ema):
      hook.fn(HookContext(step, params, variables, ema, self.config, writer, self.model_def))
      writer.flush()

    call(
      f"hook {hook.name!r}", hook.on, step, (state.params, state.variables, state.ema), self.timeout_s, body
    )


def call(what: str, on: str, step: int, weights: tuple, timeout_s: float, body):
  """body(*weights) of a hook or an evaluator (`what` names it) on the processes `on` says; its value,
  None where it did not run. HookFailed on every process if it raised on any: they all agree first."""
  if on == "process_0":  # A collective: every process takes part, process 0 keeps the copies.
    weights = multihost_utils.process_allgather(weights, tiled=True)
  error = value = None
  if on == "all" or jax.process_index() == 0:
    try:
      value = body(*weights)
    except Exception as e:  # noqa: BLE001 - the fork's code: any error ends the run with its name.
      where = traceback.extract_tb(e.__traceback__)[-1]
      at = f"{os.path.relpath(where.filename)}:{where.lineno}"
      error = f"{what} raised at step {step}: {type(e).__name__}: {e} ({at})"
  tag = "".join(c if c.isalnum() else "_" for c in what)
  if not multihost.all_agree(f"{tag}_{step}", error is None, timeout_s):
    raise HookFailed(error or f"{what} raised on another process at step {step}")
  return value
