"""One classification of failures and the exit code each gets: main.py, trainer/checkpoint_proof.py and
the launchers (launch/restart_policy.py, the SLURM script, the JobSet's podFailurePolicy) follow it.

  user error            2  never restart: it would fail the same way
  transient environment 3  restart: I/O errors, a full disk, a lost peer, the watchdog
  resources             5  restart only after a change (out of memory): launchers do not loop on it
"""

import errno
import os
import shutil

# Exit codes (launch/restart_policy.py): a restart helps after a transient fault; after running out of
# memory only once something changed (fewer per-device bytes, more devices), so launchers do not loop.
USER_EXIT, TRANSIENT_EXIT, RESOURCES_EXIT = 2, 3, 5
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
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or any(w in text for w in _RESOURCES_WORDS):
      return "resources"
    if isinstance(error, TimeoutError) or (isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS):
      return "environment"
    if any(w in text for w in _ENVIRONMENT_WORDS):
      return "environment"
    error = error.__cause__ or error.__context__
  return None


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
    name = errno.errorcode.get(error.errno, str(error.errno))
    return (
      f"{where}: {error.strerror or error} ({name}): the machine or its file system failed, not the "
      "config; run the same command again once it is fixed",
      TRANSIENT_EXIT,
    )
  return f"{where}: {error.strerror or error}", USER_EXIT


def _newest_checkpoint_bytes(workdir: str | None) -> int:
  root = os.path.join(workdir or "", "checkpoints")
  try:
    steps = sorted((n for n in os.listdir(root) if n.isdigit()), key=int)
  except OSError:
    return 0
  if not steps:
    return 0
  total = 0
  for dirpath, _, names in os.walk(os.path.join(root, steps[-1])):
    total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
  return total


def _bytes(n: int) -> str:
  return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
