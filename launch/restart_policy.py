"""When a failed job is restarted: what each exit code of main.py means to a launcher or a scheduler,
and what the run directory says about where a restart resumes. launch/restarts.py (launch/local.py's
restarts) uses it. The codes, and which of them restart, are exit_codes.py's table,
which launch/slurm/train.sbatch and the rendered Kubernetes JobSet follow too.
"""

from exit_codes import NEVER_RESTART, describe
from trainer import rundir

__all__ = ["NEVER_RESTART", "cause", "past_startup"]


def cause(code: int) -> str:
  """'killed by SIGKILL', 'exited with code 2 (a user error: ...)': a process's end, in words."""
  return describe(code) if code < 0 else f"exited with code {describe(code)}"


def past_startup(workdir: str | None, process: int, since: float) -> bool:
  """Whether `process` got past start-up after `since` (time.time()): main.py writes a `start` row to
  WORKDIR/processes/process_I.jsonl once it has built, restored and compiled."""
  try:
    rows = rundir.read_jsonl(rundir.process_log(workdir, process))
  except (OSError, TypeError):
    return False
  return any(row.get("event") == "start" and row.get("time", 0) > since for row in rows)
