"""The loop's checks that the devices computed right, before a state is saved (exit 4 when not):

  checks.replica_every    copies of each replicated shard agree (trainer/checks/replicas.py)
  checks.recompute_every  the step recomputed with its shards on other devices agrees bit for bit
                          (trainer/checks/recompute.py): the check that works where nothing is replicated
Each runs every N steps and on every step that saves a checkpoint on schedule (0: off).
"""

import jax

from trainer.cadence import itstime
from trainer.checks import recompute, replicas
from trainer.cluster import runtime
from trainer.observe.metrics import console


def _nondeterministic() -> bool:
  # Two runs of one step on a GPU differ without deterministic kernels: every check would accuse a
  # healthy device (trainer/cluster/runtime.py).
  return jax.default_backend() == "gpu" and not runtime.gpu_ops_deterministic()


def interval(comp, config) -> int:
  """The steps between checked steps (0: no check runs): the replica check's, or the recompute check's
  where it can run. The local tier copies at those steps too, and a run with checks resumes only from
  such a copy (trainer/checkpoint/local_restore.py's restore_newest)."""
  c = config.checks
  recomputes = c.recompute_every and not _nondeterministic() and recompute.rotated_mesh(comp.mesh) is not None
  return min((e for e in (c.replica_every, c.recompute_every if recomputes else 0) if e), default=0)


class Checks:
  def __init__(self, comp, config, make_train_step):
    c = config.checks
    self.mesh, self.replica_every = comp.mesh, c.replica_every
    every = c.recompute_every
    nondeterministic = _nondeterministic()
    self.recompute = recompute.RecomputeCheck(
      comp, config.microbatches, make_train_step, 0 if nondeterministic else every
    )
    if every and nondeterministic:
      console(
        f"warning: checks.recompute_every={every} is off: XLA_FLAGS sets "
        f"{runtime.DETERMINISTIC_FLAG}=false, and two runs of one step on a GPU then differ in their bits"
      )
    elif every and not self.recompute.on:
      console(
        f"warning: checks.recompute_every={every} is off: a process with one device has no "
        "other device to recompute its shards on"
      )

  def copy_if_due(self, step: int, state, batch, saves: bool):
    """Before step `step` runs (`saves`: it saves on schedule): the copy it will be recomputed from, if
    it is checked (else None)."""
    if self.recompute.on and (itstime(step, self.recompute.every) or saves):
      return self.recompute.copy(state, batch)
    return None

  def due(self, step: int, save_now: bool, copied) -> bool:
    return copied is not None or bool(self.replica_every and (itstime(step, self.replica_every) or save_now))

  def run(self, state, metrics, step: int, copied) -> None:
    if self.replica_every:
      replicas.check(state, self.mesh, step)
    if copied is not None:
      self.recompute.check(copied, state, metrics, self.mesh, step)
