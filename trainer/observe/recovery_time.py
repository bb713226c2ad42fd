"""Time to recover: from a process's death to the first completed step of the restarted job, by phase.

A launcher that restarts a job (launch/local.py --max_restarts) tells each new process, in
LAUNCH_RECOVERY (JSON), the restart's number and cause and when the old job went down and the new one
was launched. The restarted run adds its own phases and writes one `"event": "recovery"` row to
metrics.jsonl (kept by later resumes, so summary.json lists every restart):
  detection_s   the first process's death to the whole old job being down (its peers noticing and
                being stopped: seconds for a kill, the watchdog's budget for a hang after it)
  relaunch_s    to this process's start: the back-off and spawning
  startup_s     imports and building (mesh, data, model), to the restore
  restore_s     reading the checkpoint onto this mesh
  compile_s     compiling the step (a warm compilation cache loads it)
  first_step_s  opening the data and the first step, to its completion
  total_s       their sum: death to the first completed step
"""

import json
import os

from trainer import rundir


def from_env() -> dict | None:
  text = os.environ.get("LAUNCH_RECOVERY")
  return json.loads(text) if text else None


def row(info: dict, process_started: float, startup: dict, first_step_done: float, step: int) -> dict:
  restore = startup.get("restore", startup.get("init", 0.0))
  phases = {
    "detection_s": info["ended_at"] - info["died_at"],
    "relaunch_s": process_started - info["ended_at"],
    "startup_s": startup["imports"] + startup["build"],
    "restore_s": restore,
    "compile_s": startup["compile"],
  }
  phases["first_step_s"] = first_step_done - process_started - sum(list(phases.values())[2:])
  phases = {k: round(v, 3) for k, v in phases.items()}
  out = {"step": step, "time": first_step_done, "event": "recovery", "restart": info["restart"]}
  out.update(cause=info["cause"], process=info["process"], processes=info["processes"], **phases)
  out["total_s"] = round(first_step_done - info["died_at"], 3)
  return out


def line(r: dict) -> str:
  phases = ", ".join(
    f"{k[:-2].replace('_', ' ')} {r[k]:.1f}" for k in r if k.endswith("_s") and k != "total_s"
  )
  return (
    f"recovered from restart {r['restart']} (process {r['process']} {r['cause']}) in {r['total_s']:.1f} s "
    f"from checkpoint {r['step']}: {phases}"
  )


def history(workdir: str) -> list[dict]:
  """Every recovery row in WORKDIR/metrics.jsonl."""
  return [r for r in rundir.read_jsonl(rundir.metrics(workdir)) if r.get("event") == "recovery"]
