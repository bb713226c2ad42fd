"""The objective's properties, checked on one device without the trainer's step, microbatching or
sharding: what --mode=verify asks of an experiment's loss_sums, in its own terms.

  additivity     loss_sums over a batch = the sum of loss_sums over its valid examples one at a time,
                 and the gradient of its loss_sum = the sum of the gradients over its two halves
  padding_inert  padding rows add nothing to the sum, the count or a metric
  one_division   the trained loss and gradient = jax.grad(sum of loss sums / sum of counts) over the
                 valid examples only
  rows_separate  make_batch on slices of rows (as each process applies it) = the whole batch's rows
Each returns a Check: the figure, the tolerance it is held to and, on a FAIL, what it usually means.
"""

import dataclasses

import jax
import numpy as np

from trainer import state as state_lib


@dataclasses.dataclass
class Check:
  name: str
  step: int
  figure: float  # The worst relative difference found.
  tolerance: float
  detail: str  # What was compared, with the figures.
  meaning: str = ""  # On a FAIL: the usual cause in a fork.
  also_ok: bool = True  # A second condition the detail states (one_division's loss).
  skipped: bool = False  # Nothing to compare here (the detail says why): neither PASS nor FAIL.

  @property
  def passed(self) -> bool:
    if self.skipped:
      return True
    return bool(np.isfinite(self.figure)) and self.figure <= self.tolerance and self.also_ok

  @property
  def result(self) -> str:
    return "SKIP" if self.skipped else "PASS" if self.passed else "FAIL"


def skip(name: str, reason: str) -> Check:
  """A property verify could not check on this set-up, printed as SKIP with the reason."""
  return Check(name, 0, 0.0, 0.0, reason, skipped=True)


def _rel(a, b) -> float:
  """|a - b| / |b|, or |a - b| itself where b is 0: a zero denominator gives no figure (it gave 2e+30)."""
  a, b = float(a), float(b)
  return abs(a - b) / abs(b) if b != 0.0 else abs(a)


def _compared(name: str, a, b) -> str:
  """'name a vs b (figure)', saying which figure _rel gave."""
  a, b, figure = float(a), float(b), _rel(a, b)
  how = (
    f"{figure:.1e} relative" if b != 0.0 else f"relative n/a: zero over the examples; absolute {figure:.1e}"
  )
  return f"{name} {a:.6g} vs {b:.6g} ({how})"


def _rows(batch: dict, rows) -> dict:
  return {k: np.asarray(v)[rows] for k, v in batch.items()}


def _as_float(sums):
  loss_sum, count, metric_sums = sums
  return float(loss_sum), float(count), {k: float(v) for k, v in metric_sums.items()}


@dataclasses.dataclass
class Calculation:
  """One batch, calculated on one device at fixed params."""

  whole: tuple  # loss_sums over the whole batch, padding rows included: (sum, count, {metric: sum}).
  examples: list  # loss_sums of each row alone, in row order.
  kept: tuple  # loss_sums over the valid rows only.
  loss: float  # sum of loss sums / sum of counts over the valid rows,
  grads: object  # and its gradient: the objective, written here once with jax.grad.
  # The gradient of loss_sum over the valid rows, and the sum of its gradients over their two halves
  # (None with fewer than 2 valid rows, or when not asked for).
  sum_grads: tuple | None = None


