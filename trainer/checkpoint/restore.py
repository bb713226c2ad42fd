"""Where a run starts and where a NaN rollback returns: the newest checkpoint that restores (onto this
mesh), else a fresh sharded init."""

import json
from typing import NamedTuple

from trainer.checkpoint import local_restore, store
from trainer.checks import integrity
from trainer.config import assemble, resume
from trainer.observe.metrics import console


class Start(NamedTuple):
  state: object
  batch_offset: int  # Batches skipped by NaN rollbacks: global batch t trains step t - offset + 1.
  rollbacks: int  # NaN rollbacks so far, restarts included.
  # Restored under another layout than it was saved with (store.layout; asked with checks.first_step).
  layout_changed: bool = False
  from_local_tier: bool = False  # Said by the local tier's own line, not as "resumed from checkpoint".
  clock: dict | None = None  # The goodput clock saved with it (trainer/observe/goodput.py).


def restore_or_init(ckpt: store.Checkpoints, target, comp, config, init, resuming: bool, local=None) -> Start:
  """The newest checkpoint that restores, else `init()`: a local-tier copy (`local`) newer than every
  persistent checkpoint first, or newer than the one restored where newer ones were damaged. `resuming`:
  judge what changed in the config since the checkpoint, and check first that the devices can hold the
  state (a rollback changes nothing, and the state it replaces still holds the memory)."""
  tiers = local if resuming else None  # The local and peer tiers are read on a resume only.
  newest = ckpt.manager.latest_step()
  if tiers is not None and (start := _from_local_tier(tiers, target, newest, comp, config)):
    return start
  restored = ckpt.restore_latest(target, check_memory=resuming)
  fell_back = newest is not None and (restored is None or restored.step < newest)
  if tiers is not None and fell_back:
    # The newest persistent checkpoints were damaged and set aside: a copy newer than the one restored
    # (if any) wins. The restored state's device memory is let go only once such a copy is to be read,
    # and the checkpoint read again only in the rare case that the copy then fails.
    step, kept = (restored.step if restored else None), [restored]
    del restored
    if start := _from_local_tier(tiers, target, step, comp, config, say_why=False, before_read=kept.clear):
      return start
    if not kept:
      restored = ckpt.restore_latest(target, check_memory=resuming) if step is not None else None
    else:
      restored = kept[0]
  if restored is None:
    start = Start(init(), 0, 0)
  else:
    changed, saved = False, None
    if resuming:
      saved = ckpt.saved_config(restored.step)
      if config.checks.first_step:  # Only the first-step check asks whether the layout changed.
        changed = not store.same_layout(
          ckpt.saved_meta(restored.step).get("layout"), store.layout(comp, config)
        )
    start = _resumed(restored.state, restored.data, restored.step, saved, comp, config, changed)
  if tiers is not None:
    _abandon_later_copies(tiers, restored.step if restored else 0)
  return start


def _from_local_tier(
  local, target, newer_than: int | None, comp, config, say_why=True, before_read=lambda: None
) -> Start | None:
  """The start from the newest step every process can get whole from the local and peer tiers, if newer
  than `newer_than`; else None (`say_why`: with a line saying why, where copies existed). `before_read`
  runs once such a step is found, before its copy is read."""
  timeout_s = config.watchdog.restore_timeout_s
  checked = integrity.interval(comp, config) > 0
  if found := local_restore.restore_newest(
    local, target, newer_than, timeout_s, say_why, before_read, checked
  ):
    state, position, saved, step = found  # Written under this very layout: nothing to re-check.
    return _resumed(state, position, step, saved, comp, config, changed=False)._replace(from_local_tier=True)
  return None


def _abandon_later_copies(local, step: int) -> None:
  """The run goes on from `step`: this process's copies of later steps belong to a future it abandons,
  and kept they would outrank the copies it makes now (the newest steps are kept) until it passed them.
  Each process says its own (a line from process 0 alone would miss a partner's)."""
  if removed := local.discard_after(step):
    steps = ", ".join(map(str, sorted(removed)))
    print(f"local tier: removed the copies of steps {steps}: the run goes on from step {step}", flush=True)


def _resumed(state, position: dict, step: int, saved: dict | None, comp, config, changed: bool) -> Start:
  """The start from a restored state: what changed in the config since (`saved`; None on a rollback)
  said, and its data position checked against this run's data."""
  if saved is not None:
    now, declared = json.loads(config.to_json()), assemble.declared(config.experiment)
    for line in resume.check(saved, now, step, config.checkpoint.allow_changed_keys, declared):
      console(line)
  store.check_data_position(position, step, comp, config.data.allow_changed_data)
  return Start(
    state, position["batch_offset"], position.get("rollbacks", 0), changed, clock=position.get("clock")
  )


class RolledBack(NamedTuple):
  state: object
  step: int  # The checkpoint's step: training goes on from it.
  batch_offset: int
  event: dict  # The metrics row that says so.


def roll_back(ckpt, target, comp, config, init, bad: int, batch_offset: int, now: float) -> RolledBack:
  """Back to the newest good checkpoint after step `bad` went non-finite, skipping the batches that
  led there. Steps good+1..bad trained batches good+offset..bad-1+offset: the new offset builds on
  the current one, not the checkpoint's, so earlier skips since that save stay skipped."""
  ckpt.wait()
  state = restore_or_init(ckpt, target, comp, config, init, resuming=False).state
  good = int(state.step)
  event = {"step": good, "time": now, "event": "nonfinite_rollback", "nonfinite_step": bad}
  event["skipped_batches"] = [good + batch_offset, bad - 1 + batch_offset]
  console(f"step {bad}: NaN/Inf; rolled back to step {good}, skipping {bad - good} batches")
  return RolledBack(state, good, batch_offset + bad - good, event)
