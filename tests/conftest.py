"""Every in-process test runs on 8 logical CPU devices, set before JAX's backend starts."""

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# One persistent compilation cache for the whole session, this process and every main.py it starts
# (they inherit the environment): the same tiny steps compile once, not once per test. Made only
# where none is set (a pytest a test starts shares its parent's), and removed when the session ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="test_jax_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# The local checkpoint tier's per-run folders (trainer/checkpoint/local.py) of runs that do not finish
# stay where they are to be resumed from: here, not in the machine's /dev/shm, and removed at the end.
if "LOCAL_TIER_BASE" not in os.environ:
  os.environ["LOCAL_TIER_BASE"] = tempfile.mkdtemp(prefix="test_local_tier_")
  atexit.register(shutil.rmtree, os.environ["LOCAL_TIER_BASE"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Tests compile many tiny programs and run each for a few steps: XLA:CPU's compile time dominates, and
# without LLVM's optimizations it drops by about a third (one verify of the tiny LM, jaxlib 0.12, the
# whole process: 23.4 s -> 15.0 s; `main.py --mode=verify --config=configs/smoke_cpu.py:tiny`).
# Every main.py a test starts inherits it; results within a test stay comparable (both sides alike).
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from configs import smoke_cpu  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
  # Root-only tests' skips named from their markers (a non-root conftest may not set pytest_plugins).
  from tests import needs_root

  if not config.pluginmanager.is_registered(needs_root):
    config.pluginmanager.register(needs_root, "needs_root")


def tiny_config(**overrides):
  """The smoke config shrunk to a model and data that compile and step in seconds."""
  c = smoke_cpu.get_config()
  c.steps = 6
  c.global_batch_size = 16
  c.log_every = 1
  c.eval_every = 0
  c.eval_steps = 1
  c.checkpoint.every = 2
  c.data.vocab_size = 32
  c.data.seq_len = 16
  c.data.read_threads = 0
  c.model.vocab_size = 32
  c.model.embed_dim = 32
  c.model.num_heads = 2
  c.model.num_layers = 1
  c.model.mlp_dim = 64
  c.optimizer.warmup_steps = 2
  c.checks.first_step = False  # On by default; the suite pays for it only where a test tests it.
  # Every step, whatever a copy costs on a loaded machine: tests assert which step a kill resumes from
  # (the default, -1, copies less often while copies are slower than steps: tests/test_cadence.py).
  c.checkpoint.local_every = 1
  for key, value in overrides.items():
    node = c
    *path, leaf = key.split(".")
    for p in path:
      node = node[p]
    node[leaf] = value
  return c


# tiny_config as main.py flags; 8 devices form the smoke config's 2 x 2 x 2 mesh.
TINY_FLAGS = [
  "--config=configs/smoke_cpu.py",
  "--config.global_batch_size=16",
  "--config.log_every=1",
  "--config.eval_every=0",
  "--config.eval_steps=1",
  "--config.checkpoint.every=2",
  "--config.data.vocab_size=32",
  "--config.data.seq_len=16",
  "--config.data.read_threads=0",
  "--config.model.vocab_size=32",
  "--config.model.embed_dim=32",
  "--config.model.num_heads=2",
  "--config.model.num_layers=1",
  "--config.model.mlp_dim=64",
  "--config.optimizer.warmup_steps=2",
  "--config.checks.first_step=false",
  "--config.checkpoint.local_every=1",
  "--config.mesh.data=2",
  "--config.mesh.fsdp=2",
  "--config.mesh.tensor=2",
]


def patch_experiment(monkeypatch, module, **parts):
  """Replaces parts of an experiment module's EXPERIMENT for one test (trainer.experiment.load reads it)."""
  import dataclasses

  monkeypatch.setattr(module, "EXPERIMENT", dataclasses.replace(module.EXPERIMENT, **parts))


def read_jsonl(path):
  import json

  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def train_losses(workdir):
  """{step: loss} from metrics.jsonl (train rows only)."""
  return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "loss" in r}


def run_main(*args, timeout=300, env=None):
  """Runs main.py in a fresh process; returns the CompletedProcess."""
  return run_python("main.py", *args, timeout=timeout, env=env)


def run_python(*args, timeout=300, env=None):
  """Runs `python ARGS` (a script, or `-m MODULE ...`) in the repository; returns the CompletedProcess."""
  return subprocess.run(
    [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
  )


def kill_while_waiting_for_batch(batch: int, *args, workdir: str, checkpoint: int | None = None) -> None:
  """main.py ARGS (tests/main_with_pauses.py) until its loop waits for global batch `batch` (and, if
  given, checkpoint `checkpoint` is complete, within 60 s), then kill -9; raises if it ends first."""
  proc = subprocess.Popen(
    [sys.executable, "tests/main_with_pauses.py", f"read=60@{batch}", *args, f"--workdir={workdir}"],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    for line in proc.stdout:
      if line.startswith("pause: read"):
        break
    else:
      raise AssertionError(f"no pause: the run ended ({proc.wait()})")
    deadline = time.time() + 60
    while checkpoint and not os.path.isdir(os.path.join(workdir, "checkpoints", str(checkpoint))):
      if time.time() > deadline:
        break
      time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.kill()
    proc.wait(timeout=30)


def valid_png(path) -> bool:
  """A PNG that decodes to a picture of some size (not only a file that exists)."""
  import matplotlib.image

  with open(path, "rb") as f:
    if f.read(8) != b"\x89PNG\r\n\x1a\n":
      return False
  return min(matplotlib.image.imread(path).shape[:2]) >= 100


@pytest.fixture
def config_factory():
  return tiny_config
