"""Orbax checkpoints of the complete training state: params, optimizer state, step, RNG, data
position, the resolved config and a metadata record (mesh, devices, library versions, code revision).

Saves are asynchronous and atomic: a step directory appears only once complete; partial ones left by
a kill are ignored and cleaned. A background save error surfaces in the loop at the next step.
"""

import contextlib
import json
import os
import subprocess
import threading
import time
from importlib import metadata as importlib_metadata
from typing import NamedTuple

import jax
import orbax.checkpoint as ocp
from absl import logging

from data.sources import order_change
from errors import UserError, require_keys
from trainer import device_memory, rundir
from trainer.checkpoint import proof as proof_lib
from trainer.checkpoint import tree
from trainer.cluster import failures, multihost
from trainer.state import TrainState

DATA_POSITION_VERSION = 2
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_workdir(workdir: str) -> None:
  """The run directory, created if needed; one that cannot be made or written is a UserError."""
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    reason = e.strerror or e
    raise UserError(
      f"--workdir={workdir}: cannot create it ({reason}); use a directory you can write"
    ) from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise UserError(f"--workdir={workdir}: not writable; use a writable directory")


@contextlib.contextmanager
def read_only(workdir: str):
  """A read-only CheckpointManager over `workdir`'s checkpoints, for reading another run (Orbax's
  warning that such a manager will not save is silenced)."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    options = ocp.CheckpointManagerOptions(read_only=True)
    directory = rundir.checkpoints(os.path.abspath(workdir))
    with ocp.CheckpointManager(directory, options=options, item_handlers=Checkpoints.item_handlers()) as m:
      yield m
  finally:
    logging.set_verbosity(verbosity)


def has_checkpoints(workdir: str) -> bool:
  """Whether workdir/checkpoints holds a step directory (without creating anything)."""
  directory = rundir.checkpoints(workdir)
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def data_position(step: int, batch_offset: int, comp, rollbacks: int = 0, clock: dict | None = None) -> dict:
  """Where the data stands after `step` steps: the next global batch is step + batch_offset (the offset
  counts batches skipped by a NaN rollback). Independent of process and device counts. It also
  carries the rollbacks so far, so checkpoint.max_rollbacks holds across restarts, and the clock
  (trainer/observe/goodput.py), so a resumed run's goodput counts every run's time."""
  return {
    "clock": clock,
    "version": DATA_POSITION_VERSION,
    "step": step,
    "next_batch": step + batch_offset,
    "batch_offset": batch_offset,
    "rollbacks": rollbacks,
    "seed": comp.plan.seed,
    "num_records": comp.plan.num_records,
    "global_batch_size": comp.plan.global_batch_size,
    "fingerprint": comp.sources.fingerprint,
  }


def check_data_position(saved: dict, step: int, comp, allow_changed_data: bool) -> None:
  """The checkpoint's data position must describe the data and order this run would read."""
  where = f"checkpoint {step}'s data position"
  require_keys(saved, ("version",), where, "it was not written by this trainer: use a new --workdir")
  if saved["version"] != DATA_POSITION_VERSION:
    raise UserError(
      f"checkpoint {step}: data position version {saved['version']} is not {DATA_POSITION_VERSION}"
    )
  keys = ("step", "next_batch", "batch_offset", "num_records", "fingerprint")
  require_keys(saved, keys, where, "it was written by other code: use a new --workdir")
  if saved["step"] != step or saved["next_batch"] != step + saved["batch_offset"]:
    raise UserError(f"checkpoint {step}: its data position {saved} does not belong to step {step}")
  now = data_position(step, saved["batch_offset"], comp)
  # A changed seed or global batch size is judged by trainer/config/resume.py, from the saved config.
  changed = [k for k in ("num_records", "fingerprint") if saved[k] != now[k]]
  if changed and not allow_changed_data:
    detail = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in changed)
    why = order_change(saved["fingerprint"], now["fingerprint"])
    detail += f": {why}" if why else ""
    raise UserError(
      f"the data changed since checkpoint {step} ({detail}); start a new --workdir, or pass "
      f"--config.data.allow_changed_data=True to resume on it anyway"
    )


