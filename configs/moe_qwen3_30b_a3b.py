"""Qwen3-30B-A3B's decoder (30.5B parameters, 3.3B active per token) for 8 hosts of 8 GPUs:
`--config.init_from=DIR` of its Hugging Face weights starts from them as is.

Recipe:
  python -m data.prepare --input='corpus/*.txt' --output=/shared/data/corpus --seq_len=4096 \
    --tokenizer=TOKENIZER   # Qwen3's 151k-vocabulary tokenizer
  CONFIG=configs/moe_qwen3_30b_a3b.py WORKDIR=/shared/runs/qwen3_moe sbatch --nodes=8 \
    launch/slurm/train.sbatch --config.data.path=/shared/data/corpus --config.mesh.dcn_fsdp=8
Hardware: 8 hosts x 8 GPUs (H100/H200, 80 GB class). Within a host the 8 GPUs form the expert axis
(16 experts each; the routed tokens' all-to-all stays on NVLink); across hosts mesh.dcn_fsdp=8 splits
every weight's embed dimension and the batch (256 sequences over data x fsdp x expert = 64).
Model: d_model 2048, 48 scanned layers, 32 query / 4 key-value heads of 128 with each query and key
head RMS-normalized (model.qk_norm), each MLP a mixture of 128 SwiGLU experts of width 768, top 8 of
softmax scores renormalized (norm_topk_prob), capacity routing at factor 1.25, balance loss 0.01 (per
sequence), router z-loss 0.001; RoPE base 1e6, RMSNorm epsilon 1e-6, vocabulary 151,936, untied, bf16
compute with fp32 params, full remat, the loss taking the logits 256 positions at a time. A fine-tune
of Qwen3's own weights should route as it did (model.moe.capacity_factor >= 16, i.e. experts / top_k,
or routing=dropless on one expert shard): capacity 1.25 drops tokens its router sends.
Expect: per device on 64 devices, params, optimizer state and a compiled step under an H100's 80 GB
(an estimate, from an ahead-of-time compile on 64 logical CPUs with einsum attention, the step with a
second state for the recompute check; GPUs add NCCL and cuDNN buffers). The routed tokens' all-to-alls
(128 experts x 320 slots per sequence and layer) send more than the minimum of a forward and a
backward pass, and parameter traffic is above the FSDP minimum, for the same reasons as Mixtral's
(configs/moe_mixtral_8x7b.py). Figures: docs/results.md, 'The recipes: memory and throughput' and
'Mixtures of experts'. Nothing measured on GPUs yet.
Inspect (quick on a laptop: no parameter is allocated):
  python main.py --config=configs/moe_qwen3_30b_a3b.py --workdir=/tmp/inspect --mode=inspect --cpu_devices=64
Arguments: `:tiny` shrinks it to a 2-step pulse on synthetic data that runs on 8 logical CPU devices
(`--config=configs/moe_qwen3_30b_a3b.py:tiny`: 128 experts, expert 8 still); short arguments combine,
e.g. `:tiny,expert=2`.
"""

from configs import moe_mixtral_8x7b
from trainer.config import assemble


def get_config(arg=None):
  c = moe_mixtral_8x7b.get_config()  # The same cluster settings and mesh (expert 8 within a host).
  c.model.vocab_size = 151_936
  c.model.embed_dim = 2048
  c.model.num_layers = 48
  c.model.num_heads = 32
  c.model.num_kv_heads = 4
  c.model.head_dim = 128
  c.model.qk_norm = True
  c.model.mlp_dim = 6144  # Qwen3's intermediate_size: no dense block uses it (first_dense 0).
  c.model.moe.num_experts = 128
  c.model.moe.top_k = 8
  c.model.moe.expert_dim = 768
  c.model.norm_eps = 1e-6
  c.model.loss_chunk = 256
  return assemble.apply_args(c, arg)
