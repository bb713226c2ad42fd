"""The core: mesh and rules, train state, step, loop, checkpointing, metrics and reports."""

import time

STARTED = time.time()  # When this process first imported the trainer: the clock of start-up's import time.
