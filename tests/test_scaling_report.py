"""benchmarks.scaling: weak and strong points, their efficiencies, the labelled plot and prediction."""

import json

from tests.conftest import valid_png


def test_scaling_measures_weak_and_strong_points_and_plots_them(tmp_path):
  from benchmarks import scaling

  args = ["--config=configs/smoke_cpu.py:tiny", "--devices=1,2", "--strategies=dp", "--modes=weak,strong"]
  rows = scaling.main([*args, "--steps=1", f"--out={tmp_path}", "--bandwidth_gbps=10"])
  assert [(r["mode"], r["devices"], r["global_batch"]) for r in rows] == [
    ("weak", 1, 8),
    ("weak", 2, 16),
    ("strong", 1, 16),
    ("strong", 2, 16),
  ]
  for r in rows:
    one = next(o for o in rows if o["mode"] == r["mode"] and o["devices"] == 1)
    assert r["efficiency"] == r["units_per_s"] / (r["devices"] * one["units_per_s"])
    assert (r["sent_bytes_per_device"] > 0) == (r["devices"] > 1)  # Gradients cross only with 2.
    assert 0 < r["predicted_efficiency"] <= 1.0 + 1e-9
  with open(tmp_path / "scaling.json") as f:
    out = json.load(f)
  assert out["label"].startswith("logical CPU devices on ") and "not an interconnect" in out["label"]
  assert out["predicted_for"] == "10 GB/s per device"
  assert valid_png(tmp_path / "scaling.png")
