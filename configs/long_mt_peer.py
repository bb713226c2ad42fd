"""The long-sequence model MaxText's context parallelism is compared with (benchmarks/maxtext_peer.py
--context): configs/lm_mt_peer.py's model at 2,048 tokens, each sequence split 4 ways as in
configs/long_smoke_cpu.py.

Recipe:
  python main.py --config=configs/long_mt_peer.py --workdir=runs/long_mt_peer --cpu_devices=8
  python benchmarks/maxtext_peer.py --context   # ours and MaxText 0.2.5 interleaved, A B A B
Hardware: 8 logical CPU devices; mesh data=2, context=4 (MaxText: `ici_data_parallelism=2
ici_context_parallelism=4`): each device holds 1/4 of each sequence (two chunks of 256, an early and a
late one, balancing the causal work), and flash attention in blocks of 256 reaches the rest by a ring
of key/value chunks.
Model: Llama-style, d_model 128, 2 layers, 4 query and 4 key-value heads of 32, SwiGLU 512, vocabulary
1024, sequence 2,048, global batch 2 (4,096 tokens per step), bf16 compute with fp32 params, AdamW;
data: the synthetic Markov chain (MaxText: its synthetic data set).
Expect: more tokens/s than MaxText 0.2.5's context parallelism on the same shapes, both with its
defaults and run as this runs (benchmarks/maxtext_peer.py --context; MaxText's ring is refused on CPU,
so it runs its all_gather). Measured: docs/results.md, 'Long sequences'. Logical CPU devices say
nothing about interconnect speed.
Arguments: `:tiny` shrinks it to a 2-step pulse (`--config=configs/long_mt_peer.py:tiny`).
"""

from configs import lm_mt_peer
from trainer.config import assemble


def get_config(arg=None):
  c = lm_mt_peer.get_config()  # The same model, dtypes and optimizer; a long sequence over a context axis.
  c.steps = 60
  c.global_batch_size = 2
  c.data.seq_len = 2048
  c.model.attention = "flash"
  c.model.context_attention = "ring"
  c.model.attention_block = 256
  c.mesh.data = 2
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.context = 4
  return assemble.apply_args(c, arg)
