"""The mixture of experts MaxText's MoE is compared with (benchmarks/maxtext_peer.py --moe), and the model
benchmarks/moe_routing.py routes three ways: configs/lm_mt_peer.py's model with each MLP a top-2 of 8
SwiGLU experts as wide as its dense MLP (Mixtral's layout).

Recipe:
  python main.py --config=configs/moe_mt_peer.py --workdir=runs/moe_mt_peer --cpu_devices=8
  python benchmarks/maxtext_peer.py --moe   # ours and MaxText 0.2.5's MoE interleaved, A B A B
  python benchmarks/moe_routing.py          # capacity, every expert on every token, dropless
Hardware: 8 logical CPU devices (fsdp=8), as MaxText's `hardware=cpu ici_fsdp_parallelism=8` runs it;
no expert axis (the experts are computed where their tokens are, their weights split along embed).
Model: d_model 128, 2 layers, 4 query and 4 key-value heads of 32, vocabulary 1024, sequence 128,
global batch 8, bf16 compute with fp32 params, AdamW; each block's MLP 8 experts of SwiGLU 512, top 2
by a float32 softmax router, renormalized; capacity routing at factor 1.25 (40 slots per expert and
sequence, as MaxText's `capacity_factor=1.25`), the balance loss at 0.01 (MaxText's
load_balance_loss_weight=0.01) and no router z-loss (MaxText has none). 3.54M parameters, 1.18M active
per token; model FLOPs count the active ones only.
Expect: more tokens/s than MaxText 0.2.5's MoE on the same shapes, both with its defaults and run as
this runs (benchmarks/maxtext_peer.py --moe), and than every expert on every token
(benchmarks/moe_routing.py); a few percent of the assignments dropped and each expert's load near 1/8.
Measured, with the loss 60 steps end at: docs/results.md, 'Mixtures of experts'. Logical CPU devices
say nothing about interconnect speed.
Arguments: `:tiny` shrinks it to a 2-step pulse (`--config=configs/moe_mt_peer.py:tiny`).
"""

from configs import lm_mt_peer
from trainer.config import assemble


def get_config(arg=None):
  c = lm_mt_peer.get_config()  # The same shapes, batch, mesh and dtypes; the MLPs become experts.
  c.model.moe.num_experts = 8
  c.model.moe.top_k = 2
  c.model.moe.routing = "capacity"
  c.model.moe.capacity_factor = 1.25
  c.model.moe.balance_loss = 0.01
  c.model.moe.router_z_loss = 0.0
  return assemble.apply_args(c, arg)
