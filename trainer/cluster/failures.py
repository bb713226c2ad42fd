"""One classification of failures, and the exit code each gets (exit_codes.py's table,
whose names this module re-exports): main.py and trainer/checkpoint/proof.py follow it.

By class, not by the errors seen so far: an error is the user's (exit 2, never restarted) only when it
is proven to be: an `error:` the code raised as a UserError, or an OSError about a path the user gave
(missing, of the wrong kind, not theirs to write). A limit of the machine (memory, open files, file
size) is resources (5): a restart on the same machine with the same limits fails the same way. Any
other OSError is the storage's, the network's or the machine's: transient (3), restarted. That
includes a full disk, which space freed elsewhere (or old checkpoints removed) fixes without a change
to the run. The cause may sit deep inside what a library re-raised (__cause__, __context__): the
first exception along that chain that has a class decides.
"""

import errno
import os
import shutil

from errors import UserError
from exit_codes import (  # noqa: F401 - re-exported: the codes' names, where they are used.
  COMPUTED_WRONG_EXIT,
  MISCOMPILED_EXIT,
  NONFINITE_FIRST_STEP_EXIT,
  RESOURCES_EXIT,
  TRANSIENT_EXIT,
  USER_EXIT,
)
from trainer import rundir


def _errnos(*names: str) -> frozenset[int]:
  return frozenset(getattr(errno, n) for n in names if hasattr(errno, n))  # Some are Linux's only.


# A path the user gave: missing, of the wrong kind, or not theirs to write. A restart meets it again.
_PATH_ERRNOS = _errnos("ENOENT", "ENOTDIR", "EISDIR", "EEXIST", "ENOTEMPTY", "ENAMETOOLONG", "ELOOP")
_PERMISSION_ERRNOS = _errnos("EACCES", "EPERM", "EROFS")
_USER_CLASSES = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)
# A limit of the machine or the process: memory, open files (the process's and the system's), file size.
_RESOURCE_ERRNOS = _errnos("ENOMEM", "EMFILE", "ENFILE", "EFBIG")
_FULL_DISK_ERRNOS = _errnos("ENOSPC", "EDQUOT")
# Status names that tensorstore and XLA put in their messages (absl status codes).
_RESOURCES_WORDS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")
_ENVIRONMENT_WORDS = ("PERMISSION_DENIED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "Input/output error")
_LIMITS = {  # What raises each limit of _RESOURCE_ERRNOS but memory.
  errno.EMFILE: "the open-file limit (ulimit -n, the container's nofile)",
  errno.ENFILE: "the system's open-file limit (fs.file-max)",
  errno.EFBIG: "the file-size limit (ulimit -f) or a file system that holds larger files",
}


def _kind(e: BaseException) -> str | None:
  """'user', 'resources' or 'transient' for what one exception alone proves, else None."""
  if isinstance(e, OSError) and (
    isinstance(e, _USER_CLASSES) or e.errno in _PATH_ERRNOS | _PERMISSION_ERRNOS
  ):
    return "user"
  if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in _RESOURCE_ERRNOS):
    return "resources"
  if isinstance(e, OSError) and (e.errno is not None or isinstance(e, ConnectionError | TimeoutError)):
    return "transient"  # Storage, network, the machine: whatever errno is not the user's or a limit.
  text = f"{type(e).__name__}: {e}"
  if any(w in text for w in _RESOURCES_WORDS):
    return "resources"
  if any(w in text for w in _ENVIRONMENT_WORDS):
    return "transient"
  return None


def _decisive(error: BaseException) -> tuple[BaseException, str] | None:
  """The first exception along the chain that has a kind, with it."""
  return next(((e, k) for e in _chain(error) if (k := _kind(e)) is not None), None)


def failure_kind(error: BaseException | None) -> str | None:
  """For a checkpoint that failed to restore: 'resources' (a limit of the machine), 'environment' (I/O,
  storage, network, permissions, time) or None (possibly damage: a missing file among them)."""
  for e in _chain(error):
    kind = _kind(e)
    if kind == "resources":
      return kind
    if kind == "transient" or (kind == "user" and getattr(e, "errno", None) in _PERMISSION_ERRNOS):
      return "environment"  # Permissions too: not the checkpoint's damage, whoever's they are.
  return None


def error_line(error: BaseException, workdir: str | None) -> tuple[str, int] | None:
  """main.py's one line and exit code for an error that reached it, or None for one that is not
  classified (a bug: its traceback is the report, and exit 1 is restarted)."""
  if isinstance(error, UserError):
    return str(error), getattr(error, "exit_code", USER_EXIT)
  # Raised from Orbax's or Grain's threads, XLA or tensorstore, the cause may sit deeper.
  decisive = _decisive(error)
  if decisive is None:
    # An OSError that names no errno and no class says nothing of the user: not proven theirs.
    return _os_line(error, "transient", workdir) if isinstance(error, OSError) else None
  e, kind = decisive
  if isinstance(e, OSError):
    return _os_line(e, kind, workdir)
  detail = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
  if kind == "resources":
    return _out_of_memory(detail), RESOURCES_EXIT
  return (
    f"{detail}: the machine, its file system or a peer failed, not the config; run the same command "
    "again once it is fixed; the checkpoints saved so far are whole",
    TRANSIENT_EXIT,
  )


def _out_of_memory(detail: str) -> str:
  return (
    f"out of memory ({detail}): lower the memory per device (more devices, mesh.fsdp, "
    "sharding.strategy=fsdp, microbatches, model.remat) and run again; the checkpoints saved so far "
    "are whole"
  )


def _os_line(error: OSError, kind: str, workdir: str | None) -> tuple[str, int]:
  where = error.filename or workdir or ""
  name = errno.errorcode.get(error.errno) or type(error).__name__
  if kind == "user":
    return f"{where}: {error.strerror or error}", USER_EXIT
  if kind == "resources" and error.errno in _LIMITS:
    return (
      f"{where}: {error.strerror or error} ({name}): a limit of this machine; raise "
      f"{_LIMITS[error.errno]}, then run again (with the same limits it would fail the same way); the "
      "checkpoints saved so far are whole",
      RESOURCES_EXIT,
    )
  if kind == "resources":
    return _out_of_memory(f"{where}: {error.strerror or error} ({name})"), RESOURCES_EXIT
  if error.errno in _FULL_DISK_ERRNOS:
    free = _bytes(shutil.disk_usage(workdir).free) if workdir and os.path.isdir(workdir) else "nothing"
    need = _newest_checkpoint_bytes(workdir)
    needs = f"; a checkpoint of this run takes {_bytes(need)}" if need else ""
    return (
      f"no space left on the disk of {where} ({free} free{needs}): free space there or give --workdir "
      "a larger disk, then run the same command again; the checkpoints saved so far are whole",
      TRANSIENT_EXIT,
    )
  return (
    f"{where}: {error.strerror or error} ({name}): the machine, its storage or network failed, not the "
    "config; run the same command again once it is fixed",
    TRANSIENT_EXIT,
  )


def _chain(error: BaseException | None):
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    yield error
    error = error.__cause__ or error.__context__


def _newest_checkpoint_bytes(workdir: str | None) -> int:
  if (step := rundir.newest_checkpoint(workdir)) is None:
    return 0
  total = 0
  for dirpath, _, names in os.walk(rundir.checkpoint(workdir, step)):
    total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
  return total


def _bytes(n: int) -> str:
  return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
