"""Orbax checkpoints of the complete training state: params, optimizer, step, RNG, data position
and the resolved config. Saves are asynchronous; a step directory appears only once complete."""

import json
import os

import orbax.checkpoint as ocp

from trainer.errors import UserError
from trainer.state import TrainState

DATA_POSITION_VERSION = 1


def make_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep,
    enable_async_checkpointing=True,
    create=True,
  )
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"), options=options)


def data_position(step: int, plan, fingerprint: str) -> dict:
  """The data position is (seed, step): global batch `step` is the next one to train on. It does
  not depend on the number of processes or devices, so it restores onto any topology."""
  return {
    "version": DATA_POSITION_VERSION,
    "next_batch": step,
    "seed": plan.seed,
    "num_records": plan.num_records,
    "global_batch_size": plan.global_batch_size,
    "fingerprint": fingerprint,
  }


def check_data_position(saved: dict, step: int, comp, allow_changed_data: bool) -> None:
  """The checkpoint's data position must describe the data and order this run would read."""
  if saved.get("version") != DATA_POSITION_VERSION:
    raise UserError(
      f"checkpoint {step}: data position version {saved.get('version')} is not {DATA_POSITION_VERSION}"
    )
  if saved["next_batch"] != step:
    raise UserError(f"checkpoint {step}: its data position says batch {saved['next_batch']}, not {step}")
  now = data_position(step, comp.plan, comp.sources.fingerprint)
  for key in ("seed", "global_batch_size"):
    if saved[key] != now[key]:
      raise UserError(
        f"checkpoint {step} was trained with {key}={saved[key]}, the config says {now[key]}: the data "
        f"order would change; restore the value or start a new workdir"
      )
  changed = [k for k in ("num_records", "fingerprint") if saved[k] != now[k]]
  if changed and not allow_changed_data:
    detail = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in changed)
    raise UserError(
      f"the data changed since checkpoint {step} ({detail}); pass --config.data.allow_changed_data=True "
      f"to resume on it anyway"
    )


def save(manager: ocp.CheckpointManager, step: int, state: TrainState, comp, config) -> None:
  """Starts an async save of `step`; blocks only for the device-to-host copy."""
  manager.save(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(data_position(step, comp.plan, comp.sources.fingerprint)),
      config=ocp.args.JsonSave(json.loads(config.to_json())),
    ),
    force=True,  # The loop decides when; Orbax would also save the first step it sees.
  )


def restore(manager: ocp.CheckpointManager, step: int, target: TrainState) -> tuple[TrainState, dict]:
  """Restores onto `target`'s shardings (any mesh or device count); returns (state, data position)."""
  restored = manager.restore(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()),
  )
  return restored["state"], restored["data"]
