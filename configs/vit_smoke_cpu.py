"""ViT smoke experiment: a small Vision Transformer classifies oriented gratings in noise.

Recipe:
  python main.py --config=configs/vit_smoke_cpu.py --workdir=runs/vit --cpu_devices=8
Hardware: 8 logical CPU devices (a laptop, or CI's 2 cores); mesh data=2, fsdp=2, tensor=2.
Expect: a couple of minutes on 2 cores; the closing line's eval_accuracy, over the 1,024 held-out
images, ends near 0.89 (8 classes, chance 0.125). Measured: docs/results.md, 'The recipes: memory and
throughput'.
Dropout 0.1 is on; --mode=verify passes with it, since each example draws its own bits.
Logical CPU devices say nothing about interconnect speed.
Arguments: `:tiny` shrinks it to a 2-step pulse (8x8 images, a 1-layer model); short arguments
combine, e.g. `--config=configs/vit_smoke_cpu.py:tiny,fsdp=8` (see trainer/config/assemble.py).
"""

from configs import base
from trainer.config import assemble


def get_config(arg=None):
  c = base.get_config("vit")
  c.steps = 2_500
  c.global_batch_size = 128
  c.log_every = 50
  c.eval_every = 250
  c.eval_steps = 8
  c.mesh.data = 2
  c.mesh.fsdp = 2
  c.mesh.tensor = 2
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 50
  c.checkpoint.every = 250
  return assemble.apply_args(c, arg)
