"""The local launcher's output: its processes' lines, prefixed and less library chatter, and its own,
each written whole (launch/local.py)."""

import re
import sys
import threading

# Lines of library chatter dropped from the processes' output unless --verbose (or main.py's
# --verbosity) asks for everything; each pattern must match the whole line (less its line end).
CHATTER = (
  # Gloo (the CPU collectives) prints this with std::cout, unconditionally, every time it connects a
  # communicator: about 36 lines per 2-process start. Two of them printed at once by two threads
  # merge in any way ("[Gloo] Rank 1[Gloo] Rank 0 is connected ...", "3 is connected to ..."): a line
  # made of nothing but the pieces of such lines is chatter, and so is the piece that is left of one
  # when another thread's line lands before its end: a bare peer count ("1").
  re.compile(
    rb"(?=.*is connected to)"  # Pieces of Gloo's lines only, one "is connected to" at least.
    rb"(?:\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :|\d+|\s+)+"
  ),
  re.compile(rb"\s*\d+\s*"),
  # JAX's C++ preemption notifier: "SIGTERM caught at TIME" on every process, after a SIGINT as well
  # (trainer/cluster/preemption.py turns SIGINT into SIGTERM, the only way to reach JAX's preemption service).
  # It cannot be silenced at its source without TF_CPP_MIN_LOG_LEVEL, which would hide every C++
  # warning; the run's own line, `preempted (SIGINT): saved checkpoint N`, names the signal sent.
  re.compile(rb"[IW]\d{4} [\d:.]+ +\d+ preemption_notifier\.cc:\d+\] .*"),
  # Empty lines, e.g. the newline of a Python print that a C++ write split from its text (see LinePump).
  re.compile(rb"\s*"),
)


def is_chatter(line: bytes) -> bool:
  return any(p.fullmatch(line.rstrip(b"\r\n")) for p in CHATTER)


# One lock for every line the launcher writes, its own and its children's: each goes out whole.
_LINES = threading.Lock()


def log(msg: str) -> None:
  # One write of bytes, not print: under PYTHONUNBUFFERED (the launcher's own environment may have it)
  # print writes the text and its newline apart, and a child's line can land between the two.
  with _LINES:
    sys.stderr.flush()
    sys.stderr.buffer.write(f"[launch] {msg}\n".encode())
    sys.stderr.buffer.flush()


class LinePump:
  """Copies a child's pipe to ours line by line with a prefix; one lock keeps lines whole.

  Lines of different processes, or of one process's stdout and stderr (separate pipes), never merge
  here. A merged line comes from inside one child, where Python and the C++ libraries (Gloo's
  std::cout, absl logging) share fd 1 and fd 2, and writes from its threads interleave before
  they reach the pipe: e.g. with PYTHONUNBUFFERED (set below) print writes its text and its newline
  in two write(2) calls, so a C++ line can land between them, leaving "text[Gloo] ..." and an empty
  line. The launcher gets those bytes already mixed and cannot take them apart; it keeps the line as
  it came (dropping it would lose the text). Only the child can fix it, e.g. with
  `sys.stdout.reconfigure(line_buffering=True)` instead of PYTHONUNBUFFERED: one write per line.
  """

  def __init__(self, pipe, dest, prefix: bytes, keep_all: bool):
    self.thread = threading.Thread(target=self._pump, args=(pipe, dest, prefix, keep_all), daemon=True)
    self.thread.start()

  @classmethod
  def _pump(cls, pipe, dest, prefix: bytes, keep_all: bool) -> None:
    broken = False
    with pipe:
      for line in iter(pipe.readline, b""):
        if broken or (not keep_all and is_chatter(line)):
          continue  # Keep draining: a child blocked on a full pipe would never exit.
        if not line.endswith(b"\n"):
          line += b"\n"  # A last line without its newline must not run into another process's.
        with _LINES:
          try:
            dest.write(prefix + line)
            dest.flush()
          except OSError:  # Our reader went away (e.g. `| head`).
            broken = True
