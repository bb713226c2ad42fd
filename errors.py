"""A mistake the user can fix. main.py prints it as one `error:` line and exits 2.

A top-level module that imports nothing, so configs, data, model, experiments and the trainer can all
raise it without importing one another.
"""


class UserError(Exception):
  pass
