"""The launchers' XLA GPU flags are names this jaxlib knows: XLA aborts at start-up on an unknown one."""

import os
import subprocess
import sys

from launch import gpu_flags
from tests.conftest import REPO
from trainer.cluster import runtime


def test_every_gpu_flag_is_known_to_this_xla():
  flags = " ".join((gpu_flags.xla_flags(), *runtime.DETERMINISTIC_GPU_FLAGS))
  env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
  r = subprocess.run(
    [sys.executable, "-c", "import jax.numpy as jnp; print(int(jnp.ones(2).sum()))"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-2000:]
  assert len(gpu_flags.FLAGS) == len({f.split("=")[0] for f, _ in gpu_flags.FLAGS})  # No flag twice.


def test_deterministic_gpu_kernels_come_first_and_a_users_setting_wins(monkeypatch):
  """The recompute check compares bits: on GPUs they are equal only under deterministic kernels
  (gpu_check's recompute row); a user's later --xla_gpu_deterministic_ops=false turns the check off."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
  assert not runtime.gpu_ops_deterministic()
  runtime.use_deterministic_gpu_ops()
  assert runtime.gpu_ops_deterministic() and os.environ["XLA_FLAGS"].endswith("--xla_dump_to=/tmp/d")
  monkeypatch.setenv("XLA_FLAGS", f"{os.environ['XLA_FLAGS']} --xla_gpu_deterministic_ops=false")
  assert not runtime.gpu_ops_deterministic()
