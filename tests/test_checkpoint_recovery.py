"""Checkpoints restore onto other meshes, strategies and device counts; a damaged newest checkpoint
falls back to the previous one; a model-shape change and NaN/Inf stop with an error or roll back."""

import hashlib
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from errors import UserError
from experiments import lm
from tests.conftest import patch_experiment, read_jsonl, tiny_config, train_losses
from trainer.train import train

STEPS = 8


def _cfg(mesh=(2, 2, 2), strategy="fsdp_tp", **kw):
  data, fsdp, tensor = mesh
  over = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "sharding.strategy": strategy}
  return tiny_config(steps=STEPS, **{"checkpoint.every": 2, **over, **kw})


def _trajectory(workdir):
  losses = train_losses(workdir)
  return np.array([losses[s] for s in sorted(losses)])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted reference: 8 devices, FSDP + tensor parallel."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  train(_cfg(), workdir)
  return _trajectory(workdir)


# (stop after, devices, mesh, strategy) for each leg of one run: every strategy restored from another,
# 8 -> 4 -> 1 -> 8 devices.
LEGS = [
  (2, 8, (8, 1, 1), "zero1"),
  (3, 8, (2, 2, 2), "fsdp_tp"),
  (5, 4, (2, 1, 2), "dp"),
  (6, 1, (1, 1, 1), "fsdp_tp"),
  (STEPS, 8, (1, 8, 1), "fsdp"),
]


def test_restore_onto_another_mesh_strategy_or_device_count_continues(tmp_path, straight):
  for stop_after, n, mesh, strategy in LEGS:
    summary = train(_cfg(mesh, strategy), str(tmp_path), stop_after=stop_after, devices=jax.devices()[:n])
    assert summary["final_step"] == stop_after
  np.testing.assert_allclose(_trajectory(str(tmp_path)), straight, rtol=1e-5)


def _tear(workdir: str, step: int) -> None:
  """Truncates every array file of checkpoint `step`: a torn write."""
  state_dir = os.path.join(workdir, "checkpoints", str(step), "state")
  for root, _, files in os.walk(state_dir):
    for name in files:
      if not name.endswith(".json") and "manifest" not in name:
        open(os.path.join(root, name), "w").close()
  shutil.rmtree(os.path.join(state_dir, "d"), ignore_errors=True)


def test_every_checkpoint_damaged_resumes_from_a_local_copy_not_from_scratch(tmp_path, straight, capsys):
  """The copies taken straight into pinned host memory (checkpoint.local_copy_in=host: what auto picks
  where the devices lack room beside the step) restore bit for bit too."""
  workdir = str(tmp_path)
  train(_cfg(**{"checkpoint.local_every": 1, "checkpoint.local_copy_in": "host"}), workdir, stop_after=4)
  _tear(workdir, 2)
  _tear(workdir, 4)
  train(_cfg(**{"checkpoint.local_every": 1}), workdir)
  out = capsys.readouterr().out
  assert "local tier: copies taken in pinned host memory" in out, out
  assert "local tier: copies every step; a lost host costs up to 2 steps\n" in out, out  # lost_steps(1, 1)
  assert "checkpoint 2 is damaged" in out and "checkpoint 4 is damaged" in out, out
  assert re.search(r"restored step [34] from the local tier: process 0 from its own copy", out), out
  np.testing.assert_array_equal(_trajectory(workdir), straight)


