"""A seeded schedule kills processes of a 2-process job ten times, at random moments (start-up,
mid-step, mid-save, mid-evaluation), while launch/local.py restarts it; the last kill is for good
(the slot cannot come back) and the job continues on one process (--elastic). At the end the loss
trajectory equals an uninterrupted 2-process run's (bitwise before the shrink, within 1e-5 after),
every global batch was trained exactly once in the final history, and every checkpoint restores
whole and finite."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import psutil
import pytest

from tests.conftest import REPO, TINY_FLAGS, read_jsonl, train_losses

pytestmark = pytest.mark.slow

SEED = 20261201
STEPS = 24
KINDS = ("startup", "step", "save", "eval")
FLAGS = [
  *(f for f in TINY_FLAGS if not f.startswith("--config.mesh.data=")),
  "--config.mesh.data=-1",  # So that one process (4 devices) can continue: data 2 -> 1.
  f"--config.steps={STEPS}",
  "--config.eval_every=4",
  "--config.eval_steps=1",
]


def schedule(seed: int) -> list[tuple[str, int]]:
  """Nine (moment, process) kills drawn from the seed, then process 1 mid-step, for good."""
  rng = np.random.default_rng(seed)
  return [(str(rng.choice(KINDS)), int(rng.integers(2))) for _ in range(9)] + [("gone", 1)]


class _Job:
  def __init__(self, workdir, gone_marker, *launcher_flags, pauses=None):
    main = ["--main=tests/main_with_pauses.py", "--", pauses] if pauses else ["--"]
    self.proc = subprocess.Popen(
      [sys.executable, "launch/local.py", "--processes=2", "--cpu_devices=4", *launcher_flags, *main]
      + [*FLAGS, f"--workdir={workdir}"],
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={**os.environ, "GONE_MARKER": str(gone_marker)},
    )
    self.lines: list[str] = []
    threading.Thread(
      target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True
    ).start()

  def children(self) -> dict[int, psutil.Process]:
    out = {}
    try:
      children = psutil.Process(self.proc.pid).children()
    except psutil.NoSuchProcess:  # The launcher has exited.
      return out
    for p in children:
      try:
        ids = [a for a in p.cmdline() if a.startswith("--process_id=")]
      except psutil.NoSuchProcess:
        continue
      if ids:
        out[int(ids[0].split("=")[1])] = p
    return out

  def wait_for(self, predicate, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
      if (found := predicate()) is not None:
        return found
      assert self.proc.poll() is None, "the job ended before the schedule did:\n" + "".join(self.lines[-40:])
      time.sleep(0.02)
    raise AssertionError("timed out:\n" + "".join(self.lines[-40:]))


def _new_launch(job, seen: set[int]) -> dict | None:
  """The job's two processes, once they are a launch the schedule has not seen yet."""
  children = job.children()
  return children if len(children) == 2 and not {p.pid for p in children.values()} & seen else None


def _last_step(workdir):
  try:
    return max(train_losses(str(workdir)), default=0)
  except (OSError, ValueError):
    return 0


def test_ten_random_kills_and_a_lost_host_leave_the_trajectory_of_an_uninterrupted_run(tmp_path):
  events = schedule(SEED)
  assert events == schedule(SEED)  # Reproducible from its seed.
  workdir, marker = tmp_path / "chaos", tmp_path / "gone"
  # The uninterrupted 2-process run, meanwhile: it fills the chaos job's idle moments (back-offs, pauses).
  straight = tmp_path / "straight"
  reference = _Job(straight, marker)
  job = _Job(
    workdir,
    marker,
    "--max_restarts=12",
    "--restart_backoff_s=0",
    "--elastic",
    pauses="save=0.15,eval=0.15,gone/p1",
  )
  try:
    previous: set[int] = set()
    for kind, process in events:
      children = job.wait_for(lambda seen=previous: _new_launch(job, seen))
      previous = {p.pid for p in children.values()}
      start_line, start_step = len(job.lines), _last_step(workdir)
      if kind == "startup":
        time.sleep(float(np.random.default_rng(SEED + len(job.lines)).uniform(0, 1.0)))
      elif kind in ("step", "gone"):
        job.wait_for(lambda s=start_step: _last_step(workdir) > s + 1 or None)
      else:  # Mid-save or mid-evaluation: while the pause holds it open.
        job.wait_for(
          lambda n=start_line, k=kind: any(f"pause: {k}" in line for line in job.lines[n:]) or None
        )
      if kind == "gone":
        marker.touch()
      children[process].send_signal(signal.SIGKILL)
    job.proc.wait(timeout=240)
  finally:
    for p in job.children().values():
      p.kill()
    if job.proc.poll() is None:
      job.proc.kill()
  out = "".join(job.lines)
  assert job.proc.returncode == 0, out[-4000:]
  assert "slot 1 did not come back: continuing on 1 processes" in out
  assert "[launch] restart 1/12: process " in out and " killed by SIGKILL; resuming from " in out

  assert reference.proc.wait(timeout=240) == 0, "".join(reference.lines)

  rows = [r for r in read_jsonl(str(workdir / "metrics.jsonl")) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # Nothing skipped or repeated.
  assert [r["batch"] for r in rows] == list(range(STEPS))  # Each global batch exactly once.
  with open(workdir / "summary.json") as f:
    summary = json.load(f)
  recoveries = summary["recoveries"]
  shrunk = max(r["step"] for r in recoveries if r["processes"] == 1)  # The checkpoint it resumed on 1.
  a, b = train_losses(str(workdir)), train_losses(str(straight))
  assert {s: a[s] for s in a if s <= shrunk} == {s: b[s] for s in b if s <= shrunk}  # Bitwise.
  for s in range(shrunk + 1, STEPS + 1):
    assert abs(a[s] - b[s]) <= 1e-5 * abs(b[s]), (s, a[s], b[s])

  from trainer.modes import export

  steps = sorted(int(n) for n in os.listdir(workdir / "checkpoints"))
  assert steps and all(n.isdigit() for n in os.listdir(workdir / "checkpoints"))  # No partial save left.
  for step in steps:
    loaded = export.load(str(workdir), step, with_optimizer=True)
    leaves = jax.tree.leaves((loaded.params, loaded.opt_state))
    assert loaded.step == step and all(np.isfinite(x).all() for x in leaves if x.dtype.kind == "f"), step
  # A restart loads process 0's compiled step from the cache. On XLA:CPU JAX writes entries from
  # process 0 alone and every process's key differs, so the others compile again (GPUs share one key).
  process_0 = read_jsonl(str(workdir / "processes" / "process_0.jsonl"))
  starts = [r for r in process_0 if r.get("event") == "start"]
  assert any(r["compiled_from_cache"] for r in starts), starts
  worst = max(recoveries, key=lambda r: r["total_s"])
  print(f"restarts {len(recoveries)}; worst recovery: {json.dumps(worst)}")
