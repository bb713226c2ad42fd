"""XLA flags for throughput on NVIDIA GPUs, set by the launchers (launch/slurm/train.sbatch, the
rendered Kubernetes objects) before yours: flags of yours in XLA_FLAGS come later and win.

`python launch/gpu_flags.py` prints them as one XLA_FLAGS string (it imports nothing of the
repository). tests/test_gpu_flags.py checks that this jaxlib knows every name (XLA aborts at start-up
on an unknown flag).
"""

# (flag, why). Values follow JAX's GPU performance guide and NVIDIA's JAX-Toolbox notes for LLMs.
FLAGS = (
  # Schedules collectives (FSDP all-gathers, gradient reduce-scatters) to overlap with compute.
  ("--xla_gpu_enable_latency_hiding_scheduler=true", "overlap collectives with compute"),
  # Gathers the next scanned layer's weights while this one computes (and scatters the last one's
  # gradients): the loop-level half of FSDP's overlap. `on` considers every eligible collective (jaxlib
  # 0.12 deprecated the boolean `--xla_gpu_enable_pipelined_*` flags for these).
  ("--xla_gpu_pipeline_all_gather=on", "prefetch the next layer's weights in a scan"),
  ("--xla_gpu_pipeline_reduce_scatter=on", "overlap a layer's gradient scatter with the next"),
  ("--xla_gpu_pipeline_all_reduce=on", "the same for data-parallel gradient reductions"),
  # Unrolls the layer loop by two so the pipelined collectives have a neighbour to hide behind.
  ("--xla_gpu_enable_while_loop_double_buffering=true", "double-buffer scanned layers"),
  # Combine many small collectives into few large ones (NCCL's per-call latency dominates small ones).
  ("--xla_gpu_all_reduce_combine_threshold_bytes=1073741824", "combine all-reduces up to 1 GiB"),
  ("--xla_gpu_all_gather_combine_threshold_bytes=134217728", "combine all-gathers up to 128 MiB"),
  ("--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864", "combine reduce-scatters up to 64 MiB"),
  # Collectives on their own, highest-priority CUDA stream: compute kernels do not delay them.
  ("--xla_gpu_enable_highest_priority_async_stream=true", "collectives never wait behind compute"),
)


def xla_flags() -> str:
  return " ".join(flag for flag, _ in FLAGS)


if __name__ == "__main__":
  print(xla_flags())
