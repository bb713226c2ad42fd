"""Text from a trained language model: greedy or temperature sampling from a prompt, decoded with the
data set's own tokenizer, so you can read what the model learned.

  python -m model.sample --workdir=runs/text --prompt="The cat" [--tokens=64] [--temperature=0.8]
      [--samples=2] [--seed=0] [--step=N]

The newest checkpoint (or --step) of the run in --workdir, on this machine's first device. Data made by
`data.prepare` decodes with the tokenizer stored beside it; the synthetic source has none, so its
prompt and output are token ids (`--prompt=3,17,5`). --temperature=0 is greedy. Each new token runs
the whole sequence so far through the model (no key-value cache): simple, and fast enough to read.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from trainer.cluster import exit_codes


def generate(logits_of, prompt, new_tokens: int, temperature: float, key, vocab_size: int, banned=()):
  """prompt int32[B, P] -> int32[B, P + new_tokens]. `logits_of` maps tokens [B, L] to logits
  [B, L, V]; ids from `vocab_size` on and `banned` (padding) are never drawn."""
  b, p = prompt.shape
  total = p + new_tokens
  tokens = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt)
  allowed = jnp.arange(logits_of(tokens[:, :1]).shape[-1]) < vocab_size
  for i in banned:
    allowed = allowed.at[i].set(False)

  def body(t, carry):
    tokens, key = carry
    logits = jnp.where(allowed, logits_of(tokens)[:, t - 1], -jnp.inf)  # Causal: later slots unseen.
    key, draw = jax.random.split(key)
    if temperature > 0:
      nxt = jax.random.categorical(draw, logits / temperature, axis=-1)
    else:
      nxt = jnp.argmax(logits, axis=-1)
    return tokens.at[:, t].set(nxt.astype(jnp.int32)), key

  return jax.lax.fori_loop(p, total, body, (tokens, key))[0]


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

  @functools.partial(jax.jit, static_argnums=(3, 4))
  def sample(weights, prompt, key, new_tokens: int, temperature: float):
    return generate(mdef.merge(*weights), prompt, new_tokens, temperature, key, vocab, banned)

  return run, functools.partial(sample, weights), tokenizer


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
