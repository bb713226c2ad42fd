"""The local tier's copies on one host, without a job: where a copy is taken (the devices or pinned host
memory) and how much host memory the tiers need, the copy's format (data, never a pickle), which copies
are kept and whole, and which a restart resumes from (trainer/checkpoint/local_*.py)."""

import json
import os

import numpy as np
import pytest

from tests.test_checkpoint_recovery import _cfg, _tear, _trajectory
from trainer.checkpoint import local, local_copies, local_restore
from trainer.train import train


def test_a_local_dir_in_host_memory_needs_the_memory_too(tmp_path, monkeypatch):
  """A tmpfs as large as the host's memory has room for copies the memory cannot hold beside the
  process and the copy in flight: the room is then the memory available (a TPU host ran out of it)."""
  from trainer import device_memory
  from trainer.checkpoint import local_room

  assert local_room._in_memory("/proc/self") is False
  monkeypatch.setattr(local_room, "_in_memory", lambda folder: True)
  mib = 2**20  # 4 copies of 1 MiB held, 2 MiB in flight: 6 MiB.
  monkeypatch.setattr(device_memory, "host_available_bytes", lambda: 6 * mib)
  assert local_room.shortfall(str(tmp_path), mib, partnered=False) is None
  monkeypatch.setattr(device_memory, "host_available_bytes", lambda: 6 * mib - 1)
  why = local_room.shortfall(str(tmp_path), mib, partnered=False)
  assert why.startswith(f"checkpoint.local_dir={tmp_path} is in host memory, of which 6.0 MiB"), why
  assert "and 2.0 MiB for the copy in flight" in why, why
  monkeypatch.setattr(local_room, "_in_memory", lambda folder: False)  # On a disk: the disk's room.
  assert local_room.shortfall(str(tmp_path), mib, partnered=False) is None


def test_the_partner_lives_on_another_host_where_there_is_one():
  assert local.partner(0, ["a", "a", "b", "b"]) == 2 and local.partner(3, ["a", "a", "b", "b"]) == 0
  assert local.partner(1, ["h", "h"]) == 0  # One host: the next process.
  holdings = {0: {"own": [4, 5], "held": {"1": [4, 5]}}, 1: {"own": [4], "held": {"0": [4, 5]}}}
  assert local_restore.newest_common(holdings, 2) == 5  # Process 1's step 5 from process 0's hands.
  holdings[0]["held"] = {}
  assert local_restore.newest_common(holdings, 2) == 4


def test_a_torn_or_garbled_copy_is_never_whole(tmp_path):
  blob = b"shards"
  manifest = {"step": 3, local_copies.CHECKSUM: local_copies.checksum(blob), "fingerprint": "f"}
  local_copies.write_copy(str(tmp_path), 3, blob, manifest)
  local_copies.write_copy(str(tmp_path), 4, blob, {**manifest, "step": 4})
  (tmp_path / "5.tmp").mkdir()  # A kill before the rename.
  (tmp_path / "5.tmp" / local_copies.SHARDS).write_bytes(b"shar")
  assert local_copies.whole_copies(str(tmp_path)) == {3: "f", 4: "f"}
  (tmp_path / "4" / local_copies.SHARDS).write_bytes(b"shardz")  # Damaged after the fact.
  assert local_copies.whole_copies(str(tmp_path)) == {3: "f"}
  torn = os.stat(tmp_path / "5.tmp" / local_copies.SHARDS).st_ino
  for step in (5, 6, 7):
    local_copies.write_copy(str(tmp_path), step, blob, {**manifest, "step": step})
  assert os.stat(tmp_path / "5" / local_copies.SHARDS).st_ino == torn  # Written over, as a spare is.
  # The newest KEEP and the copy out of them kept as the spare; torn leftovers removed.
  assert sorted(os.listdir(tmp_path)) == ["5", "6", "7", "spare"]
  assert os.listdir(tmp_path / "spare") == [local_copies.SHARDS]  # Its manifest gone: never whole.
  assert sorted(local_copies.whole_copies(str(tmp_path))) == [5, 6, 7]
  spare = os.stat(tmp_path / "spare" / local_copies.SHARDS).st_ino
  short = b"s"  # Written over the spare's longer file: its tail cut, its checksum whole.
  manifest = {**manifest, "step": 8, local_copies.CHECKSUM: local_copies.checksum(short)}
  local_copies.write_copy(str(tmp_path), 8, short, manifest)
  assert os.stat(tmp_path / "8" / local_copies.SHARDS).st_ino == spare
  assert local_copies.read_copy(str(tmp_path), 8)[1] == short
  assert sorted(os.listdir(tmp_path)) == ["6", "7", "8", "spare"]


