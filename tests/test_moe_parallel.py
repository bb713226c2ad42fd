"""A mixture of experts split over the expert axis, through main.py: verify passes across two
processes with the auxiliary losses in the objective; the first-step check covers the routed step; a
kill -9 mid-run resumes bit for bit; a resume on another expert-axis size continues the same run."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, kill_while_waiting_for_batch, read_jsonl, run_main, train_losses

pytestmark = pytest.mark.slow

STEPS = 8
# 8 experts, top 2, capacity routing on the (data 2, fsdp 2, expert 2) mesh, 1 routed block.
FLAGS = ["--config=configs/moe_smoke_cpu.py:tiny", f"--config.steps={STEPS}", "--cpu_devices=8"]


def _rows(workdir):
  return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]


def test_verify_in_two_processes_on_an_expert_mesh_passes(tmp_path):
  launcher = [sys.executable, os.path.join(REPO, "launch", "local.py"), "--processes=2", "--cpu_devices=4"]
  flags = ["--mode=verify", FLAGS[0], "--config.microbatches=2", f"--workdir={tmp_path}"]
  result = subprocess.run([*launcher, "--", *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  out = result.stdout
  assert "mesh {'data': 2, 'fsdp': 2, 'expert': 2, 'context': 1, 'tensor': 1}" in out, out
  assert "mesh_vs_one       3  blocks/0/mlp " in out and out.strip().endswith("verify: PASS"), out


def test_first_step_check_kill_resume_and_another_expert_size(tmp_path):
  whole, killed, moved = (str(tmp_path / n) for n in ("whole", "killed", "moved"))
  result = run_main(
    *FLAGS,
    "--config.checks.first_step=True",
    "--config.checks.first_step_every_run=True",
    f"--workdir={whole}",
  )
  assert result.returncode == 0, result.stdout + result.stderr
  # The routed step against another layout that keeps the experts split.
  other = "agree with mesh {'data': 4, 'fsdp': 1, 'expert': 2, 'context': 1, 'tensor': 1} (strategy dp)"
  assert other in result.stdout
  rows = _rows(whole)
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  for r in rows:
    # The loss is the cross-entropy plus the weighted aux losses, all per valid token.
    assert r["loss"] == pytest.approx(r["xent"] + 0.01 * r["moe_balance"] + 0.001 * r["router_z"], rel=1e-5)
    assert sum(r[f"expert_load_{e:02d}"] for e in range(8)) == pytest.approx(1.0, abs=1e-5)
    assert 0.0 <= r["moe_dropped"] < 0.5 and r["router_entropy"] > 0

  # kill -9 while the loop waits for global batch 5 (checkpoints 2 and 4 saved or saving), then resume.
  kill_while_waiting_for_batch(5, *FLAGS, workdir=killed)
  result = run_main(*FLAGS, f"--workdir={killed}")
  assert result.returncode == 0, result.stdout + result.stderr
  assert train_losses(killed) == train_losses(whole)  # Bit for bit.

  # Step 6's checkpoint onto expert 4 (data 1): the same run goes on, up to verify's loss tolerance.
  shutil.copytree(whole, moved)
  shutil.rmtree(os.path.join(moved, "checkpoints", str(STEPS)))
  result = run_main(
    *FLAGS,
    "--config.mesh.data=1",
    "--config.mesh.expert=4",
    "--config.checks.first_step=True",
    "--config.checks.first_step_every_run=True",
    f"--workdir={moved}",
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert "(strategy dp)" in result.stdout and "'expert': 4" in result.stdout  # Checked again: a new layout.
  a, b = train_losses(whole), train_losses(moved)
  assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
  for s in (7, 8):
    assert b[s] == pytest.approx(a[s], rel=1e-5), (s, a[s], b[s])
