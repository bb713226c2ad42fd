"""Mixtral 8x7B's decoder (46.7B parameters, 12.9B active per token) for 8 hosts of 8 GPUs:
`--config.init_from=DIR` of its Hugging Face weights starts from them as is.

Recipe:
  python -m data.prepare --input='corpus/*.txt' --output=/shared/data/corpus --seq_len=4096 \
    --tokenizer=TOKENIZER   # Mixtral's 32k-vocabulary tokenizer
  CONFIG=configs/moe_mixtral_8x7b.py WORKDIR=/shared/runs/mixtral sbatch --nodes=8 launch/slurm/train.sbatch \
    --config.data.path=/shared/data/corpus --config.mesh.dcn_fsdp=8
Hardware: 8 hosts x 8 GPUs (H100/H200, 80 GB class). Within a host the 8 GPUs form the expert axis
(one expert each; the routed tokens' all-to-all stays on NVLink); across hosts mesh.dcn_fsdp=8 splits
every weight's embed dimension and the batch (256 sequences over data x fsdp x expert = 64).
Model: d_model 4096, 32 scanned layers, 32 query / 8 key-value heads of 128, each MLP a mixture of 8
SwiGLU experts of width 14336, top 2 of softmax scores renormalized (Mixtral's), capacity routing at
factor 1.25 (fixed shapes: the all-to-all of [batch, experts, capacity, embed]), balance loss 0.01
(Mixtral's router_aux_loss_coef 0.02 is of the global-batch form; ours is per sequence), router
z-loss 0.001; RoPE base 1e6, RMSNorm epsilon 1e-5, vocabulary 32,000, untied, bf16 compute with fp32
params, full remat, the loss taking the logits 512 positions at a time. A fine-tune of Mixtral's own
weights should route as Mixtral did (model.moe.capacity_factor >= 4, i.e. experts / top_k, or
routing=dropless on one expert shard): capacity 1.25 drops tokens Mixtral's router sends.
Expect: per device on 64 devices, params, optimizer state (each expert's weights over fsdp 8 on its
expert's devices) and a compiled step under an H100's 80 GB (an estimate, from an ahead-of-time
compile on 64 logical CPUs with einsum attention, the step with a second state for the recompute
check; GPUs add NCCL and cuDNN buffers). Inspect also counts the model FLOPs (active parameters only)
and the routed tokens' all-to-all bytes, more than the minimum of a forward and a backward pass: full
remat runs the forward's two again (6 per layer, not 4), and XLA:CPU converts bfloat16 all-to-alls to
float32 (a GPU moves bfloat16); parameter traffic is above the FSDP minimum too (XLA:CPU all-reduces
where a reduce-scatter would do). Figures: docs/results.md, 'The recipes: memory and throughput' and
'Mixtures of experts'. Nothing measured on GPUs yet.
Inspect (quick on a laptop: no parameter is allocated):
  python main.py --config=configs/moe_mixtral_8x7b.py --workdir=/tmp/inspect --mode=inspect --cpu_devices=64
Arguments: `:tiny` shrinks it to a 2-step pulse on synthetic data that runs on 8 logical CPU devices
(`--config=configs/moe_mixtral_8x7b.py:tiny`: expert 8 still); short arguments combine, e.g. `:tiny,expert=2`.
"""

from configs import lm_1b
from trainer.config import assemble


def get_config(arg=None):
  c = lm_1b.get_config()  # The same cluster settings (data, attention, scanning, checks); its shapes.
  c.steps = 100_000
  c.log_every = 20
  # Expert 8 within a host; fsdp takes the rest (1 per host once mesh.dcn_fsdp is the number of hosts).
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 1, -1, 8, 1
  c.data.seq_len = 4096  # 256 sequences: 1M tokens per step; 4 sequences per GPU on 64.
  c.model.vocab_size = 32_000
  c.model.embed_dim = 4096
  c.model.num_layers = 32
  c.model.num_heads = 32
  c.model.num_kv_heads = 8
  c.model.mlp_dim = 14_336
  c.model.moe.num_experts = 8
  c.model.moe.top_k = 2
  c.model.moe.routing = "capacity"
  c.model.moe.capacity_factor = 1.25
  c.model.rope_base = 1_000_000.0
  c.model.rope_scaling = "none"
  c.model.norm_eps = 1e-5
  c.model.remat = "full"
  c.model.tie_embeddings = False
  c.model.z_loss = 0.0
  c.checkpoint.every = 500
  c.watchdog.restore_timeout_s = 1_800.0
  c.watchdog.compile_timeout_s = 1_800.0
  c.watchdog.step_timeout_s = 900.0
  return assemble.apply_args(c, arg)
