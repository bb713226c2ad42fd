"""Orbax checkpoints of the complete training state: params, optimizer, step, RNG, data position
and the resolved config. Saves are asynchronous; a step directory appears only once complete."""

import json
import os

import orbax.checkpoint as ocp

from trainer.state import TrainState

DATA_POSITION_VERSION = 1


def make_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep,
    enable_async_checkpointing=True,
    create=True,
  )
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"), options=options)


def data_position(step: int, plan) -> dict:
  """The data position is (seed, step): global batch `step` is the next one to train on."""
  return {
    "version": DATA_POSITION_VERSION,
    "next_batch": step,
    "seed": plan.seed,
    "num_records": plan.num_records,
    "global_batch_size": plan.global_batch_size,
  }


def save(manager: ocp.CheckpointManager, step: int, state: TrainState, plan, config) -> None:
  """Starts an async save of `step`; blocks only for the device-to-host copy."""
  manager.save(
    step,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(data_position(step, plan)),
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
