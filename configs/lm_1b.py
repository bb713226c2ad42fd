"""Llama 3.2 1B's decoder (1.24B parameters, tied embeddings, its RoPE scaling and RMSNorm epsilon)
for 8 hosts of 8 GPUs: `--config.init_from=DIR` of its Hugging Face weights starts from them as is.

Recipe:
  python -m data.prepare --input='corpus/*.txt' --output=/shared/data/corpus --seq_len=2048 \
    --tokenizer=TOKENIZER   # a 128k-vocabulary tokenizer; model.vocab_size must cover it
  CONFIG=configs/lm_1b.py WORKDIR=/shared/runs/lm_1b sbatch --nodes=8 launch/slurm/train.sbatch \
    --config.data.path=/shared/data/corpus --config.mesh.dcn_fsdp=8
Hardware: 8 hosts x 8 GPUs (H100/H200, 80 GB class). FSDP over all 64 GPUs: mesh.fsdp=-1 fills a host,
mesh.dcn_fsdp=8 spans the hosts (outermost, so within-host collectives stay on NVLink).
Model: d_model 2048, 16 scanned layers, 32 query / 8 key-value heads of 64, SwiGLU 8192, RoPE base
500k with Llama 3's scaling (factor 32), RMSNorm epsilon 1e-5, vocabulary 128,256, tied embeddings
looked up unscaled, bf16 compute with fp32 params; the loss takes the logits
512 positions at a time (model.loss_chunk), never [batch, 2048, 128256] float32 at once.
Expect: per device on 64 devices, params and optimizer state (a 64th of the total, and the norm
scales, which stay whole) and a compiled step well within an 80 GB GPU (an estimate, from an
ahead-of-time compile on 64 logical CPUs with einsum attention, the step with a second state for the
recompute check; GPUs add NCCL and cuDNN buffers and the weights launch/gpu_flags.py's pipelined
gathers prefetch). Figures: docs/results.md, 'The recipes: memory and throughput'. Throughput on
GPUs: not measured yet. Inspect:
  python main.py --config=configs/lm_1b.py --workdir=/tmp/inspect --mode=inspect --cpu_devices=64
Arguments: `:tiny` shrinks it to a 2-step pulse on synthetic data that runs on 8 logical CPU devices
(`--config=configs/lm_1b.py:tiny`); short arguments combine, e.g. `:tiny,fsdp=4`.
"""

from configs import base
from trainer.config import assemble


def get_config(arg=None):
  c = base.get_config("lm")
  c.steps = 50_000
  c.global_batch_size = 256  # 512k tokens per step; 4 sequences per GPU on 64.
  c.log_every = 50
  c.eval_every = 2_000
  c.eval_steps = 20
  c.mesh.data = 1
  c.mesh.fsdp = -1  # Every device of a host; set mesh.dcn_fsdp to the number of hosts.
  c.mesh.tensor = 1
  c.sharding.strategy = "fsdp"
  c.data.source = "arrayrecord"
  c.data.path = ""  # Set with --config.data.path=... to the data.prepare output.
  c.data.seq_len = 2048
  c.data.packing = True
  c.data.read_threads = 8
  c.data.prefetch = 4
  c.model.vocab_size = 128_256
  c.model.embed_dim = 2048
  c.model.num_layers = 16
  c.model.num_heads = 32
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 8192
  c.model.rope_base = 500_000.0
  c.model.rope_scaling = "llama3"
  c.model.rope_llama3_factor = 32.0
  c.model.norm_eps = 1e-5
  c.model.compute_dtype = "bfloat16"
  c.model.attention = "auto"  # cuDNN on GPUs, splash on TPUs, einsum on the laptop that inspects it.
  c.model.scan_layers = True
  c.model.remat = "dots_no_batch"  # Keeps the weight matmuls' outputs; recomputes attention.
  c.model.tie_embeddings = True
  c.model.scale_tied_embeddings = False
  c.model.loss_chunk = 512
  c.model.z_loss = 1e-4
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2_000
  c.checkpoint.every = 1_000
  c.checks.replica_every = 500  # And before every save: a device that computes wrong stops the run.
  c.checks.recompute_every = 500  # Nothing replicated (FSDP); cost: docs/results.md, 'Integrity checks'.
  # On GPUs it needs deterministic kernels (main.py sets them), which are slower (docs/results.md, 'One
  # NVIDIA H200, 2026-12-04'); 0 keeps XLA's defaults (docs/guides/first-gpu.md).
  c.checkpoint.keep_every = 10_000
  c.checkpoint.on_nonfinite = "rollback"
  c.watchdog.compile_timeout_s = 1_200.0
  c.watchdog.step_timeout_s = 600.0
  return assemble.apply_args(c, arg)
