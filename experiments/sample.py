"""Text from a trained language model: greedy or temperature sampling from a prompt, decoded with the
data set's own tokenizer, so you can read what the model learned.

  python -m experiments.sample --workdir=runs/text --prompt="The cat" [--tokens=64] [--temperature=0.8]
      [--samples=2] [--seed=0] [--step=N] [--ema]

The newest checkpoint (or --step) of the run in --workdir, on this machine's first device. Data made by
`data.prepare` decodes with the tokenizer stored beside it; the synthetic source has none, so its
prompt and output are token ids (`--prompt=3,17,5`). --temperature=0 is greedy. The prompt runs
through the model once and each new token alone, with a key/value cache (model/kv_cache.py), a mixture
of experts routed dropless whatever its training routed.
A tool beside the experiments, not one of them (experiments.available() leaves it out).
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import exit_codes
from model import kv_cache


def sampler(workdir: str, step: int | None = None, ema: bool = False):
  """(run, fn(prompt, key, new_tokens, temperature) -> tokens, tokenizer or None) for a trained LM;
  `ema`: with the params' moving average."""
  from trainer import components
  from trainer import state as state_lib
  from trainer.checkpoint.read import load

  run = load(workdir, step)
  config = run.config
  experiment = components.load_experiment(config)
  mdef = state_lib.model_def(functools.partial(experiment.build_model, config))
  tokenizer, vocab, banned = None, config.data.vocab_size, ()
  if config.data.source == "arrayrecord":
    from data import arrayrecord, tokenizers

    metadata = arrayrecord.load_metadata(config.data.path)
    tokenizer = tokenizers.for_dataset(metadata, config.data.path)
    vocab, banned = metadata["vocab_size"], (metadata["pad_id"],)
  weights = jax.device_put((run.weights(ema), run.variables), jax.local_devices()[0])
  model = mdef.merge(*weights)

  def sample(prompt, key, new_tokens: int, temperature: float):
    return kv_cache.generate(model, prompt, new_tokens, temperature, key, vocab, banned)

  return run, sample, tokenizer


def main(argv=None) -> None:
  import argparse

  from errors import UserError

  parser = argparse.ArgumentParser(description="Sample text from a trained language model.")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--prompt", default="", help="text (or comma-separated ids for synthetic data)")
  parser.add_argument("--tokens", type=int, default=64, help="new tokens per sample")
  parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  parser.add_argument("--samples", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--step", type=int, default=None, help="checkpoint (default: the newest)")
  parser.add_argument("--ema", action="store_true", help="sample with the params' moving average")
  args = parser.parse_args(argv)
  try:
    if args.tokens < 1 or args.samples < 1 or args.temperature < 0:
      raise UserError("--tokens and --samples must be >= 1 and --temperature >= 0")
    run, fn, tokenizer = sampler(args.workdir, args.step, args.ema)
    if tokenizer is None:
      try:
        ids = [int(x) for x in args.prompt.split(",") if x.strip()]
      except ValueError:
        raise UserError(
          "this run's data is synthetic (no tokenizer): give --prompt as ids, e.g. 3,17,5"
        ) from None
    else:
      ids = [int(i) for i in tokenizer.encode(args.prompt.encode("utf-8"), "--prompt")]
    if not ids:
      raise UserError("--prompt is empty: give at least one token to start from")
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(exit_codes.USER_EXIT)
  prompt = jnp.asarray(np.tile(np.asarray(ids, np.int32), (args.samples, 1)))
  out = np.asarray(fn(prompt, jax.random.PRNGKey(args.seed), args.tokens, args.temperature))
  print(f"checkpoint {run.step} of {args.workdir}, temperature {args.temperature}:")
  for row in out:
    print(tokenizer.decode(row) if tokenizer else ",".join(map(str, row)))


if __name__ == "__main__":
  main()
