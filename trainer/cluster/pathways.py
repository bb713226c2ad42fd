"""Pathways (single controller): this one process drives every TPU of every slice through the Pathways
IFRT proxy, instead of one process per host joined by jax.distributed.

`pathwaysutils` (Google's client-side package, not a dependency of this template: install it in the
image that runs on Pathways) registers the proxy backend and its Orbax and profiling hooks. It must
run before anything touches JAX's devices, in place of runtime.join_job. Not tested on Pathways here:
no TPUs; tests check the missing-package error, the platform switch and the call into the package.
"""

import os

from errors import UserError

# Environment variable that asks for Pathways without the flag (e.g. set in a manifest).
PATHWAYS_ENV = "PATHWAYS"
_OFF = ("", "0", "false", "no", "off")


def requested(flag_value: bool) -> bool:
  """Whether this run uses Pathways: --pathways, or the environment says so.

  The environment says so when JAX_PLATFORMS contains "proxy" (the test pathwaysutils itself applies,
  so a job whose manifest picks the proxy backend is never half set up: proxy platform without the
  package's hooks), or when PATHWAYS is set to anything but "", 0, false, no or off (case-insensitive).
  """
  if flag_value:
    return True
  if "proxy" in os.environ.get("JAX_PLATFORMS", "").lower():
    return True
  return os.environ.get(PATHWAYS_ENV, "").strip().lower() not in _OFF


def initialize() -> None:
  """Sets JAX up to run through the Pathways proxy. Call before anything touches jax.devices().

  Raises UserError when pathwaysutils is not installed or JAX_BACKEND_TARGET (the proxy's
  grpc://HOST:PORT) is not set.
  """
  try:
    import pathwaysutils
  except ModuleNotFoundError as e:
    if e.name != "pathwaysutils":
      raise  # Installed, but something it imports is missing: its own name says what.
    raise UserError("--pathways needs the pathwaysutils package: pip install pathwaysutils") from None
  import jax

  if not jax.config.read("jax_backend_target"):
    raise UserError(
      "--pathways needs JAX_BACKEND_TARGET=grpc://HOST:PORT, the Pathways proxy's address "
      "(the manifest from `launch/k8s/render.py --pathways` sets it)"
    )
  if "proxy" not in (jax.config.jax_platforms or ""):
    # pathwaysutils.initialize() changes nothing unless "proxy" is among JAX's platforms, and JAX
    # would then run on whatever local devices it finds: --pathways alone must be enough.
    jax.config.update("jax_platforms", "proxy")
  pathwaysutils.initialize()
