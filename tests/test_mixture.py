"""data.source='mixture': weights over prepared data sets, mixed deterministically whatever the
topology. One process and two see the same mixed batches, a kill -9 resume continues them exactly,
each source's share is in the metrics, and another weighting is another fingerprint (a resume on it
is refused like any change of data)."""

import os
import re

import numpy as np
import pytest

from data import mixture, prepare
from errors import UserError
from tests.conftest import kill_while_waiting_for_batch, read_jsonl, run_main, tiny_config
from tests.test_local_launcher import _launch

pytestmark = pytest.mark.slow


class _Records:
  def __init__(self, n, tag):
    self.n, self.tag = n, tag

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    return {"tokens": np.asarray([self.tag, i], np.int32)}


def test_each_block_holds_every_source_at_its_weight_spread_evenly():
  source = mixture.MixtureSource([_Records(50, 0), _Records(3000, 1), _Records(700, 2)], [0.5, 0.3, 0.2])
  assert source.counts == [512, 307, 205] and len(source) == 3750
  picks = np.asarray([source[i]["source"] for i in range(len(source))])
  for start in (0, 1024, 2048):  # Any whole block: the quotas exactly; any stretch: about the shares.
    assert np.bincount(picks[start : start + 1024]).tolist() == source.counts
    assert abs(np.mean(picks[start : start + 100] == 0) - 0.5) <= 0.02
  rows = [tuple(source[i]["tokens"]) for i in range(len(source))]
  small = [r[1] for r in rows if r[0] == 0]
  assert small[:60] == list(range(50)) + list(range(10))  # Taken in order, then again from the start.
  assert rows == [tuple(source[i]["tokens"]) for i in range(len(source))]  # A pure function of i.
  assert [round(p, 2) for p in source.passes()] == [37.5, 0.37, 1.07]
  assert mixture.quotas([0.9999, 0.0001]) == [1023, 1]  # Every source at least once per block.
  # A held-out split without the first data set: the others keep their names and relative weights.
  held_out = mixture.MixtureSource([_Records(10, 1), _Records(10, 2)], [0.3, 0.2], ids=[1, 2])
  assert held_out.counts == [614, 410] and {held_out[i]["source"] for i in range(20)} == {1, 2}
  for spec in ("a:1", "a:1,b", "a:1,b:0", "a:1,b:x"):
    with pytest.raises(UserError, match="data.mixture"):
      mixture.parse(spec)
  assert mixture.names("x/a:1,y/a:2,b:1") == ["a_0", "a_1", "b"]


def test_each_source_is_read_through_in_order_across_epochs():
  """Through the pipeline, epoch after epoch: the big source weighted below its size is read whole
  before any record twice, and the small one weighted above its size cycles evenly."""
  from data.pipeline import PAD, BatchPlan, LocalBatches

  big, small = _Records(2000, 0), _Records(200, 1)
  source = mixture.MixtureSource([big, small], [0.1, 0.9])
  plan = BatchPlan(len(source), 64, seed=3)
  make_batch = lambda records, valid: {"tokens": records["tokens"], "weights": valid.astype(np.float32)}
  read = LocalBatches(source, plan, (0, 64), make_batch)
  counts = [np.zeros(len(big), int), np.zeros(len(small), int)]
  for epoch in range(10):
    for t in range(epoch * plan.batches_per_epoch, (epoch + 1) * plan.batches_per_epoch):
      rows = read(t)["tokens"][plan.record_ids(t) != PAD]
      for k in (0, 1):
        np.add.at(counts[k], rows[rows[:, 0] == k, 1], 1)
    for k in (0, 1):  # Read in order and cycled: at every epoch's end no record is 2 reads ahead.
      assert counts[k].max() - counts[k].min() <= 1, (epoch, k, np.bincount(counts[k]))
  assert source.per_epoch == [219, 1981] and counts[0].min() == 1  # 10 x 219 reads cover all 2,000.
  assert counts[1].sum() == 10 * 1981 and counts[1].min() == 99