def test_a_fallback_with_no_newer_copy_reads_the_older_checkpoint_once(
  tmp_path, straight, capsys, monkeypatch
):
  """Checkpoint 6 torn and the copies gone (a replacement host): the tiers are asked again after the
  persistent tier fell back to 4, have nothing newer, and checkpoint 4, already restored, is used as it
  is, not read a second time."""
  from trainer.checkpoint import local_room, store

  workdir = str(tmp_path)
  train(_cfg(**{"checkpoint.local_every": 1}), workdir, stop_after=6)
  _tear(workdir, 6)
  shutil.rmtree(local_room.default_dir(workdir))
  reads, restore_latest = [], store.Checkpoints.restore_latest

  def counted(self, *args, **kwargs):
    reads.append(1)
    return restore_latest(self, *args, **kwargs)

  monkeypatch.setattr(store.Checkpoints, "restore_latest", counted)
  train(_cfg(**{"checkpoint.local_every": 1}), workdir)
  out = capsys.readouterr().out
  assert "checkpoint 6 is damaged" in out and "resumed from checkpoint 4" in out, out
  assert len(reads) == 1, reads
  np.testing.assert_array_equal(_trajectory(workdir), straight)


@pytest.mark.parametrize("local_every", [0, 1], ids=["persistent only", "with the local tier"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, straight, capsys, local_every):
  """Checkpoint 6 is torn: the persistent tier falls back to 4; with the local tier on, its copy of a
  step after 4 is newer, and wins (a copy no newer than the damaged 6 was not asked for before)."""
  workdir = str(tmp_path)
  train(_cfg(**{"checkpoint.local_every": local_every}), workdir, stop_after=6)
  _tear(workdir, 6)

  train(_cfg(**{"checkpoint.local_every": local_every}), workdir)
  out = capsys.readouterr().out
  assert "checkpoint 6 is damaged" in out, out
  if local_every:
    assert re.search(r"restored step [56] from the local tier: process 0 from its own copy", out), out
  else:
    assert "resumed from checkpoint 4" in out, out
  assert any(name.startswith("damaged-6-") for name in os.listdir(os.path.join(workdir, "checkpoints")))
  np.testing.assert_array_equal(_trajectory(workdir), straight)  # Same mesh: bitwise.


def test_model_shape_change_names_the_parameter_and_both_shapes(tmp_path):
  train(_cfg(), str(tmp_path), stop_after=2)
  with pytest.raises(
    UserError, match=r"blocks/0/mlp/down has shape \(64, 32\) but the model now has \(96, 32\)"
  ):
    train(_cfg(**{"model.mlp_dim": 96}), str(tmp_path))


def _poison(monkeypatch, batches):
  """Makes the loss NaN on the given global batches of the tiny config, recognised by their tokens."""
  from trainer import components

  cfg = _cfg()
  comp = components.build(cfg)
  markers = jnp.stack([components.local_batches(comp)(t)["inputs"][0] for t in batches])
  real = lm.loss_sums

  def poisoned(model, batch, rng):
    loss_sum, count, metrics = real(model, batch, rng)
    hit = jnp.any(jnp.all(batch["inputs"][0][None] == markers, axis=1))
    return jnp.where(hit, jnp.nan, loss_sum), count, metrics

  patch_experiment(monkeypatch, lm, loss_sums=poisoned)


@pytest.fixture
def nan_on_batch(monkeypatch):
  _poison(monkeypatch, [4])


def test_nan_stops_with_an_error_naming_the_step_and_never_saves_it(tmp_path, nan_on_batch):
  with pytest.raises(UserError, match=r"NaN/Inf at step 5 \(window 5\.\.5\)"):
    train(_cfg(), str(tmp_path))
  assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["2", "4"]


def test_a_local_copy_of_a_nonfinite_state_is_never_made(tmp_path, nan_on_batch):
  """Copies every step check their steps' flags on their own thread (the loop checks at logging and
  saving steps only): step 5's is dropped, and the run stops at step 6's save."""
  local = tmp_path / "local"
  cfg = _cfg(**{"log_every": 4, "checkpoint.local_every": 1, "checkpoint.local_dir": str(local)})
  with pytest.raises(UserError, match=r"NaN/Inf at step 5 \(window 5\.\.6\)"):
    train(cfg, str(tmp_path / "run"))
  # Nothing of step 5, not even torn; step 1's copy is the spare the next copy is written over.
  assert sorted(os.listdir(local / "process_0" / "own")) == ["2", "3", "4", "spare"]


def test_nan_rollback_restores_the_last_good_checkpoint_and_skips_the_batches(tmp_path, nan_on_batch):
  summary = train(_cfg(**{"checkpoint.on_nonfinite": "rollback"}), str(tmp_path))
  assert summary["final_step"] == STEPS and summary["nonfinite_rollbacks"] == 1
  rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  events = [r for r in rows if r.get("event") == "nonfinite_rollback"]
  assert events == [{**events[0], "step": 4, "nonfinite_step": 5, "skipped_batches": [4, 4]}]
  trained = [r for r in rows if "loss" in r]
  assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
  assert [r["batch"] for r in trained] == [0, 1, 2, 3, 5, 6, 7, 8]  # Batch 4 skipped, nothing repeated.
  assert all(np.isfinite(r["loss"]) for r in trained)
  assert summary["tokens_trained_this_run"] == sum(r["valid_tokens"] for r in trained)  # Not the NaN step.
  with open(os.path.join(tmp_path, "checkpoints", str(STEPS), "data", "metadata")) as f:
    assert json.load(f)["batch_offset"] == 1


def test_two_rollbacks_between_saves_skip_both_windows(tmp_path, monkeypatch):
  _poison(monkeypatch, [4, 6])
  cfg = _cfg(**{"checkpoint.on_nonfinite": "rollback", "checkpoint.every": 4})
  summary = train(cfg, str(tmp_path))
  assert summary["final_step"] == STEPS and summary["nonfinite_rollbacks"] == 2
  rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["skipped_batches"] for r in rows if r.get("event") == "nonfinite_rollback"] == [[4, 4], [5, 6]]
  assert [r["batch"] for r in rows if "loss" in r] == [0, 1, 2, 3, 7, 8, 9, 10]


