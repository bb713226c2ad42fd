"""Llama 3.1 8B's decoder (8.03B parameters) for 8 hosts of 8 GPUs: `--config.init_from=DIR` of its
Hugging Face weights starts from them as is.

Recipe:
  python -m data.prepare --input='corpus/*.txt' --output=/shared/data/corpus --seq_len=4096 \
    --tokenizer=TOKENIZER   # a 128k-vocabulary tokenizer; model.vocab_size must cover it
  CONFIG=configs/lm_8b.py WORKDIR=/shared/runs/lm_8b sbatch --nodes=8 launch/slurm/train.sbatch \
    --config.data.path=/shared/data/corpus --config.mesh.dcn_fsdp=8
Hardware: 8 hosts x 8 GPUs (H100/H200, 80 GB class). FSDP over all 64 GPUs: mesh.fsdp=-1 fills a host,
mesh.dcn_fsdp=8 spans the hosts (outermost, so within-host collectives stay on NVLink).
Model: d_model 4096, 32 scanned layers, 32 query / 8 key-value heads of 128, SwiGLU 14336, RoPE base
500k with Llama 3's scaling (factor 8), RMSNorm epsilon 1e-5, vocabulary 128,256, untied, bf16
compute with fp32 params, full remat (each layer's input kept, the rest recomputed), the loss taking
the logits 256 positions at a time.
Expect: per device on 64 devices, params, optimizer state and a compiled step under an H100's 80 GB
(an estimate, from an ahead-of-time compile on 64 logical CPUs with einsum attention, the step with a
second state for the recompute check; GPUs add NCCL and cuDNN buffers and the weights
launch/gpu_flags.py's pipelined gathers prefetch). Figures: docs/results.md, 'The recipes: memory and
throughput'. Nothing measured on GPUs yet.
Inspect (quick on a laptop: no parameter is allocated):
  python main.py --config=configs/lm_8b.py --workdir=/tmp/inspect --mode=inspect --cpu_devices=64
Arguments: `:tiny` shrinks it to a 2-step pulse on synthetic data that runs on 8 logical CPU devices
(`--config=configs/lm_8b.py:tiny`); short arguments combine, e.g. `:tiny,fsdp=4`.
"""

from configs import lm_1b
from trainer.config import assemble


def get_config(arg=None):
  c = lm_1b.get_config()  # The same cluster settings (mesh, data, attention, scanning); bigger shapes.
  c.steps = 100_000
  c.log_every = 20
  c.data.seq_len = 4096  # 256 sequences: 1M tokens per step; 4 sequences per GPU on 64.
  c.model.embed_dim = 4096
  c.model.num_layers = 32
  c.model.mlp_dim = 14_336
  c.model.remat = "full"
  c.model.tie_embeddings = False
  c.model.rope_llama3_factor = 8.0  # lm_1b's other RoPE and norm settings are Llama 3.1's too.
  c.model.loss_chunk = 256
  c.checkpoint.every = 500
  c.checks.recompute_every = 500  # Pure FSDP: nothing to compare; cost: docs/results.md, 'Integrity checks'.
  # On GPUs it needs deterministic kernels (main.py sets them), which are slower (docs/results.md, 'One
  # NVIDIA H200, 2026-12-04'); 0 keeps XLA's defaults (docs/guides/first-gpu.md).
  c.watchdog.restore_timeout_s = 1_800.0
  c.watchdog.compile_timeout_s = 1_800.0
  c.watchdog.step_timeout_s = 900.0
  return assemble.apply_args(c, arg)
