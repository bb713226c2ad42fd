"""Agreement and barriers between processes through JAX's coordination service (never an all-gather
on the devices): both have timeouts, so a missing process ends the job with a message, not a hang."""

import itertools
import json

import jax
from jax._src import distributed

import exit_codes
from errors import UserError


def client():
  """The coordination service client, or None in a single-process run."""
  return distributed.global_state.client if jax.process_count() > 1 else None


# Barrier and key names must be unique within a job; every process makes the same calls in the same
# order (invariant 6), so a shared counter suffix keeps them unique and equal across processes.
_sequence = itertools.count()


class PeerTimeout(UserError):
  """A peer did not arrive: hung or dead, not the user's mistake. Transient, which launchers restart
  (exit_codes.py), as they do the watchdog's."""

  exit_code = exit_codes.TRANSIENT_EXIT


def barrier(name: str, timeout_s: float) -> None:
  c = client()
  if c is None:
    return
  try:
    c.wait_at_barrier(f"{name}#{next(_sequence)}", int(timeout_s * 1000))
  except Exception as e:  # noqa: BLE001 - the service reports a timeout as a runtime error.
    raise PeerTimeout(f"barrier {name!r}: not every process arrived within {timeout_s:.0f} s ({e})") from None


def _read_before_anyone_leaves(name: str, timeout_s: float, stopping: bool) -> None:
  """A barrier after every process has read the store: process 0 hosts it, and its exit ends it.

  Process 0 may leave the moment the barrier opens, before a peer's answer reaches it; when every
  process already knows the job stops (`stopping`), a peer whose barrier then fails stops all the
  same, with the same message, not with a timeout."""
  try:
    barrier(name, timeout_s)
  except PeerTimeout:
    if not stopping:
      raise


def all_agree(name: str, ok: bool, timeout_s: float) -> bool:
  """True on every process if `ok` is True on every process (through the key-value store)."""
  c = client()
  if c is None:
    return ok
  key = f"{name}#{next(_sequence)}"
  c.key_value_set(f"{key}/{jax.process_index()}", "1" if ok else "0")
  barrier(key, timeout_s)
  agreed = all(c.key_value_try_get(f"{key}/{p}") == "1" for p in range(jax.process_count()))
  _read_before_anyone_leaves(f"{key}_read", timeout_s, stopping=not agreed)
  return agreed


def gather(name: str, value: dict, timeout_s: float) -> dict[int, dict]:
  """{process: its `value`} on every process (JSON through the key-value store)."""
  c = client()
  if c is None:
    return {0: value}
  key = f"{name}#{next(_sequence)}"
  c.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
  barrier(key, timeout_s)
  return {p: json.loads(c.key_value_try_get(f"{key}/{p}")) for p in range(jax.process_count())}


def _flatten(tree, prefix=""):
  if isinstance(tree, dict):
    for k in sorted(tree):
      yield from _flatten(tree[k], f"{prefix}{k}.")
  else:
    yield prefix[:-1], tree


def first_difference(mine: dict, theirs: dict) -> str | None:
  """'config.steps: 5 here, 7 there' for the first differing leaf, or None."""
  a, b = dict(_flatten(mine)), dict(_flatten(theirs))
  for key in sorted(set(a) | set(b)):
    if a.get(key) != b.get(key):
      return f"{key}: {a.get(key)!r} here, {b.get(key)!r} there"
  return None


def check_agreement(fields: dict, timeout_s: float) -> None:
  """Every process must run the same config, code revision and library versions; else a UserError on
  every process naming the first difference, before any training step."""
  c = client()
  if c is None:
    return
  me = jax.process_index()
  mine = json.loads(json.dumps(fields, sort_keys=True, default=str))
  c.key_value_set(f"agreement/{me}", json.dumps(mine))
  barrier("agreement_reported", timeout_s)  # Every report is in the store.
  diffs = []
  for other in range(jax.process_count()):
    if other != me and (
      diff := first_difference(mine, json.loads(c.key_value_try_get(f"agreement/{other}")))
    ):
      diffs.append(f"process {me} and process {other} disagree on {diff}")
  # Equality is transitive: a process that sees no difference knows that nobody does.
  _read_before_anyone_leaves("agreement_checked", timeout_s, stopping=bool(diffs))
  if diffs:
    raise UserError(f"{diffs[0]}; start every process alike")