def test_a_smaller_model_names_the_parameter_the_checkpoint_has_extra(tmp_path):
  train(_cfg(**{"model.num_layers": 2}), str(tmp_path), stop_after=2)
  with pytest.raises(UserError, match=r"checkpoint 2 has a parameter blocks/1/\S+ \(the model has none"):
    train(_cfg(), str(tmp_path))
  assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["2"]  # Nothing set aside.


def test_rollbacks_are_counted_across_restarts(tmp_path, monkeypatch):
  _poison(monkeypatch, [4, 6])
  cfg = _cfg(**{"checkpoint.on_nonfinite": "rollback", "checkpoint.max_rollbacks": 1})
  assert train(cfg, str(tmp_path), stop_after=5)["nonfinite_rollbacks"] == 1  # Batch 4 skipped.
  with pytest.raises(UserError, match=r"NaN/Inf at step 6"):  # The restart has no fresh allowance.
    train(cfg, str(tmp_path))


def test_a_rollback_inside_a_logging_window_counts_the_kept_steps_once(tmp_path, monkeypatch):
  _poison(monkeypatch, [6])  # Step 7; logged every 4 steps, saved every 2: the rollback goes to 6.
  cfg = _cfg(**{"checkpoint.on_nonfinite": "rollback", "log_every": 4})
  summary = train(cfg, str(tmp_path))
  assert summary["nonfinite_rollbacks"] == 1
  assert summary["tokens_trained_this_run"] == STEPS * 16 * 16  # Steps 5 and 6 kept, 7 and 8 redone.


def _listing(workdir):
  return sorted(os.listdir(os.path.join(workdir, "checkpoints")))


def _raising(fault):
  """Orbax's restore raising `fault` (as tensorstore and XLA raise it) for a checkpoint it can read."""
  import orbax.checkpoint as ocp

  def failing_restore(self, step, args=None, **kw):
    raise fault

  return lambda m: m.setattr(ocp.CheckpointManager, "restore", failing_restore)


