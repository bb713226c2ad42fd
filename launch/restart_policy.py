"""When a failed job is restarted: what each exit code of main.py means to a launcher or a scheduler,
and what the run directory says about where a restart resumes. launch/restarts.py (launch/local.py's
restarts) uses it, and launch/slurm/train.sbatch and the rendered Kubernetes JobSet follow the same codes.

  0        finished                                    never restart
  2        a user error (config, data, code)           never restart: it would fail the same way
  3        the watchdog, a lost peer, an I/O error,    restart (transient)
           a full disk, a timeout
  4        a device computed wrong (replicas differ,   never restart: take the host out first
           or the recomputed step)
  5        out of memory (restoring, saving, reading)  never restart as is: give it more memory first
  6        XLA partitioned the step wrongly            never restart as is: another mesh or rules
  130/143  interrupted by SIGINT/SIGTERM at start-up    the scheduler's call (a preemption: restart)
  other    a crash, a lost peer, a kill                restart
"""

import signal

from trainer import rundir

# What an exit code tells a restart policy (main.py's codes; a signal N shows as 128 + N).
EXIT_CODES = {
  0: "finished",
  2: "a user error (config, data or code): fix it; restarting would fail the same way",
  3: "transient: the watchdog, a lost peer, an I/O error, a full disk or a timeout",
  4: "a device computed wrong (replicas or the recomputed step differ): take its host out before resuming",
  5: "out of memory: more devices or a finer split, then rerun",
  6: "XLA partitioned the step wrongly (the first-step check): another mesh or sharding.rules, then rerun",
}
NEVER_RESTART = (0, 2, 4, 5, 6)


def cause(code: int) -> str:
  """'killed by SIGKILL', 'exited with code 1 (...)': a process's end, in words."""
  if code < 0:
    return f"killed by {signal.Signals(-code).name}"
  return f"exited with code {code}" + (f" ({EXIT_CODES[code]})" if code in EXIT_CODES else "")


def past_startup(workdir: str | None, process: int, since: float) -> bool:
  """Whether `process` got past start-up after `since` (time.time()): main.py writes a `start` row to
  WORKDIR/processes/process_I.jsonl once it has built, restored and compiled."""
  try:
    rows = rundir.read_jsonl(rundir.process_log(workdir, process))
  except (OSError, TypeError):
    return False
  return any(row.get("event") == "start" and row.get("time", 0) > since for row in rows)
