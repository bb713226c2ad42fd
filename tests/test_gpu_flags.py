"""The launchers' XLA GPU flags are names this jaxlib knows: XLA aborts at start-up on an unknown one."""

import os
import subprocess
import sys

from launch import gpu_flags
from tests.conftest import REPO


def test_every_gpu_flag_is_known_to_this_xla():
  env = {**os.environ, "XLA_FLAGS": gpu_flags.xla_flags(), "JAX_PLATFORMS": "cpu"}
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