def _devices_report(free_bytes):
  """The devices reporting their memory as an accelerator's allocator does, with little of it free;
  Orbax must then not be asked to restore at all."""

  def inject(m):
    _raising(AssertionError("restore attempted"))(m)
    stats = {"bytes_limit": free_bytes + 2**20, "bytes_in_use": 2**20}
    m.setattr(type(jax.devices()[0]), "memory_stats", lambda self: stats)

  return inject


@pytest.mark.parametrize(
  "inject, code, words",
  [
    (
      _raising(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 2.00GiB")),
      5,
      "out of memory",
    ),
    (_raising(OSError(5, "Input/output error")), 3, "fix what failed"),
    (_devices_report(4096), 5, "which has 0.00 GiB free; give it more devices"),
  ],
  ids=["out_of_memory", "EIO", "too_big_for_the_devices"],
)
def test_a_restore_that_fails_but_is_not_damage_stops_and_touches_nothing(
  tmp_path, straight, monkeypatch, inject, code, words
):
  """Orbax raising out of memory or an I/O error while it reads a whole checkpoint, or devices too
  small for the state (said before reading): one error naming the checkpoint and what to change, a
  restartable or resources exit code, no checkpoint set aside, no history truncated; the rerun
  without the fault continues bit for bit."""
  from trainer.checkpoint import proof

  workdir = str(tmp_path)
  train(_cfg(), workdir, stop_after=6)
  assert proof.verify(os.path.join(workdir, "checkpoints", "6")) is True  # Proven whole.
  before, metrics = _listing(workdir), open(os.path.join(workdir, "metrics.jsonl")).read()
  with monkeypatch.context() as m:
    inject(m)
    with pytest.raises(proof.RestoreFailed) as e:
      train(_cfg(), workdir)
  assert e.value.exit_code == code and "checkpoint 6" in str(e.value) and words in str(e.value), e.value
  assert "\n" not in str(e.value) and ("checksums match" in str(e.value) or "not restored" in str(e.value))
  assert _listing(workdir) == before  # Nothing renamed, nothing deleted.
  assert open(os.path.join(workdir, "metrics.jsonl")).read() == metrics
  train(_cfg(), workdir)
  np.testing.assert_array_equal(_trajectory(workdir), straight)


def test_cpu_devices_are_bounded_by_the_hosts_memory():
  """CPU devices report no memory of their own: the host's MemAvailable (or a cgroup's limit) bounds
  them, so a state larger than the machine is refused before it is read."""
  from trainer import device_memory

  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  available = device_memory.host_available_bytes()
  assert 0 < available < 2**50
  small = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharding)
  huge = jax.ShapeDtypeStruct((available // 4 + 2**20,), jnp.float32, sharding=sharding)
  assert device_memory.shortfall({"w": small}) is None
  assert "of host memory" in device_memory.shortfall({"w": small, "v": huge})


def test_a_changed_byte_is_proven_damage_and_an_unproven_checkpoint_is_judged_by_its_error(
  tmp_path, straight
):
  """One byte changed in an array file (same size: Orbax itself may read it without complaint): the
  checksums prove damage, the checkpoint is set aside and the run falls back, bitwise."""
  from trainer.checkpoint import proof

  workdir = str(tmp_path)
  train(_cfg(), workdir, stop_after=6)
  state_dir = os.path.join(workdir, "checkpoints", "6", "state")
  arrays = [os.path.join(r, n) for r, _, names in os.walk(state_dir) for n in names if "/d/" in r + "/"]
  path = max(arrays, key=os.path.getsize)
  with open(path, "r+b") as f:
    first = f.read(1)
    f.seek(0)
    f.write(bytes([first[0] ^ 0xFF]))
  assert "changed" in proof.verify(os.path.join(workdir, "checkpoints", "6"))
  train(_cfg(), workdir)
  assert any(name.startswith("damaged-6-") for name in _listing(workdir))
  np.testing.assert_array_equal(_trajectory(workdir), straight)

  # Without checksums (written before they existed) a failure's kind decides: EIO is not damage.
  from trainer.cluster import failures

  assert failures.failure_kind(OSError(5, "Input/output error")) == "environment"
  assert failures.failure_kind(ValueError("Error opening chunk: DATA_LOSS")) is None
  wrapped = RuntimeError("restore failed")
  wrapped.__cause__ = MemoryError()
  assert failures.failure_kind(wrapped) == "resources"


def test_checksums_are_written_in_shares_and_prove_only_when_every_share_landed(tmp_path):
  """Each of 3 processes records every 3rd file; all shares together prove the checkpoint whole on
  any number of readers, a missing share leaves it unproven (not damaged), a changed file is proof."""
  from trainer.checkpoint import proof

  for i in range(7):
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "state" / f"f{i}").write_bytes(bytes([i]) * (100 + i))
  for i in range(3):
    proof.write(str(tmp_path), (i, 3))
  assert all(proof.verify(str(tmp_path), (i, 2)) is True for i in range(2))
  (tmp_path / "state" / "f4").write_bytes(bytes([9]) * 104)
  assert "state/f4 changed" in proof.verify(str(tmp_path))
  os.remove(tmp_path / "checksums-1-of-3.json")
  assert proof.verify(str(tmp_path)) is False


def test_a_checkpoint_proven_by_sha256_before_the_switch_to_xxh3_is_still_proven(tmp_path):
  """Checkpoints written before version 2 record SHA-256 digests: still whole, still damage when changed."""
  from trainer.checkpoint import proof

  (tmp_path / "state").mkdir()
  (tmp_path / "state" / "f0").write_bytes(b"weights" * 100)
  files = {"state/f0": [700, hashlib.sha256(b"weights" * 100).hexdigest()]}
  (tmp_path / "checksums-0-of-1.json").write_text(json.dumps({"version": 1, "files": files}))
  assert proof.verify(str(tmp_path)) is True
  proof.write(str(tmp_path), (0, 1))  # Written now: XXH3-128.
  written = json.loads((tmp_path / "checksums-0-of-1.json").read_text())
  assert written["version"] == 2 and written["files"]["state/f0"][1].startswith("xxh3_128:"), written
  (tmp_path / "checksums-0-of-1.json").write_text(json.dumps({"version": 1, "files": files}))
  (tmp_path / "state" / "f0").write_bytes(b"weighty" * 100)
  assert proof.verify(str(tmp_path)) == "state/f0 changed (checksum differs)"


def test_checksum_shares_are_balanced_by_bytes_and_hold_every_file_once(tmp_path):
  """Files of very unequal sizes, as Orbax writes them: together the n shares are every file exactly
  once, and no process has more than the largest file above another. On disk, 4 large files and 4
  small ones by turns, which every n-th file by name split 16,000 : 400 bytes, are 8,200 : 8,200; and a
  changed file is checked by exactly one of the readers."""
  from trainer.checkpoint import proof

  sizes = {f"state/f{i:02d}": int(s) + 1 for i, s in enumerate(np.random.default_rng(0).lognormal(8, 2, 60))}
  for n in (1, 2, 3, 8, 61):
    shares = [proof.share(sizes, i, n) for i in range(n)]
    assert sorted(sum(shares, [])) == sorted(sizes)
    loads = [sum(sizes[f] for f in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values()), (n, loads)

  (tmp_path / "state").mkdir()
  for i in range(8):
    (tmp_path / "state" / f"f{i}").write_bytes(bytes([i]) * (4000 if i % 2 == 0 else 100))
  for i in range(2):
    proof.write(str(tmp_path), (i, 2))
  loads = []
  for i in range(2):
    with open(tmp_path / f"checksums-{i}-of-2.json") as f:
      loads.append(sum(size for size, _ in json.load(f)["files"].values()))
  assert loads == [8200, 8200]
  (tmp_path / "state" / "f2").write_bytes(bytes([9]) * 4000)
  assert sorted(str(proof.verify(str(tmp_path), (i, 2))) for i in range(2)) == [
    "True",
    "state/f2 changed (checksum differs)",
  ]
