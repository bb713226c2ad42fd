"""Long-sequence smoke experiment: context parallelism on 8 logical CPU devices.

Recipe:
  python main.py --config=configs/long_smoke_cpu.py --workdir=runs/long --cpu_devices=8
Hardware: 8 logical CPU devices; mesh data=2, context=4: each device holds 1/4 of each 2,048-token
sequence (two chunks of 256, an early and a late one), and attention reaches the rest by a ring of
key/value chunks (model.context_attention=all_gather gathers them instead).
Expect: several minutes on 2 cores; the final eval loss ends near the data's floor, which the run
prints. The losses equal context 1's (`--config.mesh.context=1 --config.mesh.data=8`) within 1e-5
relative at every step (`:steps=20 --config.log_every=1`). Measured: docs/results.md, 'Long sequences'.
Arguments: `:tiny` shrinks it to a 2-step pulse; e.g. `:context=8,data=1` splits each sequence 8 ways.
"""

from configs import smoke_cpu
from trainer.config import assemble


def get_config(arg=None):
  c = smoke_cpu.get_config()
  c.steps = 100
  c.data.seq_len = 2048
  c.global_batch_size = 8
  c.model.num_layers = 2
  c.model.attention = "flash"
  c.model.attention_block = 256
  c.log_every = 10
  c.eval_every = 50
  c.eval_steps = 2
  c.mesh.data = 2
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.context = 4
  c.checkpoint.every = 50
  return assemble.apply_args(c, arg)
