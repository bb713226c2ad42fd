"""Restoring from the local and peer tiers (trainer/checkpoint/local.py): every process says which copies
it holds whole, its own and its partners'; the newest step that every process can get whole, written
under this layout by as many processes, wins if it is newer than the newest persistent checkpoint. Each
process reads its own copy, else fetches it from the process that holds it.
"""

from trainer.checkpoint.local_shards import to_state
from trainer.cluster import multihost
from trainer.observe.metrics import console


def newest_common(holdings: dict[int, dict], processes: int, checked: bool = False) -> int | None:
  """The newest step every process can get whole: from its own copy or one another process holds
  (`checked`: only copies of steps a check saw)."""
  if checked:
    holdings = {p: {**h, **h.get("checked", {"own": [], "held": {}})} for p, h in holdings.items()}
  common = set.intersection(*(_available(holdings, p) for p in range(processes)))
  return max(common) if common else None


def restore_newest(
  tier, target, persistent_newest, timeout_s, say_why=True, before_read=lambda: None, checked=False
):
  """(state, data position, saved config, step) of the newest step every process can get whole from the
  tiers if newer than `persistent_newest` (`before_read` runs first); else None, said why if copies exist.
  `checked` (a run with replica or recompute checks): only a copy of a step a check saw. A copy holds
  one replica of each shard and the restore puts it on every device, which would erase the very
  divergence a replica check looks for; newer copies are passed over, said."""
  holdings = multihost.gather("local_holdings", tier.holdings(), timeout_s)
  step = newest_common(holdings, tier.processes, checked)
  newest = newest_common(holdings, tier.processes)
  if checked and newest is not None and newest != step and (persistent_newest or 0) < newest:
    console(
      f"local tier: step {newest}'s copy was taken after the last check it can resume from "
      f"({'step ' + str(step) if step is not None else 'none'}); a run with checks.replica_every or "
      "checks.recompute_every resumes only from a state a check saw"
    )
  others = sum(h["other"] for h in holdings.values())
  if step is None or (persistent_newest is not None and step <= persistent_newest):
    if say_why and step is None and any(h["own"] or h["held"] or h["other"] for h in holdings.values()):
      lacking = [p for p in range(tier.processes) if not _available(holdings, p)]
      why = (
        f"process {', '.join(map(str, lacking))} has no whole copy, own or held by a partner"
        if lacking
        else "no one step is whole for every process"
      )
      why += f"; {others} copies were written under another layout or process count" if others else ""
      console(f"local tier: nothing to resume from ({why}); the persistent tier's newest checkpoint is used")
    return None
  before_read()
  record, where, error = None, None, None
  try:
    record, where = tier.load(step, holdings)
    state = to_state(record["shards"], target)
  except (OSError, KeyError, ValueError, StopIteration) as e:
    error = f"{type(e).__name__}: {e}"
  wheres = multihost.gather("local_restored", {"where": where, "error": error}, timeout_s)
  failed = {p: w["error"] for p, w in wheres.items() if w["error"]}
  if failed:
    p, why = next(iter(failed.items()))
    console(
      f"local tier: step {step} could not be restored (process {p}: {why[:200]}); using the persistent tier"
    )
    return None
  console(
    f"restored step {step} from the local tier: "
    + "; ".join(f"process {p} from {w['where']}" for p, w in sorted(wheres.items()))
  )
  return state, record["position"], record["config"], step


def _available(holdings: dict, process: int) -> set:
  steps = set(holdings[process]["own"])
  for h in holdings.values():
    steps |= set(h["held"].get(str(process), []))
  return steps
