"""main.py with pauses injected where a test needs to land a signal or a kill, for tests only:

  python tests/main_with_pauses.py PAUSES MAIN_FLAGS...

(PAUSES is the first argument not starting with `--`, so launch/local.py's --main can run it with
PAUSES among the flags after `--`.)

PAUSES is a comma-separated list of WHERE=SECONDS[@N][/pI], or @FILE: the list read from FILE at
start-up (a test rewrites it between a launcher's restarts): `@N` limits it to step (or global
batch) N, `/pI` to process I. Each pause prints `pause: WHERE ...` on stdout first, so a test can
wait for it. WHERE is one of:
- save: the data-position write of a checkpoint (in Orbax's background thread: the loop goes on while
  the step directory is still temporary, and a kill lands mid-save deterministically); N is the step.
- startup: before the mesh, data and model are built.
- restore: before the newest checkpoint is read.
- eval: before every evaluation (in the main thread, which a signal handler interrupts and resumes).
- local: the rename that makes this process's own local-tier copy of step N whole (in the tier's writer
  thread: a kill there leaves the copy torn; trainer/checkpoint/local_copies.py).
- read: the loop's wait for global batch N (a blocking read that releases the GIL, as a stuck
  filesystem would; the watchdog thread keeps running).
An item `gone/pI` makes process I exit with code 1 at start-up once the file named by $GONE_MARKER
exists: a host that cannot come back (tests/test_chaos.py).
"""

import os
import re
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from data import pipeline  # noqa: E402
from trainer import components, evaluate, loop  # noqa: E402
from trainer.checkpoint import local_copies, store  # noqa: E402

PAUSES, GONE = {}, set()
_arg = sys.argv.pop(next(i for i, a in enumerate(sys.argv) if i and not a.startswith("--")))
if _arg.startswith("@"):
  with open(_arg[1:]) as _f:
    _arg = _f.read().strip()
for item in filter(None, _arg.split(",")):
  if gone := re.fullmatch(r"gone/p(\d+)", item):
    GONE.add(int(gone.group(1)))
    continue
  m = re.fullmatch(r"(save|startup|restore|eval|read|local)=([\d.]+)(?:@(\d+))?(?:/p(\d+))?", item)
  assert m, f"bad pause {item!r}"
  PAUSES[m.group(1)] = (float(m.group(2)), m.group(3) and int(m.group(3)), m.group(4) and int(m.group(4)))
PROCESS = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--process_id=")), 0)


def _startup() -> None:
  if PROCESS in GONE and os.path.exists(os.environ.get("GONE_MARKER", "/nonexistent")):
    print(f"gone: process {PROCESS} cannot come back", flush=True)
    os._exit(1)
  pause("startup")


def pause(where: str, n: int | None = None) -> None:
  if where not in PAUSES:
    return
  seconds, only_n, only_process = PAUSES[where]
  if (only_n is None or n == only_n) and (only_process is None or PROCESS == only_process):
    print(f"pause: {where} {n if n is not None else ''}", flush=True)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:  # In slices: a signal that another thread took
      time.sleep(min(left, 0.05))  # wakes no sleep here, and waited out a whole 60 s pause under load.


_handlers = store.Checkpoints.item_handlers


def _paused_handlers() -> dict:
  handlers = _handlers()
  data = handlers["data"]
  write = data._save_fn

  async def paused_write(x, directory):
    step = re.search(r"/(\d+)[^/]*/data", str(directory))
    pause("save", int(step.group(1)) if step else None)
    await write(x, directory)

  data._save_fn = paused_write
  return handlers


def _wrap(module, name, before):
  original = getattr(module, name)

  def wrapped(*args, **kwargs):
    before(*args)
    return original(*args, **kwargs)

  setattr(module, name, wrapped)


store.Checkpoints.item_handlers = staticmethod(_paused_handlers)
_wrap(components, "build", lambda *a: _startup())
_wrap(loop, "evaluate", lambda *a: pause("eval"))  # The loop's evaluations.
_wrap(evaluate, "evaluate", lambda *a: pause("eval"))  # --mode=eval's.
_wrap(store.Checkpoints, "restore_latest", lambda *a: pause("restore"))
_own_copy = lambda tmp, final: "/own/" in tmp and pause("local", int(os.path.basename(final)))  # noqa: E731
_wrap(local_copies, "_commit", _own_copy)  # Its own copies only: not the ones it holds for a partner.
_next = pipeline.DevicePrefetch.__next__


def _paused_next(self):
  item = _next(self)
  pause("read", item[0])
  return item


pipeline.DevicePrefetch.__next__ = _paused_next
sys.argv[0] = os.path.join(REPO, "main.py")
runpy.run_path(sys.argv[0], run_name="__main__")
