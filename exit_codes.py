"""The exit codes of main.py, whether a launcher restarts each, and what an operator does about it.

The one table. Everything that spells an exit code derives from it: main.py and its classification
(trainer/cluster/failures.py, which re-exports these names), the exceptions that carry a code, the
watchdog, the local launcher's restarts (launch/restart_policy.py), the SLURM script (which runs this
module to pick and describe the code that stops its requeues), the Kubernetes JobSet's
podFailurePolicy (launch/k8s/common.py) and the runbook's exit-code table (docs/runbooks/a-host-died.md;
tests/test_exit_codes.py checks it against `markdown()`). Later issues add their codes here, as a
constant and a row, and nowhere else.

A code that restarts is one a restart on the same machine with the same limits can get past (the
fault was the environment's, or it stopped on a signal); one that does not would fail the same way:
the user's mistake, a host that computes wrong, a limit of the machine, a step XLA got wrong.

  python -m exit_codes 5          # the row of code 5, as `5 (out of memory: ...)`
  printf '3\\n5\\n' | python -m exit_codes --stop
                                                  # the first code read that no launcher restarts
  python -m exit_codes --markdown # the table of the docs' reference and runbook
"""

import dataclasses
import signal
import sys

FINISHED_EXIT = 0
FAILED_EXIT = 1  # Python's code for an uncaught exception (nothing classified it), and verify's FAIL.
USER_EXIT = 2
TRANSIENT_EXIT = 3
COMPUTED_WRONG_EXIT = 4
RESOURCES_EXIT = 5
MISCOMPILED_EXIT = 6
NONFINITE_FIRST_STEP_EXIT = 7
HOOK_EXIT = 8
INTERRUPTED_EXIT = 128 + signal.SIGINT  # The shell's convention for a signal N: 128 + N.
PREEMPTED_EXIT = 128 + signal.SIGTERM


@dataclasses.dataclass(frozen=True)
class ExitCode:
  code: int
  name: str  # A few words: what ended the process.
  restart: bool  # Whether a launcher or scheduler starts the job again after it.
  hint: str  # What the operator does, in one line.


TABLE = (
  ExitCode(FINISHED_EXIT, "finished", False, "nothing: the run is done (or saved and stopped on a signal)"),
  ExitCode(
    USER_EXIT,
    "a user error",
    False,
    "fix the config, flag, data or code its `error:` line names; a restart would fail the same way",
  ),
  ExitCode(
    TRANSIENT_EXIT,
    "transient: the machine, its storage or network",
    True,
    "nothing (free space on a full disk): an I/O or network error, a lost peer, the watchdog; it resumes",
  ),
  ExitCode(
    COMPUTED_WRONG_EXIT,
    "a device computed wrong",
    False,
    "take the named host out (replicas or the recomputed step differ), then resume",
  ),
  ExitCode(
    RESOURCES_EXIT,
    "out of memory, or another limit of the machine",
    False,
    "more devices or a finer split (memory), a higher limit (open files), then rerun",
  ),
  ExitCode(
    MISCOMPILED_EXIT,
    "XLA partitioned the step wrongly",
    False,
    "checks.first_step found it: another mesh, sharding.rules or XLA, then rerun",
  ),
  ExitCode(
    NONFINITE_FIRST_STEP_EXIT,
    "the first step is not finite",
    False,
    "checks.first_step saw NaN/Inf in the first step's loss or gradients: fix the data, init or lr",
  ),
  ExitCode(
    HOOK_EXIT,
    "an experiment's hook or evaluator raised",
    False,
    "fix the hook or evaluator its `error:` line names (in the experiment); the step it ran at was saved",
  ),
  ExitCode(
    INTERRUPTED_EXIT, "stopped by SIGINT", True, "nothing: a restart resumes from the newest checkpoint"
  ),
  ExitCode(PREEMPTED_EXIT, "stopped by SIGTERM, a preemption", True, "nothing: a restart resumes likewise"),
)
# Any code not in TABLE: FAILED_EXIT, a signal N (128 + N) or a kill. Restarted: nothing shows it repeats.
OTHER = ExitCode(
  FAILED_EXIT, "a crash or a kill", True, "a bug: its traceback is the report (verify's FAIL exits 1 too)"
)
BY_CODE = {row.code: row for row in TABLE}
# The failures a restart would repeat: launchers stop on them (0 is no failure).
NEVER_RESTART = tuple(row.code for row in TABLE if not row.restart and row.code != FINISHED_EXIT)


def describe(code: int) -> str:
  """'5 (out of resources: out of memory ...)', 'killed by SIGKILL', '137 (signal SIGKILL)'."""
  if code < 0:
    return f"killed by {signal.Signals(-code).name}"
  if (row := BY_CODE.get(code)) is not None:
    return f"{code} ({row.name}: {row.hint})"
  if code > 128 and code - 128 in signal.valid_signals():
    return f"{code} (signal {signal.Signals(code - 128).name})"
  return str(code)


def markdown() -> str:
  """The exit-code table of docs/reference/exit-codes.md and docs/runbooks/a-host-died.md."""
  lines = ["| exit | what | restarted | what to do |", "|---|---|---|---|"]
  for row in TABLE:
    lines.append(f"| {row.code} | {row.name} | {'yes' if row.restart else 'no'} | {row.hint} |")
  lines.append(f"| other | {OTHER.name} | {'yes' if OTHER.restart else 'no'} | {OTHER.hint} |")
  return "\n".join(lines)


def _main(argv: list[str]) -> int:
  if argv == ["--markdown"]:
    print(markdown())
  elif argv == ["--stop"]:  # For the SLURM script: codes on stdin, one a line.
    codes = [int(word) for word in sys.stdin.read().split() if word.lstrip("-").isdigit()]
    if stop := next((c for c in codes if c in NEVER_RESTART), None):
      print(describe(stop))
  elif len(argv) == 1 and argv[0].lstrip("-").isdigit():
    print(describe(int(argv[0])))
  else:
    print("usage: python -m exit_codes CODE | --stop | --markdown", file=sys.stderr)
    return USER_EXIT
  return 0


if __name__ == "__main__":
  sys.exit(_main(sys.argv[1:]))
