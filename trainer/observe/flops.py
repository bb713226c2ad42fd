"""Model FLOPs per step: the experiment's analytic count (its optional `model_flops_per_example`), the
numerator of MFU. Unlike the compiled step's cost analysis it counts no rematerialized recompute, and
every scanned layer (XLA counts a loop's body once). Also: TFLOP/s per device and MFU from them."""

from trainer.observe import hardware


def per_step(experiment, config, param_count: int) -> float | None:
  """FLOPs of one optimizer step over the global batch, or None when the experiment has no count."""
  hook = experiment.model_flops_per_example
  return None if hook is None else float(hook(config, param_count)) * config.global_batch_size


def compiled_per_device(compiled) -> float | None:
  """One device's FLOPs per step by XLA's cost analysis (None where the backend gives none)."""
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"]) if cost.get("flops") else None


def fields(flops_per_step: float | None, step_time_s: float, devices) -> dict:
  """{tflops_per_device, mfu}: model FLOP/s of one device, and its fraction of the device's peak
  (left out where there is none: logical CPU devices, or a kind trainer/observe/hardware.py lacks)."""
  if not flops_per_step:
    return {}
  per_device = flops_per_step / step_time_s / len(devices)
  out = {"tflops_per_device": per_device / 1e12}
  if (mfu := hardware.mfu(per_device, devices[0].device_kind, devices[0].platform)) is not None:
    out["mfu"] = mfu
  return out


def mfu_label(devices, flops_per_step: float | None = None) -> str:
  """What summary.json says where MFU has no meaning."""
  if devices[0].platform == "cpu":
    return "n/a (logical CPU)"
  if not flops_per_step:
    return "n/a (no FLOPs count: the experiment has no model_flops_per_example, XLA gave none)"
  return f"n/a (no peak for {devices[0].device_kind!r} in trainer/observe/hardware.py)"