def layout(comp, config) -> dict:
  """What decides how the train step is partitioned and compiled: checks.first_step runs again when a
  restored checkpoint's differs (trainer/checks/first_step.py)."""
  import jaxlib

  return {
    "mesh": dict(comp.mesh.shape),
    "device_count": comp.mesh.size,
    "strategy": config.sharding.strategy,
    "rules": [[str(x) for x in rule] for rule in comp.rules],
    "microbatches": config.microbatches,
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def same_layout(saved: dict | None, now: dict) -> bool:
  """Whether two `layout`s partition alike. Mesh axes of size 1 split nothing: a checkpoint saved
  before the mesh had an axis (expert) has the same layout as one with that axis at 1."""
  split = lambda lay: {**lay, "mesh": {a: n for a, n in lay.get("mesh", {}).items() if n > 1}}
  return saved is not None and split(saved) == split(now)


def run_metadata(comp, config) -> dict:
  """What produced a checkpoint: for a reader deciding whether and how to restore it."""
  try:
    revision = subprocess.run(
      ["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, timeout=5
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    revision = ""
  versions = {p: importlib_metadata.version(p) for p in ("jax", "flax", "optax", "orbax-checkpoint", "grain")}
  devices = jax.devices()
  return {
    "mesh": dict(comp.mesh.shape),
    "strategy": config.sharding.strategy,
    "device_kind": devices[0].device_kind,
    "platform": devices[0].platform,
    "device_count": len(devices),
    "process_count": jax.process_count(),
    "versions": versions,
    "git_revision": revision or None,
    "layout": layout(comp, config),
  }


_LOWER_MEMORY = "give it more devices or split it further (mesh.fsdp, sharding.strategy=fsdp), then run again"


class Restored(NamedTuple):
  state: TrainState
  data: dict  # The data position (see data_position).
  step: int


class Checkpoints:
  """The run's CheckpointManager plus what it should have: fallbacks, checks, and timings."""

  def __init__(self, workdir: str, keep: int, keep_every: int, replica_parallel: bool = False):
    # Orbax's replica-parallel save splits each replicated shard across its replicas with many small
    # JAX slices, all dispatched while the loop waits: on a 2x2x2 mesh with a 107M-parameter state
    # that blocked 0.63 s instead of 0.16 s (benchmarks/checkpoint.py). It pays off where hosts'
    # write bandwidth, not dispatch, is the limit: then set checkpoint.replica_parallel. The handler
    # registry is process-global in Orbax; this is the process's only checkpoint writer.
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # Orbax warns on every override of its default.
    ocp.type_handlers.register_type_handler(
      jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel), override=True
    )
    logging.set_verbosity(verbosity)
    self.directory = rundir.checkpoints(os.path.abspath(workdir))
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      keep_period=keep_every or None,  # Steps divisible by keep_every are never deleted.
      enable_async_checkpointing=True,
      cleanup_tmp_directories=True,  # Partial directories a kill left behind.
      # The loop blocks only for the device-to-host copy; directories are made in the background.
      async_options=ocp.AsyncOptions(create_directories_asynchronously=True),
      create=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=self.item_handlers())
    self._records: list[dict] = []  # Finished saves' timings, for processes/process_I.jsonl.
    self._pending: tuple[int, float, float] | None = None  # (step, started, blocking seconds)
    self._proving: threading.Thread | None = None  # Writes the last committed save's checksums.

  @staticmethod
  def item_handlers() -> dict:
    """One Orbax handler per item of a checkpoint (tests wrap the data item's to pause a save)."""
    return {
      "state": ocp.StandardCheckpointHandler(),
      "data": ocp.JsonCheckpointHandler(),
      "config": ocp.JsonCheckpointHandler(),
      "meta": ocp.JsonCheckpointHandler(),
    }

  def restore_latest(
    self, target: TrainState, set_aside: bool = True, check_memory: bool = True
  ) -> Restored | None:
    """The newest checkpoint that restores, onto `target`'s shardings (any mesh or device count).

    One proven damaged (trainer/checkpoint/proof.py), or unproven and failing as damage would, is
    reported, skipped and (with `set_aside`) moved aside; every process makes the same choice. A
    failure that is not damage (memory, I/O, permissions, time) raises RestoreFailed and touches no
    checkpoint, as does a state too large for this process's devices (`check_memory`). A model-shape
    change is a UserError.
    """
    self._join_proving()  # A rollback may come while the newest save's checksums are being written.
    steps = sorted(self.manager.all_steps(), reverse=True)
    # Said before any byte is read (not on a rollback: the state it replaces still holds the memory).
    short = device_memory.shortfall(target) if steps and check_memory else None
    if steps and check_memory and not multihost.all_agree("state_fits", short is None, timeout_s=600):
      where = f"checkpoint {steps[0]} ({self.directory}/{steps[0]}) was not restored and was left as is"
      why = short or "it does not fit on another process's devices"
      raise proof_lib.RestoreFailed(f"{where}: {why}; {_LOWER_MEMORY}", failures.RESOURCES_EXIT)
    for step in steps:
      step_target, complete = tree.restore_target(step, self._saved_tree(step), target)
      step_dir = os.path.join(self.directory, str(step))
      proof, error = False, None
      try:  # Each process reads its share of the files.
        proof = proof_lib.verify(step_dir, (jax.process_index(), jax.process_count()))
      except OSError as e:
        error = e
      if not multihost.all_agree(f"proof_{step}", not isinstance(proof, str), timeout_s=600):
        self._skip(step, proof if isinstance(proof, str) else None, set_aside)
        continue
      restored = None
      if error is None:
        try:
          restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(step_target), data=ocp.args.JsonRestore()),
          )
        except Exception as e:  # noqa: BLE001 - judged below, with every process's view.
          error = e
      # Each process reads its own shards: all fall back, or all stop, together.
      if multihost.all_agree(f"restore_{step}", error is None, timeout_s=600):
        return Restored(complete(restored["state"]), restored["data"], step)
      kind = failures.failure_kind(error) if error is not None else None
      maybe_damage = kind is None and proof is not True
      if multihost.all_agree(f"damage_{step}", maybe_damage, timeout_s=600):
        self._skip(step, error, set_aside)
        continue
      out_of_memory = not multihost.all_agree(f"memory_{step}", kind != "resources", timeout_s=600)
      raise self._restore_failed(step, error, proof is True, out_of_memory, target)
    return None

  def _restore_failed(self, step, error, whole: bool, out_of_memory: bool, target) -> Exception:
    detail = (
      f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
      if error
      else "on another process"
    )
    kept = "its checksums match; it" if whole else "it"
    where = (
      f"checkpoint {step} ({self.directory}/{step}) could not be restored ({detail}); {kept} was left as is"
    )
    if out_of_memory:
      per_device = max(device_memory.bytes_per_device(target).values(), default=0)
      return proof_lib.RestoreFailed(
        f"{where}: out of memory. The state needs {per_device / 2**30:.2f} GiB per device on "
        f"{jax.device_count()} devices; {_LOWER_MEMORY}",
        failures.RESOURCES_EXIT,
      )
    return proof_lib.RestoreFailed(
      f"{where}: fix what failed (I/O, permissions, a timeout, a peer) and run again",
      failures.TRANSIENT_EXIT,
    )

  def saved_config(self, step: int) -> dict:
    """The config checkpoint `step` was trained with (as JSON)."""
    return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

  def saved_meta(self, step: int) -> dict:
    """Checkpoint `step`'s run metadata (run_metadata: its mesh, devices, versions)."""
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] or {}

  def _saved_tree(self, step: int):
    try:
      return self.manager.item_metadata(step)["state"]
    except Exception:  # noqa: BLE001 - unreadable metadata: restore fails and falls back.
      return None

  def _skip(self, step: int, error: Exception | str | None, set_aside: bool) -> None:
    if isinstance(error, Exception):
      detail = f"{type(error).__name__}: {str(error)[:200]}"
    else:  # The proof of damage, or nothing: another process found it.
      detail = error or "another process could not read it"
    message = f"checkpoint {step} is damaged and was skipped ({detail})"
    logging.warning(message)
    print(f"warning: {message}", flush=True)
    if set_aside:
      multihost.barrier(f"set_aside_{step}", timeout_s=600)  # Nobody is still reading it.
      if jax.process_index() == 0:
        os.replace(
          os.path.join(self.directory, str(step)),
          os.path.join(self.directory, f"damaged-{step}-{int(time.time())}"),
        )
      multihost.barrier(f"set_aside_{step}_done", timeout_s=600)
      self.manager.reload()

  def save(self, step: int, state: TrainState, position: dict, config, meta: dict) -> None:
    """Starts an async save; blocks only for the device-to-host copy (timed)."""
    self.poll()
    self.wait()  # One save in flight at a time; usually long done.
    started = time.time()
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(position),
        config=ocp.args.JsonSave(json.loads(config.to_json())),
        meta=ocp.args.JsonSave(meta),
      ),
      force=True,  # The loop decides when; Orbax would also save the first step it sees.
    )
    self._pending = (step, started, time.time() - started)

  def poll(self) -> None:
    """Raises a background save's error here, in the loop; records a finished save's timings."""
    self.manager.check_for_errors()
    if self._pending and not self.manager.is_saving_in_progress():
      self._record()

  def wait(self) -> None:
    if self._pending:
      self.manager.wait_until_finished()
      self._record()
    self._join_proving()

  def _join_proving(self) -> None:
    if self._proving:
      self._proving.join()
      self._proving = None

  @staticmethod
  def _prove(step: int, step_dir: str, part: tuple[int, int]) -> None:
    try:
      proof_lib.write(step_dir, part)
    except OSError as e:  # A full disk, say: the checkpoint stays whole, only unproven.
      print(f"warning: checkpoint {step}: checksums not written ({e}); it stays unproven", flush=True)

  def _record(self) -> None:
    step, started, blocking = self._pending
    self._pending = None
    # Committed (Orbax's processes finish a save together, after process 0 renamed it in place): this
    # process's share of its checksums, off the loop's thread (a kill before every share lands leaves
    # it unproven).
    step_dir, part = os.path.join(self.directory, str(step)), (jax.process_index(), jax.process_count())
    if os.path.isdir(step_dir):
      self._proving = threading.Thread(target=self._prove, args=(step, step_dir, part), daemon=True)
      self._proving.start()
    self._records.append(
      {"event": "checkpoint", "step": step, "blocking_s": blocking, "write_s": time.time() - started}
    )

  def drain(self) -> list[dict]:
    records, self._records = self._records, []
    return records

  def close(self) -> None:
    self.wait()
    self.manager.check_for_errors()
    self.manager.close()
