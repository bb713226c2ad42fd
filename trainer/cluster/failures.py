"""One classification of failures and the exit code each gets: main.py, trainer/checkpoint/proof.py and
the launchers (launch/restart_policy.py, the SLURM script, the JobSet's podFailurePolicy) follow it.

  user error            2  never restart: it would fail the same way
  transient environment 3  restart: I/O errors, a full disk, a lost peer, a lost link between two
                           processes (trainer/cluster/links.py), the watchdog
  resources             5  restart only after a change (out of memory): launchers do not loop on it
  miscompiled           6  never restart as is: XLA partitioned the step wrongly (the first-step check);
                           another mesh or sharding.rules, or another XLA
"""

import errno
import os
import shutil

from errors import UserError
from trainer import rundir

# Exit codes (launch/restart_policy.py): a restart helps after a transient fault; after running out of
# memory only once something changed (fewer per-device bytes, more devices), so launchers do not loop.
USER_EXIT, TRANSIENT_EXIT, RESOURCES_EXIT, MISCOMPILED_EXIT = 2, 3, 5, 6
_ENVIRONMENT_ERRNOS = {
  errno.EIO,
  errno.EACCES,
  errno.EPERM,
  errno.ENOSPC,
  errno.EDQUOT,
  errno.EROFS,
  errno.ETIMEDOUT,
  errno.ESTALE,
  errno.ENETDOWN,
  errno.ENETUNREACH,
  errno.ECONNRESET,
  errno.EAGAIN,
  errno.EBUSY,
}
# Status names that tensorstore and XLA put in their messages (absl status codes).
_RESOURCES_WORDS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")
_ENVIRONMENT_WORDS = ("PERMISSION_DENIED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "Input/output error")


def failure_kind(error: BaseException | None) -> str | None:
  """'resources' (out of memory), 'environment' (I/O, permissions, time) or None (possibly damage),
  from the exception and everything it was raised from or during."""
  for e in _chain(error):
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, MemoryError) or any(w in text for w in _RESOURCES_WORDS):
      return "resources"
    if isinstance(e, TimeoutError) or (isinstance(e, OSError) and e.errno in _ENVIRONMENT_ERRNOS):
      return "environment"
    if any(w in text for w in _ENVIRONMENT_WORDS):
      return "environment"
  return None


def error_line(error: BaseException, workdir: str | None) -> tuple[str, int] | None:
  """main.py's one line and exit code for an error that reached it, or None for one that is not
  classified (a bug: its traceback is the report, and exit 1 is restarted)."""
  if isinstance(error, UserError):
    return str(error), getattr(error, "exit_code", USER_EXIT)
  if isinstance(error, OSError):
    return os_error_line(error, workdir)
  # Raised from Orbax's or Grain's threads, XLA or tensorstore, the cause may sit deeper.
  inner = next((e for e in _chain(error) if isinstance(e, OSError) and e.errno is not None), None)
  if inner is not None:
    return os_error_line(inner, workdir)
  kind = failure_kind(error)
  detail = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
  if kind == "resources":
    return (
      f"out of memory ({detail}): lower the memory per device (more devices, mesh.fsdp, "
      "sharding.strategy=fsdp, microbatches, model.remat) and run again; the checkpoints saved so far "
      "are whole",
      RESOURCES_EXIT,
    )
  if kind == "environment":
    return (
      f"{detail}: the machine, its file system or a peer failed, not the config; run the same command "
      "again once it is fixed; the checkpoints saved so far are whole",
      TRANSIENT_EXIT,
    )
  return None


def _chain(error: BaseException | None):
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    yield error
    error = error.__cause__ or error.__context__


def os_error_line(error: OSError, workdir: str | None) -> tuple[str, int]:
  """main.py's one line and exit code for an OSError that reached it."""
  where = error.filename or workdir or ""
  if error.errno in (errno.ENOSPC, errno.EDQUOT):
    free = _bytes(shutil.disk_usage(workdir).free) if workdir and os.path.isdir(workdir) else "nothing"
    need = _newest_checkpoint_bytes(workdir)
    needs = f"; a checkpoint of this run takes {_bytes(need)}" if need else ""
    return (
      f"no space left on the disk of {where} ({free} free{needs}): free space there or give --workdir "
      "a larger disk, then run the same command again; the checkpoints saved so far are whole",
      TRANSIENT_EXIT,
    )
  # Permissions on the run's own paths are the user's to fix: restarting would fail the same way.
  if failure_kind(error) == "environment" and error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
    name = errno.errorcode.get(error.errno) or type(error).__name__
    return (
      f"{where}: {error.strerror or error} ({name}): the machine or its file system failed, not the "
      "config; run the same command again once it is fixed",
      TRANSIENT_EXIT,
    )
  return f"{where}: {error.strerror or error}", USER_EXIT


def _newest_checkpoint_bytes(workdir: str | None) -> int:
  if (step := rundir.newest_checkpoint(workdir)) is None:
    return 0
  total = 0
  for dirpath, _, names in os.walk(rundir.checkpoint(workdir, step)):
    total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
  return total


def _bytes(n: int) -> str:
  return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
