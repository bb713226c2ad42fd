"""Process start-up: logical CPU devices and joining a multi-process job. Runs before JAX's backend."""

import os

import jax

from trainer.errors import UserError


def configure_cpu_devices(n: int | None) -> None:
  """N logical CPU devices; must run before anything touches jax.devices()."""
  if not n:
    return
  if n < 1:
    raise UserError(f"--cpu_devices={n}: must be at least 1")
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", n)


def _cluster_env() -> bool:
  """Whether a scheduler says this process is one of several (what jax.distributed detects)."""
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    return True
  return "JAX_COORDINATOR_ADDRESS" in os.environ and "JAX_NUM_PROCESSES" in os.environ


def join_job(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
  """Joins a multi-process job from explicit flags or the environment; else runs alone."""
  given = [coordinator is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given):
    raise UserError("--coordinator_address, --num_processes and --process_id go together")
  if all(given):
    if not 0 <= process_id < num_processes:
      raise UserError(f"--process_id={process_id} must be in [0, {num_processes})")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
  elif os.environ.get("JAX_COORDINATOR_ADDRESS") and os.environ.get("JAX_NUM_PROCESSES"):
    jax.distributed.initialize(
      os.environ["JAX_COORDINATOR_ADDRESS"],
      num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
      process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
  elif _cluster_env():
    jax.distributed.initialize()  # SLURM / Kubernetes: JAX reads the scheduler's environment.
