"""Where a run starts and where a NaN rollback returns: the newest checkpoint that restores (onto this
mesh), else a fresh sharded init."""

import json
from typing import NamedTuple

from trainer.checkpoint import store
from trainer.config import assemble, resume
from trainer.observe.metrics import console


class Start(NamedTuple):
  state: object
  batch_offset: int  # Batches skipped by NaN rollbacks: global batch t trains step t - offset + 1.
  rollbacks: int  # NaN rollbacks so far, restarts included.
  # Restored under another layout than it was saved with (store.layout; asked with checks.first_step).
  layout_changed: bool = False


def restore_or_init(ckpt: store.Checkpoints, target, comp, config, init, resuming: bool) -> Start:
  """The newest checkpoint that restores, else `init()`. `resuming`: judge what changed in the config
  since the checkpoint, and check first that the devices can hold the state (a rollback changes
  nothing, and the state it replaces still holds the memory)."""
  restored = ckpt.restore_latest(target, check_memory=resuming)
  if restored is None:
    return Start(init(), 0, 0)
  changed = False
  if resuming:
    saved, now = ckpt.saved_config(restored.step), json.loads(config.to_json())
    if config.checks.first_step:  # Only the first-step check asks whether the layout changed.
      changed = not store.same_layout(
        ckpt.saved_meta(restored.step).get("layout"), store.layout(comp, config)
      )
    declared = assemble.declared(config.experiment)
    for line in resume.check(saved, now, restored.step, config.checkpoint.allow_changed_keys, declared):
      console(line)
  position = restored.data
  store.check_data_position(position, restored.step, comp, config.data.allow_changed_data)
  return Start(restored.state, position["batch_offset"], position.get("rollbacks", 0), changed)


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