def test_a_run_saved_under_the_old_mixture_order_is_refused_naming_the_change():
  from types import SimpleNamespace

  from data.sources import recipe_fingerprint
  from trainer.checkpoint import store

  recipe = [["abc", 0.75], ["def", 0.25]]
  plan = SimpleNamespace(seed=0, num_records=700, global_batch_size=8)
  comp = SimpleNamespace(plan=plan, sources=SimpleNamespace(fingerprint="x"))
  for old, same in (
    (recipe_fingerprint("mixture", recipe), "the same records"),
    ("mixture-" + "0" * 16, "other"),
  ):
    comp.sources.fingerprint = old
    saved = store.data_position(4, 0, comp)
    comp.sources.fingerprint = recipe_fingerprint("mixture", recipe, order=mixture.ORDER)
    with pytest.raises(UserError, match=f"{same}.*mixture's order changed \\(order version 1 -> 2\\)"):
      store.check_data_position(saved, 4, comp, allow_changed_data=False)
    store.check_data_position(saved, 4, comp, allow_changed_data=True)  # Still the user's choice.


def _rows(workdir):
  return {r["step"]: r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r}


def test_one_process_and_two_see_the_same_mixed_batches_and_a_kill_resumes_them(tmp_path):
  for name, alphabet in (("letters", b"abcdefgh "), ("digits", b"0123456789 ")):
    rng = np.random.default_rng(len(name))
    (tmp_path / f"{name}.txt").write_bytes(bytes(rng.choice(list(alphabet), 6000).tolist()))
    prepare.prepare([str(tmp_path / f"{name}.txt")], str(tmp_path / name), seq_len=16)
  spec = f"{tmp_path / 'letters'}:3,{tmp_path / 'digits'}:1"
  base = ["--config=configs/smoke_cpu.py:tiny", "--config.data.source=mixture", "--config.steps=8"]
  base += ["--config.model.vocab_size=258", "--config.checkpoint.every=2"]
  flags = [*base, f"--config.data.mixture={spec}"]
  one, two, killed = (str(tmp_path / n) for n in ("one", "two", "killed"))
  straight = run_main("--cpu_devices=8", *flags, f"--workdir={one}")
  assert straight.returncode == 0, straight.stderr
  assert (
    "mixture of 2 data sets, 700 records per epoch: letters 75% (1.50 passes), digits 25%" in straight.stdout
  )

  result = _launch("--processes=2", "--cpu_devices=4", "--", *flags, f"--workdir={two}", tag=two, timeout=240)
  assert result.returncode == 0, result.stdout + result.stderr

  kill_while_waiting_for_batch(5, "--cpu_devices=8", *flags, workdir=killed, checkpoint=4)
  assert max(_rows(killed)) < 8
  resumed = run_main("--cpu_devices=8", *flags, f"--workdir={killed}")
  assert resumed.returncode == 0, resumed.stderr
  # From checkpoint 4, or a newer copy of the local tier (the copy of step 5 may be whole or not yet).
  assert re.search(r"resumed from checkpoint 4|restored step [45] from the local tier", resumed.stdout)

  a, b, c = _rows(one), _rows(two), _rows(killed)
  assert sorted(a) == sorted(b) == sorted(c) == list(range(1, 9))
  shares = ("share_letters", "share_digits")
  for step in a:
    assert a[step]["share_letters"] + a[step]["share_digits"] == pytest.approx(1.0)
    assert [a[step][k] for k in (*shares, "loss")] == [c[step][k] for k in (*shares, "loss")], step
    assert [a[step][k] for k in shares] == [b[step][k] for k in shares], step
    assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-5), step
  assert abs(np.mean([a[s]["share_letters"] for s in a]) - 0.75) < 0.1
  # Each data set's own held-out loss beside the mixture's, the same on 1 and 2 processes.
  final = lambda w: [r for r in read_jsonl(os.path.join(w, "metrics.jsonl")) if "eval_loss" in r][-1]
  for k in ("eval_letters_loss", "eval_digits_loss"):
    assert final(one)[k] == pytest.approx(final(two)[k], rel=1e-5), k
  assert final(one)["eval_letters_loss"] != final(one)["eval_digits_loss"]

  # Another weighting is other data: its fingerprint differs, so a resume on it is refused.
  from experiments import lm

  fingerprint = lambda s: (
    lm.data_sources(
      tiny_config(**{"data.source": "mixture", "data.mixture": s, "model.vocab_size": 258})
    ).fingerprint
  )
  assert fingerprint(spec) == fingerprint(spec.replace(":3", ":6").replace(":1", ":2"))  # Normalized.
  assert fingerprint(spec) != fingerprint(spec[:-1] + "2")
