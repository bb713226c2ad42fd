"""Smoke experiment: the default of `make train`.

Recipe:
  python main.py --config=configs/smoke_cpu.py --workdir=runs/smoke --cpu_devices=8
Hardware: 8 logical CPU devices (a laptop, or CI's 2 cores); mesh data=2, fsdp=2, tensor=2.
Expect: a couple of minutes on 2 cores. A tiny Llama-style decoder learns a seeded order-1 Markov
chain; the final train loss ends within 0.15 nats of the chain's entropy rate, which the run prints
as the floor. Measured: docs/results.md, 'The recipes: memory and throughput'. Logical CPU devices
say nothing about interconnect speed.
Arguments: `:tiny` shrinks it to a 2-step pulse (a 1-layer model, 16 tokens per example); short
arguments combine, e.g. `--config=configs/smoke_cpu.py:tiny,fsdp=8` (see trainer/config/assemble.py).
"""

from configs import base
from trainer.config import assemble


def get_config(arg=None):
  c = base.get_config("lm")
  c.steps = 500
  c.data.vocab_size = 128
  c.data.seq_len = 128
  c.model.vocab_size = 128
  c.model.embed_dim = 128
  c.model.mlp_dim = 512
  c.global_batch_size = 32
  c.log_every = 25
  c.eval_every = 100
  c.mesh.data = 2
  c.mesh.fsdp = 2
  c.mesh.tensor = 2
  c.checkpoint.every = 100
  return assemble.apply_args(c, arg)
