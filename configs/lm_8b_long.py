"""Long-context fine-tuning of a Hugging Face Llama 3 8B: from its 8k context to 64k tokens, RoPE
extended by Llama 3's scaling (factor 8 over the original 8,192 positions), each sequence split over
the 8 GPUs of a host (context parallelism, a ring of key/value chunks), FSDP across hosts.

Recipe (HF_DIR: a Llama 3 or 3.1 8B in Hugging Face's layout; data prepared at 65,536 tokens):
  python -m data.prepare --input='corpus/*.txt' --output=/shared/data/long --seq_len=65536 \
    --tokenizer=HF_DIR/tokenizer.json
  CONFIG=configs/lm_8b_long.py WORKDIR=/shared/runs/lm_8b_long sbatch --nodes=8 launch/slurm/train.sbatch \
    --config.init_from=HF_DIR --config.data.path=/shared/data/long --config.mesh.dcn_fsdp=8
Hardware: 8 hosts x 8 GPUs (80 GB class); mesh context 8 within a host, fsdp 8 across hosts.
init_from sets the model's shapes from HF_DIR's config.json and keeps this file's RoPE scaling
("init_from=...: keeps model.rope_scaling=llama3 (its rope_type says none): extended on purpose"); a
Llama 3.1 already has this scaling and keeps it as is. Packed documents (data.packing) attend within
themselves; positions restart at each.
Expect (inspect on 64 logical CPU devices, an ahead-of-time compile; nothing measured on GPUs yet):
see docs/guides/long-context.md for the memory per device at this length.
Inspect:
  python main.py --config=configs/lm_8b_long.py --workdir=/tmp/inspect --mode=inspect --cpu_devices=64
Arguments: `:tiny` shrinks it to a 2-step pulse on synthetic data on 8 logical CPU devices (context 2).
"""

from configs import lm_8b
from trainer.config import assemble


def get_config(arg=None):
  c = lm_8b.get_config()
  c.steps = 1_000
  c.optimizer.learning_rate = 2e-5
  c.optimizer.warmup_steps = 50
  c.data.seq_len = 65_536
  c.data.packing = True
  c.global_batch_size = 8  # 512k tokens per step: one sequence per host.
  c.model.attention = "flash"
  c.model.attention_block = 1024
  c.model.rope_scaling = "llama3"
  c.model.rope_llama3_factor = 8.0
  c.model.rope_llama3_original_max_len = 8192
  c.model.loss_chunk = 1024
  c.mesh.fsdp = 1
  c.mesh.context = 8
  c.checkpoint.every = 100
  c.checks.recompute_every = 100
  if arg and "tiny" in arg.split(","):
    # The pulse splits over 2, not 8: the other devices go to data, so the first-step check has another
    # layout to compare with (on context 8 alone it has none).
    arg = "context=2," + arg
  return assemble.apply_args(c, arg)
