"""Mixture-of-experts smoke experiment: the smoke decoder with 8 routed experts, top 2, split over an
expert axis.

Recipe:
  python main.py --config=configs/moe_smoke_cpu.py --workdir=runs/moe_smoke --cpu_devices=8
Hardware: 8 logical CPU devices (a laptop, or CI's 2 cores); mesh data=2, fsdp=2, expert=2: the batch
is split over all three, each device holds 4 of the 8 experts, and tokens reach theirs by all-to-all.
Model: the smoke decoder (d_model 128, 2 layers) with each MLP a mixture of 8 SwiGLU experts of width
128, 2 per token, capacity routing (factor 1.25), balance loss 0.01, router z-loss 0.001.
Expect: a couple of minutes on 2 cores. The final eval loss ends within 0.15 nats of the Markov
chain's entropy rate (the printed floor); every logged expert_load_NN stays within 0.125 +- 0.05 (1/8
each when balanced) and moe_dropped below 5%. Measured: docs/results.md, 'Mixtures of experts'.
Logical CPU devices say nothing about interconnect speed.
Arguments: `:tiny` shrinks it to a 2-step pulse; short arguments combine, e.g. `:tiny,expert=4`.
"""

from configs import smoke_cpu
from trainer.config import assemble


def get_config(arg=None):
  c = smoke_cpu.get_config()  # Its model, data, steps and cadences; the MLPs become mixtures.
  c.model.moe.num_experts = 8
  c.model.moe.top_k = 2
  c.model.moe.expert_dim = 128
  c.mesh.data, c.mesh.fsdp, c.mesh.expert, c.mesh.tensor = 2, 2, 2, 1
  c.sharding.strategy = "fsdp"
  return assemble.apply_args(c, arg)
