"""A ~110M-parameter byte-level decoder LM for a GPU cluster: the first real-size recipe.

Recipe:
  python -m data.prepare --input='corpus/*.txt' --output=/shared/data/corpus --seq_len=1024
  CONFIG=configs/lm_small.py WORKDIR=/shared/runs/lm_small sbatch --nodes=2 launch/slurm/train.sbatch
  (or: python launch/k8s/render.py --replicas=2 --config=configs/lm_small.py ... | kubectl apply -f -)
Hardware: N hosts x 8 GPUs (80 GB class); FSDP over the 8 GPUs of a host, data parallel across hosts.
Expect: no figures yet. Nothing here has been measured on GPUs; record step time, tokens/s and the
loss at 20k steps here once a run has, with the command that produced them. Check placement and
per-device memory first, on a laptop, with
  python main.py --config=configs/lm_small.py --workdir=/tmp/inspect --mode=inspect --cpu_devices=8
Arguments: `:tiny` shrinks it to a 2-step pulse on synthetic data that runs on 8 logical CPU devices
(`--config=configs/lm_small.py:tiny`); short arguments combine, e.g. `:tiny,fsdp=4`.
"""

from configs import base
from trainer import configuration


def get_config(arg=None):
  c = base.get_config("lm")
  c.steps = 20_000
  c.global_batch_size = 256
  c.log_every = 50
  c.eval_every = 1_000
  c.eval_steps = 20
  c.mesh.data = -1  # Hosts (and any GPUs beyond 8 per host).
  c.mesh.fsdp = 8
  c.mesh.tensor = 1
  c.sharding.strategy = "fsdp"
  c.data.source = "arrayrecord"
  c.data.path = ""  # Set with --config.data.path=... to the data.prepare output.
  c.data.seq_len = 1024
  c.data.packing = True
  c.data.read_threads = 8
  c.data.prefetch = 4
  c.model.vocab_size = 512  # 258 byte-level ids, padded to a multiple of 128.
  c.model.embed_dim = 768
  c.model.num_layers = 12
  c.model.num_heads = 12
  c.model.mlp_dim = 3072
  c.model.compute_dtype = "bfloat16"
  c.optimizer.learning_rate = 6e-4
  c.optimizer.warmup_steps = 1_000
  c.checkpoint.every = 1_000
  c.checkpoint.keep_every = 5_000
  c.checkpoint.on_nonfinite = "rollback"
  c.watchdog.step_timeout_s = 600.0
  return configuration.apply_args(c, arg)
