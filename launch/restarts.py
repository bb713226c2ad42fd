"""The local launcher's restarts (launch/local.py --max_restarts, --min_processes, --elastic): it runs a
job, and when the job failed, relaunches the whole of it, on fewer processes if a slot cannot come back.

`--max_restarts=N` relaunches the whole job (after `--restart_backoff_s`, on a new port unless `--port`
fixes it) when it failed, up to N times; main.py resumes from the newest checkpoint. One line per
restart names the cause, the process and the checkpoint. Exit codes decide
(exit_codes.py, through launch/restart_policy.py): a code its table marks as not
restarted (a user error, a device that computed wrong, out of memory, a miscompiled step) never
restarts, nor does a job the launcher was told to stop. With `--min_processes=K` (`--elastic`: K = 1) a
slot that fails at start-up twice in a row (before the job's first step) is dropped: the job continues
on the other processes with the same global batch (the data order is a function of the step) and the
checkpoint is resharded onto the smaller mesh, which needs a mesh axis of -1 (else main.py's error says
why). Each restarted process gets LAUNCH_RECOVERY (JSON: the restart, its cause and when the job went
down and came back), from which main.py records the time to recover by phase. With restarts, a failure
kills the other processes at once (SIGKILL): they cannot take a step or save without their peer, and the
relaunch resumes from the last checkpoint.

How a job's processes are started, watched and stopped is launch/local.py's (its Job); this module
only decides whether and how to launch again.
"""

import json
import os
import signal
import sys
import time
from collections.abc import Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # Imported as launch.restarts: its neighbours under the names local.py uses,
  sys.path.insert(0, _HERE)  # so that process_output's one lock for whole lines is the launcher's too.
from process_output import log  # noqa: E402
from restart_policy import NEVER_RESTART, cause, past_startup  # noqa: E402

from trainer import rundir  # noqa: E402


class _Stop:
  """A signal between two launches (during the back-off): no further launch."""

  signum: int | None = None

  @classmethod
  def handler(cls, job):
    def on_signal(signum, frame):
      cls.signum = cls.signum or signum
      job.on_signal(signum, frame)

    return on_signal


def _run_once(job) -> int:
  """Starts the job's processes, waits for them and returns the launcher's exit code for them."""
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, _Stop.handler(job))
  try:
    job.start()
    return job.wait()
  finally:
    job.kill_all(signal.SIGKILL)  # Only reached with live processes if the launcher itself failed.


def supervise(
  new_job: Callable[[int, dict[str, str]], object],
  env: dict[str, str],
  processes: int,
  *,
  max_restarts: int,
  restart_backoff_s: float,
  min_processes: int,
  workdir: str | None,
) -> int:
  """Runs `new_job(processes, env)` (a launch/local.py Job, not started) and relaunches it while the
  policy says so; returns the launcher's exit code. `env` is the processes' environment: each relaunch
  adds LAUNCH_RECOVERY to it."""
  env.pop("LAUNCH_RECOVERY", None)  # A first launch is no recovery, whatever the launcher's own env says.
  restarts = 0
  at_startup: dict[int, int] = {}  # Slot -> launches in a row it failed in before the job's first step.
  while True:
    job = new_job(processes, env)
    started = time.time()
    code = _run_once(job)
    if code == 0 or job.signalled is not None or job.first_failure is None:
      return code
    slot, raw, died_at = job.first_failure
    if raw in NEVER_RESTART or restarts >= max_restarts:
      if max_restarts and raw not in NEVER_RESTART:
        log(f"giving up after {restarts} restarts: process {slot} {cause(raw)}")
      elif max_restarts:
        log(f"not restarting: process {slot} {cause(raw)}")
      return code
    restarts += 1
    dropped = ""
    at_startup = {} if past_startup(workdir, slot, started) else {slot: at_startup.get(slot, 0) + 1}
    if at_startup.get(slot, 0) >= 2 and processes > min_processes:
      processes -= 1  # The slot failed twice at start-up: continue without it.
      at_startup = {}
      dropped = f"; slot {slot} did not come back: continuing on {processes} processes (renumbered)"
    step = rundir.newest_checkpoint(workdir)
    # The local tier (trainer/checkpoint/local.py) lives on the hosts: the process finds any newer copy.
    resume = f"checkpoint {step}" if step is not None else "the start (no persistent checkpoint yet)"
    resume += " or a newer local copy"
    log(
      f"restart {restarts}/{max_restarts}: process {slot} {cause(raw)}{dropped}; resuming from "
      f"{resume} in {restart_backoff_s:g} s"
    )
    time.sleep(restart_backoff_s)
    if _Stop.signum is not None:
      log(f"got {signal.Signals(_Stop.signum).name} before the relaunch; not relaunching")
      return 128 + _Stop.signum
    recovery = {"restart": restarts, "cause": cause(raw), "process": slot, "processes": processes}
    recovery.update(died_at=died_at, ended_at=job.ended_at, relaunched_at=time.time())
    env["LAUNCH_RECOVERY"] = json.dumps(recovery)