def test_the_newest_copy_a_check_saw_outlives_the_newest_three_and_a_run_with_checks_resumes_from_it(
  tmp_path,
):
  blob = b"shards"
  manifest = {local_copies.CHECKSUM: local_copies.checksum(blob), "fingerprint": "f"}
  for step in range(1, 9):  # A check at steps 2 and 4 (checks.replica_every=2, say) then none.
    local_copies.write_copy(str(tmp_path), step, blob, {**manifest, "step": step, "checked": step in (2, 4)})
  assert sorted(local_copies.whole_copies(str(tmp_path))) == [4, 6, 7, 8]  # Step 2's is gone: 4 is newer.
  holdings = {0: {"own": [4, 6, 7, 8], "held": {}, "checked": {"own": [4], "held": {}}}}
  assert local_restore.newest_common(holdings, 1) == 8
  assert local_restore.newest_common(holdings, 1, checked=True) == 4
  two = {  # Process 1's checked copy of 4 held by process 0 only.
    0: {"own": [4, 5], "held": {"1": [4, 5]}, "checked": {"own": [4], "held": {"1": [4]}}},
    1: {"own": [5], "held": {"0": [4, 5]}, "checked": {"own": [], "held": {"0": [4]}}},
  }
  assert local_restore.newest_common(two, 2) == 5 and local_restore.newest_common(two, 2, checked=True) == 4


def test_a_copy_is_data_read_back_exactly_and_a_header_that_lies_is_refused():
  """shards.bin: JSON and raw bytes, read as numpy views; never unpickled, whatever a partner sends."""
  import ml_dtypes

  shards = {
    "params/w": {((0, 2), (0, 3)): np.arange(6, dtype=np.float32).reshape(2, 3)},
    "opt/mu": {((0, 4),): np.arange(4).astype(ml_dtypes.bfloat16), ((4, 8),): np.ones(4, ml_dtypes.bfloat16)},
    "step": {(): np.array(7, np.int32)},
  }
  record = {"step": 7, "position": {"batch": 7}, "config": {"seed": 1}, "shards": shards}
  parts = []
  local_copies.dump_record(record, parts.append)
  blob = b"".join(bytes(p) for p in parts)
  back = local_copies.load_record(blob)
  assert {k: v for k, v in back.items() if k != "shards"} == {
    k: v for k, v in record.items() if k != "shards"
  }
  for path, by_index in shards.items():
    for index, array in by_index.items():
      got = back["shards"][path][index]
      assert got.dtype == array.dtype and got.shape == array.shape, (path, index)
      np.testing.assert_array_equal(got.astype(np.float32), array.astype(np.float32))
  n = int.from_bytes(blob[:8], "big")
  header = json.loads(blob[8 : 8 + n])

  def lie(**changes):
    entry = {**header["arrays"][0], **changes}
    text = json.dumps({**header, "arrays": [entry]}).encode()
    return len(text).to_bytes(8, "big") + text + blob[8 + n :]

  for changes, why in [
    ({"dtype": "object"}, "not a number's"),
    ({"dtype": "V8"}, "not a number's"),
    ({"shape": [1 << 40]}, "outside its bytes"),
    ({"offset": -8}, "outside its bytes"),
    ({"index": 3}, "does not describe its shards"),
    ({"dtype": "finfo"}, "not a number's"),
  ]:
    with pytest.raises(ValueError, match=why):
      local_copies.load_record(lie(**changes))


