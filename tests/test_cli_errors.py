"""Mistakes a user can make end the process non-zero with one `error:` line, not a traceback."""

import errno
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_main, train_losses

SMOKE = "--config=configs/smoke_cpu.py"


def _assert_one_error_line(result, *fragments):
  assert result.returncode != 0, result.stdout + result.stderr
  errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
  assert len(errors) == 1, result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  for fragment in fragments:
    assert fragment in errors[0], errors[0]


@pytest.mark.parametrize(
  "args, fragments",
  [
    (["--config.stpes=10"], ["unknown config key 'stpes'", "did you mean 'steps'"]),
    (["--config.mesh.dta=2"], ["unknown config key 'dta'"]),
    (
      ["--config.nosuchkey=1"],
      ["unknown config key 'nosuchkey'", "trainer/config/trainer_keys.py", "experiments/NAME_keys.py"],
    ),
    (["--config.mesh.data=3"], ["mesh", "8 devices"]),
    (["--config.global_batch_size=30"], ["global_batch_size=30", "data-parallel size 4"]),
    (["--config.experiment=nope"], ["experiments/nope.py"]),
    (["--config.sharding.rules=(('batch','dat'),)"], []),
    (["--config.log_every=0"], ["log_every=0"]),
    (["--config.seed=-3"], ["seed=-3", "whole number >= 0"]),
    (["--config.model.compute_dtype=float16"], ["model.compute_dtype='float16'", "'float32', 'bfloat16'"]),
    (
      ["--config.checkpoint.on_nonfinite=rolback"],
      ["checkpoint.on_nonfinite='rolback'", "'stop', 'rollback'"],
    ),
    (["--config.model.embed_dim=0"], ["model.embed_dim=0"]),
    (["--config.data.vocab_size=32000"], ["data.vocab_size=32000", "<= 4096"]),
    (["--config.eval_steps=0"], ["eval_steps=0", "eval_every > 0"]),
    (["--config.mesh.dcn_data=2", "--config.mesh.data=1"], ["number of processes"]),
  ],
)
def test_bad_input_gives_one_error_line(tmp_path, args, fragments):
  result = run_main(SMOKE, f"--workdir={tmp_path}", "--cpu_devices=8", *args)
  _assert_one_error_line(result, *fragments)


def test_a_config_file_setting_an_unknown_key_is_an_error(tmp_path):
  config = tmp_path / "typo.py"
  config.write_text(
    "from configs import base\n\ndef get_config():\n  c = base.get_config()\n  c.stpes = 3\n  return c\n"
  )
  result = run_main(f"--config={config}", f"--workdir={tmp_path}")
  _assert_one_error_line(result, "unknown config key 'stpes'", "did you mean 'steps'")


@pytest.mark.parametrize("where", ["a file", "/proc/x"])
def test_a_workdir_that_cannot_be_made_is_an_error(tmp_path, where):
  (tmp_path / "file").write_text("")
  workdir = tmp_path / "file" if where == "a file" else where
  _assert_one_error_line(
    run_main(SMOKE, f"--workdir={workdir}", "--cpu_devices=8"), f"--workdir={workdir}: cannot create it"
  )


def test_evaluating_a_workdir_never_trained_is_an_error_and_creates_nothing(tmp_path):
  result = run_main(SMOKE, f"--workdir={tmp_path}", "--cpu_devices=8", "--mode=eval")
  _assert_one_error_line(result, "has no checkpoint; train first")
  assert result.returncode == 2 and list(tmp_path.iterdir()) == []


def test_missing_workdir_is_an_error():
  _assert_one_error_line(run_main(SMOKE), "--workdir")


def test_single_device_runs_the_same_code_path_and_caches_its_compilations_for_the_user(tmp_path):
  import json
  import os

  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # The default applies,
  env["XDG_CACHE_HOME"] = str(tmp_path / "user_cache")  # under this test's own folder.
  result = run_main(
    SMOKE,
    f"--workdir={tmp_path}",
    "--cpu_devices=1",
    "--config.mesh.data=1",  # fsdp=2, tensor=2 stay: on one device every axis is 1.
    "--config.steps=3",
    "--config.log_every=1",
    "--config.eval_steps=1",
    "--config.model.num_layers=1",
    env=env,
  )
  assert result.returncode == 0, result.stderr
  assert "1 x cpu" in result.stdout and "step 3/3" in result.stdout
  # Every later run of these programs, in any workdir, loads them from here (bounded, hence locked).
  cached = os.listdir(tmp_path / "user_cache" / "jax-template" / "compilation")
  assert ".lockfile" in cached and len(cached) > 2 and not os.path.exists(tmp_path / "compilation_cache")
  with open(tmp_path / "summary.json") as f:
    startup = json.load(f)["startup_s"]
  # checks.first_step is on by default: on one device it says it cannot run, and costs nothing more.
  assert "checks.first_step could not run: one device" in result.stdout
  assert set(startup) == {"imports", "build", "init", "compile", "first_step_check"}
  assert startup["first_step_check"] < 0.5 and all(v >= 0 for v in startup.values())
  assert startup["imports"] > 0.5  # JAX alone takes longer than that to import.


@pytest.mark.needs_root  # Mounts a tmpfs.
def test_a_full_disk_is_one_line_naming_the_space_and_restartable(tmp_path):
  """A workdir on a real size-limited tmpfs, filled after checkpoint 2: one error: line saying where
  and how much, exit 3 (restart), checkpoint 2 still proven whole; with space again the same command
  finishes and matches a run that never hit the full disk."""
  import shutil as sh

  from trainer.checkpoint import proof

  mount = tmp_path / "small"
  mount.mkdir()
  # Room for the run's own ~1 MB with margin, and small pages: a host whose shmem default is huge pages
  # rounds each small file up to 2 MB. CI once found an 8 MB mount full before the filler opened.
  if subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=32m,huge=never", "tmpfs", str(mount)], capture_output=True
  ).returncode:
    pytest.skip("cannot mount a tmpfs here (needs root)")
  try:
    flags = ["--config=configs/smoke_cpu.py:tiny,steps=8", "--cpu_devices=8", "--config.checkpoint.every=2"]
    run = lambda workdir, *extra: subprocess.run(
      [sys.executable, "main.py", *flags, f"--workdir={workdir}", *extra],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
    )
    workdir, reference = mount / "run", tmp_path / "reference"
    for w in (workdir, reference):
      assert run(w, "--config.steps=2").returncode == 0
    filler = mount / "filler"
    used = subprocess.run(["du", "-ab", str(workdir)], capture_output=True, text=True).stdout
    try:  # Every byte left, as another job's output would; a disk the run itself filled is full already.
      with open(filler, "wb") as f:
        while f.write(b"\0" * 65536):
          f.flush()
    except OSError as e:
      assert e.errno == errno.ENOSPC, e
    metrics = (workdir / "metrics.jsonl").read_text()
    full = run(workdir)
    errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert full.returncode == 3 and len(errors) == 1, full.stderr[-3000:] + used[-3000:]
    assert "no space left on the disk of" in errors[0] and "a checkpoint of this run takes" in errors[0]
    assert "Traceback" not in full.stderr
    assert proof.verify(str(workdir / "checkpoints" / "2")) is True
    assert (workdir / "metrics.jsonl").read_text().startswith(metrics)  # Nothing of the history lost.
    filler.unlink()
    assert run(workdir).returncode == 0 and run(reference).returncode == 0
    assert train_losses(str(workdir)) == train_losses(str(reference))
  finally:
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)
    sh.rmtree(mount, ignore_errors=True)