class Reference:
  """loss_sums of the experiment's model on one device, outside any mesh, at given params and
  variables."""

  def __init__(self, loss_sums, mdef: state_lib.ModelDef, device):
    self.device = device

    def sums(params, variables, batch, rng):
      return loss_sums(mdef.merge(params, variables), batch, rng)

    def mean_loss(params, variables, batch, rng):
      loss_sum, count, metric_sums = sums(params, variables, batch, rng)
      return loss_sum / count, (loss_sum, count, metric_sums)

    # Each row alone (a batch of one), for every row at once: vmap over rows of batches of one.
    one = lambda params, v, row, key: sums(params, v, jax.tree.map(lambda x: x[None], row), key[None])
    self._examples = jax.jit(jax.vmap(one, in_axes=(None, None, 0, 0)))
    self._loss_and_grad = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))
    self._sum_grad = jax.jit(jax.grad(lambda *args: sums(*args)[0]))

  def calculate(self, params, variables, batch, rng, valid, halves: bool = True) -> Calculation:
    put = lambda tree: jax.device_put(tree, self.device)
    params, variables = put(params), put(variables)
    examples = jax.device_get(self._examples(params, variables, put(batch), put(rng)))
    (loss, whole), grads = self._loss_and_grad(params, variables, put(batch), put(rng))
    kept = whole  # Without padding rows the whole batch is the valid one: no second calculation.
    if not valid.all():
      kept_rows = (put(_rows(batch, valid)), put(rng[valid]))
      (loss, kept), grads = self._loss_and_grad(params, variables, *kept_rows)
    per_row = [_as_float(jax.tree.map(lambda x, i=i: x[i], examples)) for i in range(len(valid))]
    sum_grads = None
    rows = np.flatnonzero(valid)
    if halves and len(rows) > 1:  # Two halves, not every example: two gradients' memory, whatever B.
      grad = lambda rows: self._sum_grad(params, variables, put(_rows(batch, rows)), put(rng[rows]))
      first, second = grad(rows[: len(rows) // 2]), grad(rows[len(rows) // 2 :])
      sum_grads = jax.device_get((grad(rows), jax.tree.map(lambda a, b: a + b, first, second)))
    grads = jax.device_get(grads)
    return Calculation(_as_float(whole), per_row, _as_float(kept), float(loss), grads, sum_grads)


def _added(parts):
  return (
    sum(p[0] for p in parts),
    sum(p[1] for p in parts),
    {k: sum(p[2][k] for p in parts) for k in (parts[0][2] if parts else {})},
  )


def _worst(a, b) -> float:
  return max([_rel(a[0], b[0]), _rel(a[1], b[1])] + [_rel(a[2][k], b[2][k]) for k in a[2]])


def _quantities(a, b) -> list[tuple[str, float, float]]:
  """(name, a's, b's) for each quantity loss_sums returns: the sum, the count and every metric."""
  return [("loss_sum", a[0], b[0]), ("count", a[1], b[1])] + [(f"metric {k}", a[2][k], b[2][k]) for k in a[2]]


ADDITIVITY_CAUSES = (
  "loss_sums (1) returns a mean or normalizes by the batch size: return sums over valid elements; "
  "(2) adds a term computed over the whole batch (batch statistics, in-batch negatives, a batch-mean "
  "auxiliary loss): write a mean as a sum over valid elements, or, if coupling the examples is the "
  "objective, declare COUPLES_EXAMPLES = True; (3) shares randomness across the examples (one key for "
  "the batch): draw from rng's key per example (jax.vmap over rows)"
)


def additivity(calc: Calculation, step: int, valid, tols) -> Check:
  """Each quantity over the batch against its sum over the valid examples one at a time, and the
  gradient of loss_sum over the valid rows against the sum of its gradients over their two halves, per
  parameter group. The gradient catches a term that does not scale with the batch even where its
  share of the loss is below the loss tolerance: `xent_sum + 0.01 * aux_mean` weighs the auxiliary
  term 0.01 / N per example, a shift of 1e-6 in the loss, yet the halves' gradients hold it twice, so
  the group it alone moves (a router) differs by its whole size. A FAIL names what broke."""
  loss_tol, grad_tol = tols
  whole, added = calc.whole, _added([e for e, v in zip(calc.examples, valid, strict=True) if v])
  found = sorted(((_rel(a, b), name, a, b) for name, a, b in _quantities(whole, added)), reverse=True)
  broken = [q for q in found if not q[0] <= loss_tol]  # (NaN is broken too.)
  shown = broken or [q for q in found if q[1] in ("loss_sum", "count")]
  compared = "; ".join(_compared(name, a, b) for _, name, a, b in shown)
  figure, tolerance = max(q[0] for q in found), loss_tol
  detail = f"over the batch vs the sum over its {int(valid.sum())} valid examples one at a time: "
  detail += f"broken: {compared}" if broken else compared
  names = [name for _, name, _, _ in broken]
  grads_ok = True
  if calc.sum_grads is not None:
    ratios = _group_ratios(calc.sum_grads[1], calc.sum_grads[0])  # Relative to the whole batch's.
    groups = sorted((g for g in ratios if not ratios[g] <= grad_tol), key=ratios.get, reverse=True)
    worst = max(ratios, key=ratios.get)
    grads_ok = not groups
    if groups:
      said = "broken: " + ", ".join(f"{g} {ratios[g]:.1e}" for g in groups)
    else:
      said = f"worst group {worst} {ratios[worst]:.1e}"
    detail += (
      f"; gradient of loss_sum over the valid rows vs the sum over their two halves: {said} "
      f"(|g - g_halves| / |g| per group, tolerance {grad_tol:g})"
    )
    names += [f"loss_sum's gradient for {', '.join(groups)}"] if groups else []
    if groups and not broken:  # The gradient alone broke it: its figure heads the line.
      figure, tolerance = ratios[groups[0]], grad_tol
  return Check(
    "additivity",
    step,
    figure,
    tolerance,
    detail,
    f"{' and '.join(names) or 'a quantity'} over a batch is not the sum over its parts: {ADDITIVITY_CAUSES}",
    also_ok=grads_ok,
  )


def padding_inert(calc: Calculation, step: int, valid, tol: float) -> Check | None:
  if valid.all():
    return None
  padding = _added([e for e, v in zip(calc.examples, valid, strict=True) if not v])
  worst = max(
    [_worst(calc.whole, calc.kept), abs(padding[0]), abs(padding[1])] + [abs(x) for x in padding[2].values()]
  )
  return Check(
    "padding_inert",
    step,
    worst,
    tol,
    f"{int((~valid).sum())} padding rows give sum {padding[0]:.6g}, count {padding[1]:.6g}; without them the "
    f"sum is {calc.kept[0]:.6g} vs {calc.whole[0]:.6g}, count {calc.kept[1]:.6g} vs {calc.whole[1]:.6g}",
    "padding rows count: weight every element by batch['weights'] and count only weighted elements",
  )


def one_division(calc: Calculation, step: int, trained_loss, trained_grads, tols) -> Check:
  """The trainer's divided loss and gradient against jax.grad of the mean over the valid examples."""
  ratio, group = _worst_group(trained_grads, calc.grads)
  loss_rel = _rel(trained_loss, calc.loss)
  loss_tol, grad_tol = tols
  return Check(
    "one_division",
    step,
    ratio,
    grad_tol,
    f"loss {float(trained_loss):.6g} vs {calc.loss:.6g} ({loss_rel:.1e} rel, tolerance {loss_tol:g}); "
    f"gradient {ratio:.1e} (worst group {group})",
    "the trained update is not the gradient of (sum of loss sums) / (sum of counts) over the valid "
    "examples: a loss that counts padding, a local mean, or a normalization inside loss_sums",
    also_ok=loss_rel <= loss_tol,
  )


def _group_ratios(a, b) -> dict[str, float]:
  """|a - b| / |b| per parameter group (module path); |a - b| where b is 0, as _rel."""
  groups: dict[str, list[float]] = {}
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
    keys = state_lib.path_keys(path)
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    d = groups.setdefault("/".join(keys[:-1]) or keys[-1], [0.0, 0.0])
    d[0] += float(np.sum((x - y) ** 2))
    d[1] += float(np.sum(y * y))
  return {g: float(np.sqrt(d) / np.sqrt(n) if n else np.sqrt(d)) for g, (d, n) in groups.items()}


def _worst_group(a, b) -> tuple[float, str]:
  """The worst of _group_ratios, and its group."""
  ratios = _group_ratios(a, b)
  group = max(ratios, key=ratios.get)
  return ratios[group], group


def device_count(grad_norms: dict[int, float], step: int, tol: float) -> Check:
  if len(grad_norms) < 2:
    return skip("device_count", f"one device count only ({min(grad_norms)}): run verify on several devices")
  base = grad_norms[min(grad_norms)]
  worst = max(_rel(v, base) for v in grad_norms.values())
  figures = ", ".join(f"{n}: {v:.6g}" for n, v in sorted(grad_norms.items()))
  return Check(
    "device_count",
    step,
    worst,
    tol,
    f"gradient norm on {figures} devices",
    "the gradient changes with the device count: the loss depends on how the batch is split "
    "(a mean per device, a sum of per-device means, a normalization by the local batch size)",
  )


def rows_separate(whole: dict, pieces: list[dict], step: int) -> Check:
  """make_batch on a process's rows alone (each piece) gives those rows of make_batch on the whole
  batch: training applies it per process, so a make_batch that looks across rows (a batch mean, a
  shuffle) would feed each topology different examples."""
  worst, where = 0.0, ""
  for k, v in whole.items():
    joined = np.concatenate([np.asarray(p[k]) for p in pieces])
    if joined.shape != np.shape(v):
      worst, where = float("inf"), f"{k}: shape {joined.shape} vs {np.shape(v)}"
      continue
    a, b = np.asarray(joined, np.float64), np.asarray(v, np.float64)
    scale = np.where(b == 0, 1.0, np.abs(b))  # Absolute where b is 0, as _rel.
    diff = float(np.max(np.abs(a - b) / scale, initial=0.0))
    if diff > worst:
      worst, where = diff, f"{k} differs, worst element {diff:.1e} relative"
  return Check(
    "rows_separate",
    step,
    worst,
    0.0,
    f"make_batch on {len(pieces)} slices of rows, as {len(pieces)} processes would, vs the whole batch: "
    f"{where or 'identical'}",
    "make_batch looks across rows (normalizes by the batch, shuffles or packs across rows): each "
    "process applies it to its own rows only; make each row's arrays depend on that row alone",
  )


def example_rows(batch_size: int, shards: int) -> int:
  """Valid rows of the padded batch verify builds: one shard full, the next partly, the rest padding
  only (uneven rows per device, devices holding only padding), at least one row of padding."""
  if batch_size == 1:
    return 1
  return max(1, min(batch_size - 1, batch_size // max(shards, 1) + 1))
