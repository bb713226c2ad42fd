"""Model FLOPs per step: the experiment's analytic count (its optional `model_flops_per_example`), the
numerator of MFU. Unlike the compiled step's cost analysis it counts no rematerialized recompute, and
every scanned layer (XLA counts a loop's body once)."""


def per_step(experiment, config, param_count: int) -> float | None:
  """FLOPs of one optimizer step over the global batch, or None when the experiment has no count."""
  hook = getattr(experiment, "model_flops_per_example", None)
  return None if hook is None else float(hook(config, param_count)) * config.global_batch_size
