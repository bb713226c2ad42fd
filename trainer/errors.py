"""A mistake the user can fix. main.py prints it as one `error:` line and exits non-zero."""


class UserError(Exception):
  pass
