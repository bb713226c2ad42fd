"""A 125M-parameter Llama-style decoder LM for one host of 8 GPUs: the first real-size recipe.

Recipe:
  python -m data.prepare --input='corpus/*.txt' --output=/shared/data/corpus --seq_len=2048 \
    --tokenizer=TOKENIZER   # a 32k-vocabulary tokenizer (byte-level: --config.model.vocab_size=512)
  CONFIG=configs/lm_125m.py WORKDIR=/shared/runs/lm_125m sbatch --nodes=1 launch/slurm/train.sbatch \
    --config.data.path=/shared/data/corpus
  (or: python launch/k8s/render.py --replicas=1 --config=configs/lm_125m.py ... | kubectl apply -f -)
Hardware: one host of 8 GPUs (80 GB class) or more; FSDP over every GPU (mesh.fsdp=-1), data parallel
across hosts if mesh.dcn_data is set to the number of hosts.
Model: d_model 768, 12 scanned layers, 12 query / 4 key-value heads of 64, SwiGLU 2048, RoPE, bf16
compute with fp32 params, vocabulary 32,768, untied (76M parameters with the 512 of byte-level data).
Expect: per device on 8 devices, params, optimizer state and a compiled step that fit an 80 GB GPU
(an estimate, from an ahead-of-time compile on 8 logical CPUs with einsum attention, which holds the
[32, 12, 2048, 2048] scores that cuDNN's kernel does not, the step with a second state for the
recompute check; GPUs add NCCL and cuDNN buffers and the weights launch/gpu_flags.py's pipelined
gathers prefetch). Figures: docs/results.md, 'The recipes: memory and throughput'. Not yet run on its
8 GPUs; its model ran on one H200 and one TPU v5e chip (docs/results.md, 'One NVIDIA H200,
2026-12-04' and 'One TPU v5e chip, 2026-12-07'). Check placement and memory first, on a laptop
(inspect opens no data):
  python main.py --config=configs/lm_125m.py --workdir=/tmp/inspect --mode=inspect --cpu_devices=8
Arguments: `:tiny` shrinks it to a 2-step pulse on synthetic data that runs on 8 logical CPU devices
(`--config=configs/lm_125m.py:tiny`); short arguments combine, e.g. `:tiny,fsdp=4`.
"""

from configs import base
from trainer.config import assemble


def get_config(arg=None):
  c = base.get_config("lm")
  c.steps = 20_000
  c.global_batch_size = 256  # 512k tokens per step.
  c.log_every = 50
  c.eval_every = 1_000
  c.eval_steps = 20
  c.mesh.data = 1
  c.mesh.fsdp = -1  # Every device.
  c.mesh.tensor = 1
  c.sharding.strategy = "fsdp"
  c.data.source = "arrayrecord"
  c.data.path = ""  # Set with --config.data.path=... to the data.prepare output.
  c.data.seq_len = 2048
  c.data.packing = True
  c.data.read_threads = 8
  c.data.prefetch = 4
  c.model.vocab_size = 32_768
  c.model.embed_dim = 768
  c.model.num_layers = 12
  c.model.num_heads = 12
  c.model.num_kv_heads = 4
  c.model.mlp_dim = 2048
  c.model.compute_dtype = "bfloat16"
  c.model.attention = "auto"  # cuDNN on GPUs, splash on TPUs, einsum on the laptop that inspects it.
  c.model.scan_layers = True
  c.model.remat = "dots_no_batch"  # Keeps the weight matmuls' outputs; recomputes attention.
  c.optimizer.learning_rate = 6e-4
  c.optimizer.warmup_steps = 1_000
  c.checkpoint.every = 1_000
  c.checks.replica_every = 500  # And before every save: a device that computes wrong stops the run.
  c.checks.recompute_every = 500  # Nothing replicated (FSDP); cost: docs/results.md, 'Integrity checks'.
  # On GPUs it needs deterministic kernels (main.py sets them), which are slower (docs/results.md, 'One
  # NVIDIA H200, 2026-12-04'); 0 keeps XLA's defaults (docs/guides/first-gpu.md).
  c.checkpoint.keep_every = 5_000
  c.checkpoint.on_nonfinite = "rollback"
  c.watchdog.step_timeout_s = 600.0
  return assemble.apply_args(c, arg)
