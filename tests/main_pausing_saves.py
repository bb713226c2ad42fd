"""main.py with every checkpoint's data-position write held open for a while, for tests only:
`python tests/main_pausing_saves.py SECONDS MAIN_FLAGS...`.

The pause runs in Orbax's background thread, so the loop goes on while the step directory is still
temporary, and a kill lands mid-save deterministically.
"""

import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trainer import checkpointing  # noqa: E402

PAUSE_S = float(sys.argv.pop(1))
_handlers = checkpointing.Checkpoints.item_handlers


def _paused_handlers() -> dict:
  handlers = _handlers()
  data = handlers["data"]
  write = data._save_fn

  async def paused_write(x, directory):
    time.sleep(PAUSE_S)
    await write(x, directory)

  data._save_fn = paused_write
  return handlers


checkpointing.Checkpoints.item_handlers = staticmethod(_paused_handlers)
sys.argv[0] = os.path.join(REPO, "main.py")
runpy.run_path(sys.argv[0], run_name="__main__")
