"""A user's own text, end to end: a BPE tokenizer trained on it, training, the weights exported, and
text sampled back with the same tokenizer; and sampling that reproduces what the model learned."""

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from data import prepare, synthetic
from experiments.sample import main as sample_main
from experiments.sample import sampler
from tests.conftest import tiny_config, train_losses
from trainer.modes.export import load, named_tensors
from trainer.modes.export import main as export_main
from trainer.train import train

WORDS = "the cat sat on a mat and the dog ran far away while birds sang".split()


def test_own_text_trains_exports_and_samples_with_its_own_tokenizer(tmp_path, capsys):
  rng = np.random.default_rng(0)
  for i in range(30):
    (tmp_path / f"doc{i:02}.txt").write_text(" ".join(rng.choice(WORDS, 120)))
  data = str(tmp_path / "ds")
  meta = prepare.prepare([str(tmp_path / "doc*.txt")], data, seq_len=32, train_tokenizer="bpe:512")
  assert meta["tokenizer"] == "tokenizers" and (tmp_path / "ds" / "tokenizer.json").is_file()
  assert (meta["pad_id"], meta["eos_id"]) == (0, 1) and meta["vocab_size"] <= 512
  run = str(tmp_path / "run")
  overrides = {"data.source": "arrayrecord", "data.path": data, "data.seq_len": 32, "data.packing": True}
  cfg = tiny_config(steps=30, log_every=5, **{**overrides, "model.vocab_size": 512, "checkpoint.every": 30})
  train(cfg, run)
  losses = train_losses(run)
  assert losses[30] < losses[5] - 1.0, losses  # About 6.4 nats at step 5, 4.3 at step 30.

  out = tmp_path / "w.safetensors"
  export_main([f"--workdir={run}", f"--out={out}"])
  tensors, expected = load_file(str(out)), named_tensors(load(run).params)
  assert sorted(tensors) == sorted(expected)
  assert all(np.array_equal(tensors[k], v) for k, v in expected.items())

  capsys.readouterr()
  sample_main([f"--workdir={run}", "--prompt=the cat", "--tokens=24", "--temperature=0"])
  text = capsys.readouterr().out.splitlines()[-1]
  assert text.startswith("the cat") and set(text[len("the cat") :].split()) & set(WORDS), text


def test_sampled_transitions_follow_the_markov_chain_the_model_learned(tmp_path):
  """Temperature-1 samples of a model trained to its floor on an 8-token chain: each row's empirical
  next-token frequencies are close to the chain's (weighted total variation), far closer than chance."""
  cfg = tiny_config(steps=150, log_every=50, **{"data.vocab_size": 8, "checkpoint.every": 150})
  train(cfg, str(tmp_path))
  _, fn, tokenizer = sampler(str(tmp_path))
  assert tokenizer is None  # Synthetic data: ids in, ids out.
  prompt = jnp.tile(jnp.arange(8, dtype=jnp.int32), 32)[:, None]  # 256 samples, every start token.
  tokens = np.asarray(fn(prompt, jax.random.PRNGKey(0), 15, 1.0))
  counts = np.zeros((8, 8))
  np.add.at(counts, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
  chain = synthetic.MarkovChain(8, cfg.data.markov_concentration, cfg.seed).transitions
  visits = counts.sum(axis=1)
  tv = 0.5 * np.abs(counts / visits[:, None] - chain).sum(axis=1)
  weighted = float(visits @ tv / visits.sum())
  uniform = float(visits @ (0.5 * np.abs(1 / 8 - chain).sum(axis=1)) / visits.sum())
  assert weighted < 0.1 and weighted < uniform / 4, (weighted, uniform)  # Seen: 0.033 and 0.62.