def test_the_device_copy_keeps_every_shard_in_buffers_of_its_own_and_comes_back_whole():
  """The copy the next step cannot donate: one program for the whole state, each leaf on its own
  sharding in new buffers; its host shards rebuild the state under the same layout."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from trainer.checkpoint import local_shards

  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  specs = {"w": P("fsdp", "tensor"), "b": P(None, "tensor"), "m": P("data"), "n": P()}
  state = {
    k: jax.device_put(jnp.arange(64.0).reshape(8, 8) + i, NamedSharding(mesh, s))
    for i, (k, s) in enumerate(specs.items())
  }
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
  for take, memory in ((local_shards.device_copy, "device"), (local_shards.pinned_copy, "pinned_host")):
    copy = take(state)
    for k, leaf in state.items():
      assert copy[k].sharding.memory_kind == memory, (k, copy[k].sharding)
      assert copy[k].sharding.with_memory_kind("device").is_equivalent_to(leaf.sharding, leaf.ndim), k
      mine = {s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards}
      assert not mine & {s.data.unsafe_buffer_pointer() for s in copy[k].addressable_shards}, k
    parts = []  # A part per distinct shard: w's 4 (fsdp x tensor), b's 2, m's 2, n's 1; replicas once.
    paced = local_shards.host_copy(copy, 1, lambda parts=parts: parts.append(1))
    for shards in (local_shards.host_copy(copy), paced):
      back = local_shards.to_state(shards, target)
      for k, leaf in state.items():
        assert back[k].sharding.is_equivalent_to(leaf.sharding, leaf.ndim)
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(leaf))
    assert len(parts) == 9


@pytest.mark.parametrize(
  "copy_in, step, limit, place",
  [
    ("auto", 10, None, "device"),  # CPUs report no limit.
    ("auto", 10, 17, "device"),  # The step and one more state (5) fit in 90% of the device.
    ("auto", 11, 17, "host"),
    ("device", 11, 17, "device"),
    ("host", 1, None, "host"),
  ],
)
def test_a_copy_is_taken_on_the_devices_unless_they_lack_room_beside_the_step(copy_in, step, limit, place):
  from trainer.checkpoint import local_room

  assert local_room.copy_place(copy_in, step, 5, limit) == place


def test_a_run_with_replica_checks_resumes_only_from_a_copy_a_check_saw(tmp_path, capsys):
  """A copy holds one replica per shard and its restore puts it on every device: a divergence the
  replica check looks for would be gone. With checks.replica_every=3, the tier copies step 3 beside its
  own every 4; step 4's copy (unchecked) is passed over for step 3's, said in a line, and the
  trajectory is the uninterrupted run's."""
  workdir = str(tmp_path)
  # Copies every 4 steps, and at the checked steps too: 3's exists because a check saw it.
  cfg = lambda: _cfg(**{"checkpoint.local_every": 4, "checkpoint.every": 100, "checks.replica_every": 3})
  train(cfg(), workdir, stop_after=5)
  _tear(workdir, 5)  # The save at the stop (never a copy): the copies of steps 3 and 4 remain.
  train(cfg(), workdir)
  out = capsys.readouterr().out
  assert "local tier: step 4's copy was taken after the last check it can resume from (step 3)" in out, out
  said = "local tier: a run with checks resumes only from a copy a check saw, taken every 3 steps; a lost "
  assert said + "host costs up to 6 steps" in out, out  # lost_steps(3, 3)
  assert "restored step 3 from the local tier: process 0 from its own copy" in out, out
  straight = str(tmp_path / "straight")
  train(cfg(), straight)
  np.testing.assert_array_equal(_trajectory(workdir), _trajectory(straight))
