"""The model MaxText is compared with (benchmarks/maxtext_peer.py): the same shapes, batch and mesh.

Recipe:
  python main.py --config=configs/lm_mt_peer.py --workdir=runs/mt_peer --cpu_devices=8
  python benchmarks/maxtext_peer.py   # ours and MaxText 0.2.5 interleaved, A B A B
Hardware: 8 logical CPU devices (fsdp=8), as MaxText's `hardware=cpu ici_fsdp_parallelism=8` runs it.
Model: Llama-style, d_model 128, 2 layers, 4 query and 4 key-value heads of 32, SwiGLU 512, vocabulary
1024, sequence 128, global batch 8 (MaxText's per_device_batch_size=1 on 8 devices), bf16 compute
with fp32 params, AdamW; data: the synthetic Markov chain (MaxText: its synthetic data set).
Expect: more tokens/s than MaxText 0.2.5 on the same shapes, both with its defaults and run as this
runs (medians of interleaved rounds). Measured, with the loss 60 steps end at: docs/results.md,
'Against MaxText and a bare loop'. Logical CPU devices say nothing about interconnect speed.
Arguments: `:tiny` shrinks it to a 2-step pulse (`--config=configs/lm_mt_peer.py:tiny`).
"""

from configs import base
from trainer.config import assemble


def get_config(arg=None):
  c = base.get_config("lm")
  c.steps = 200
  c.global_batch_size = 8
  c.log_every = 10
  c.eval_steps = 0
  c.mesh.data = 1
  c.mesh.fsdp = 8
  c.mesh.tensor = 1
  c.sharding.strategy = "fsdp"
  c.checkpoint.every = 1_000
  c.data.vocab_size = 1024
  c.data.seq_len = 128
  c.model.vocab_size = 1024
  c.model.embed_dim = 128
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 4
  c.model.mlp_dim = 512
  c.model.compute_dtype = "bfloat16"
  return assemble.apply_args(c, arg)
