"""Peak FLOP/s and memory of the accelerators MFU and inspect's --target_device compare against.

Peaks are the vendors' dense bfloat16 figures (no sparsity), per chip; memory is the vendors' figure
in GB (1e9 bytes). A float32 step on a GPU runs far below the bf16 peak: MFU says how far.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  peak_flops: float  # Dense bf16 FLOP/s of one device.
  memory_bytes: float


# Matched against jax's device_kind in this order (the first pattern it contains wins): 'TPU v5 lite'
# before 'TPU v5', 'H100 PCIe' before 'H100'.
TABLE = {
  "h100_pcie": (("H100 PCIe",), Accelerator("NVIDIA H100 PCIe", 756e12, 80e9)),
  "h100": (("H100",), Accelerator("NVIDIA H100 SXM", 989e12, 80e9)),
  "h200": (("H200",), Accelerator("NVIDIA H200", 989e12, 141e9)),
  "a100_40gb": (("A100-SXM4-40GB", "A100-PCIE-40GB"), Accelerator("NVIDIA A100 40GB", 312e12, 40e9)),
  "a100": (("A100",), Accelerator("NVIDIA A100 80GB", 312e12, 80e9)),
  "b200": (("B200",), Accelerator("NVIDIA B200", 2250e12, 180e9)),
  "v5e": (("TPU v5 lite", "TPU v5e"), Accelerator("TPU v5e", 197e12, 16e9)),
  "v5p": (("TPU v5p", "TPU v5"), Accelerator("TPU v5p", 459e12, 95e9)),
  "v6e": (("TPU v6 lite", "TPU v6e"), Accelerator("TPU v6e", 918e12, 32e9)),
}


def for_device_kind(device_kind: str) -> Accelerator | None:
  """The accelerator a jax device_kind names, or None (a CPU, or one not in TABLE)."""
  for patterns, accelerator in TABLE.values():
    if any(p.lower() in device_kind.lower() for p in patterns):
      return accelerator
  return None


def by_name(name: str) -> Accelerator | None:
  """--target_device=h100: a TABLE key, or anything a device_kind would match ('H200', 'TPU v5p')."""
  entry = TABLE.get(name.lower().replace("-", "_"))
  return entry[1] if entry else for_device_kind(name)


def mfu(flops_per_s_per_device: float, device_kind: str, platform: str) -> float | None:
  """Model FLOP/s of one device over its peak, or None where there is no meaningful peak."""
  accelerator = None if platform == "cpu" else for_device_kind(device_kind)
  return flops_per_s_per_device / accelerator.peak_flops if accelerator else None
