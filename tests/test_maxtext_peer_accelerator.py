"""benchmarks/maxtext_peer_accelerator.py: a CPU dry run measures ours alone and prints the table; the
table compares ours with MaxText's fastest variant, leaves failed ones out and says why, and gives both
sides an MFU by the same FLOP count."""

import pytest

from benchmarks import maxtext_peer_accelerator as peer
from tests.conftest import run_python


def test_a_cpu_dry_run_measures_ours_alone():
  result = run_python("benchmarks/maxtext_peer_accelerator.py", "--shapes=tiny", "--steps=12", timeout=300)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  row = next(line for line in result.stdout.splitlines() if line.startswith("tiny "))
  assert float(row.split()[1]) > 0 and row.split()[2:] == ["-"] * 5  # No peak on CPUs, no MaxText.
  assert "repeat: python benchmarks/maxtext_peer_accelerator.py --shapes=tiny --steps=12" in result.stdout


def test_the_table_takes_maxtexts_best_variant_and_one_flop_count():
  results = {
    "L": {
      "ours": {"step_s": 0.300, "flops_per_step": 60e12},
      "maxtext": {
        "defaults": {"step_s": 0.413},
        "flash_minimal": {"step_s": 0.383},
        "unrolled": {"error": "exit 1: RESOURCE_EXHAUSTED: Out of memory"},
      },
    }
  }
  lines = peer.table(results, {"L": 32768}, peak=200e12)
  cells = lines[1].split()
  assert cells[:6] == ["L", "300.0", "1.000", "383.0", "0.783", "flash_minimal"]
  assert cells[6] == f"{0.383 / 0.300:.2f}x"
  assert "L MaxText unrolled: exit 1: RESOURCE_EXHAUSTED: Out of memory" in lines


@pytest.mark.parametrize("shape", ["S", "L", "B"])
def test_both_sides_get_the_same_shape(shape):
  batch, seq, embed, layers, heads, kv, mlp, vocab = peer.SHAPES[shape]
  ours = dict(f.removeprefix("--config.").split("=", 1) for f in peer.ours_flags(shape, 4, 40)[1:])
  theirs = dict(s.split("=", 1) for s in peer.maxtext_shape(shape, 40, "run", "/tmp/out"))
  assert int(ours["global_batch_size"]) == 4 * int(theirs["per_device_batch_size"]) == 4 * batch
  pairs = [("data.seq_len", "max_target_length"), ("model.embed_dim", "base_emb_dim")]
  pairs += [("model.num_layers", "base_num_decoder_layers"), ("model.num_heads", "base_num_query_heads")]
  pairs += [("model.num_kv_heads", "base_num_kv_heads"), ("model.mlp_dim", "base_mlp_dim")]
  pairs += [("model.vocab_size", "vocab_size")]
  for a, b in pairs:
    assert ours[a] == theirs[b], (a, b)
  assert int(theirs["head_dim"]) * heads == embed
