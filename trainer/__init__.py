"""The core: mesh and rules, train state, step, loop, checkpointing, metrics and reports."""
