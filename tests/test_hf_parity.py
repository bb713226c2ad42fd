"""The LM against transformers itself: a random transformers Llama read through init_from gives its
logits and its greedy generations; HF -> ours -> HF is bit for bit; a run we trained, exported, loads
in transformers with no missing or unexpected keys and gives our logits; its tokenizer loads in
AutoTokenizer and encodes as ours. torch and transformers come with `make test` (the parity extra),
never with training.

Tolerances: float32 logits agree to 1e-5 of the largest logit (measured: about 4e-7). In bfloat16
both libraries round differently (where they cast, and their matmuls' accumulation), so the bound is
looser: BF16_TOLERANCE of the largest logit. Measured (the test prints it): ours 5.7e-3 and
transformers' 5.2e-3 off float32, and 5.6e-3 off each other.
"""

import json
import os

import jax
import numpy as np
import pytest

from data import prepare, tokenizers
from errors import UserError
from experiments import lm
from model import hf_export, hf_llama, hf_read
from model.sample import generate
from tests.conftest import run_main, run_python
from trainer import components, init_from
from trainer.checkpoint.read import load
from trainer.config import assemble

torch = pytest.importorskip("torch", reason="the parity extra (make test installs it)")
transformers = pytest.importorskip("transformers", reason="the parity extra (make test installs it)")

F32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2
# A GQA model with a non-default rope theta, Llama 3's rope scaling (active: original length 16),
# an explicit head_dim and RMSNorm epsilon; and a tied one with plain RoPE.
GQA = dict(
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  rope_theta=50_000.0,
  rms_norm_eps=1e-5,
  rope_scaling={
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
  },
)
TIED = dict(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)


def save_llama(directory, dtype="float32", **kwargs) -> "transformers.LlamaForCausalLM":
  config = transformers.LlamaConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, **kwargs
  )
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
  model.generation_config.eos_token_id = None  # Greedy decoding runs its whole length, as ours.
  model.save_pretrained(directory)
  return model


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
  root = tmp_path_factory.mktemp("llamas")
  return {
    name: (str(root / name), save_llama(root / name, **kw)) for name, kw in (("gqa", GQA), ("tied", TIED))
  }


def ours(path, *args, **overrides):
  """tokens -> logits of our Decoder with init_from=path on 8 devices (args like `fsdp=4`)."""
  c = assemble.apply_args(assemble.config("lm"), ",".join(("tiny", *args)))
  c.init_from = path
  for key, value in overrides.items():
    assemble.set_key(c, key, value)
  init_from.configure(c, os.path.join(path, "_unused_workdir"))
  comp = components.build(c)
  state = components.fresh_state(comp, c)
  return jitted(comp.mdef, jax.device_get((state.params, state.variables)))


def jitted(mdef, weights):
  """tokens -> logits of the model, compiled (a scanned model runs inside a trace only)."""
  fn = jax.jit(lambda w, tokens: mdef.merge(*w)(tokens))
  return lambda tokens: fn(weights, tokens)


def their_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def off(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize(("name", "layout"), [("gqa", ("fsdp=4",)), ("tied", ("tensor=2", "fsdp=2"))])
def test_init_from_a_transformers_llama_gives_its_logits_and_greedy_tokens(llamas, name, layout):
  """Read slice by slice onto a sharded mesh, unrolled (gqa) and scanned (tied)."""
  path, theirs = llamas[name]
  model = ours(path, *layout, **{"model.scan_layers": name == "tied"})
  rng = np.random.default_rng(0)
  for length in (40, 7):
    tokens = rng.integers(0, 96, (3, length)).astype(np.int32)
    assert off(model(tokens), their_logits(theirs, tokens)) < F32_TOLERANCE
  prompt = rng.integers(0, 96, (2, 5)).astype(np.int32)
  mine = generate(model, prompt, 12, 0.0, jax.random.PRNGKey(0), 96)
  with torch.no_grad():
    reference = theirs.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=12, do_sample=False)
  np.testing.assert_array_equal(np.asarray(mine), reference.numpy())


def test_bfloat16_weights_and_compute_agree_within_the_stated_tolerance(tmp_path):
  """A bfloat16 checkpoint (read and widened exactly) computed in bfloat16 by both."""
  save_llama(tmp_path, "bfloat16", **GQA)
  model = ours(str(tmp_path), "fsdp=2", **{"model.compute_dtype": "bfloat16"})
  tokens = np.random.default_rng(1).integers(0, 96, (4, 32)).astype(np.int32)
  load = lambda dtype: transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
  reference = their_logits(load(torch.float32), tokens)  # The same weights, widened, in float32.
  mine, theirs_bf16 = model(tokens), their_logits(load(torch.bfloat16), tokens)
  print(
    f"bfloat16: ours {off(mine, reference):.2e} and transformers' {off(theirs_bf16, reference):.2e} off "
    f"float32, {off(mine, theirs_bf16):.2e} off each other"
  )
  assert off(mine, theirs_bf16) < BF16_TOLERANCE
  assert off(ours(str(tmp_path), "fsdp=2")(tokens), reference) < F32_TOLERANCE


def test_hf_to_ours_to_hf_is_bit_for_bit(llamas, tmp_path):
  """Read onto 8 devices (scanned: stacked per layer) and written back: every tensor, bit for bit, and
  transformers computes the same logits from the written directory (its config.json, rope included)."""
  for name, (path, _) in llamas.items():
    c = assemble.apply_args(assemble.config("lm"), "tiny,fsdp=4")
    c.init_from, c.model.scan_layers = path, name == "gqa"
    init_from.configure(c, str(tmp_path / name / "run"))
    comp = components.build(c)
    params = jax.device_get(components.fresh_state(comp, c).params)
    out = str(tmp_path / name / "hf")
    hf_export.write(out, c.model, params, {})
    original, exported = hf_read.Tensors(path), hf_read.Tensors(out)
    assert exported.names() == original.names()
    for tensor in original.names():
      everything = (slice(None),) * len(original.shape(tensor))
      np.testing.assert_array_equal(exported.read(tensor, everything), original.read(tensor, everything))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # Its config.json says the same.
    tokens = np.random.default_rng(3).integers(0, 96, (2, 40))
    np.testing.assert_array_equal(their_logits(back, tokens), their_logits(llamas[name][1], tokens))


def test_init_from_on_the_command_line_resumes_and_checks_given_keys(llamas, tmp_path):
  """A run from a transformers Llama trains; rerun, it resumes and says init_from is ignored; a shape
  key given on the command line that disagrees with config.json is one error line naming both."""
  path, _ = llamas["gqa"]
  run = str(tmp_path / "run")
  flags = ["--config=configs/smoke_cpu.py:tiny", "--cpu_devices=8", f"--config.init_from={path}"]
  first = run_main(*flags, f"--workdir={run}", "--config.steps=1")
  assert first.returncode == 0, first.stderr
  assert "init_from: process 0 read 123,520 bytes" in first.stdout
  with open(os.path.join(run, "init_from.json")) as f:
    assert json.load(f)["keys"]["model.head_dim"] == [16, "head_dim"]
  again = run_main(*flags, f"--workdir={run}", "--config.steps=2")
  assert again.returncode == 0, again.stderr
  assert f"init_from={path} is ignored" in again.stdout and "final step 2" in again.stdout

  wrong = run_main(*flags, f"--workdir={tmp_path / 'wrong'}", "--config.model.embed_dim=48")
  assert wrong.returncode == 2
  assert wrong.stderr.strip().splitlines() == [
    f"error: --config.model.embed_dim=48 disagrees with init_from={path}: its hidden_size makes it 32; "
    "drop --config.model.embed_dim"
  ]


@pytest.mark.parametrize(
  ("change", "named"),
  [
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"attention_bias": True}, "attention_bias=true (biases)"),
    ({"sliding_window": 4096}, "a sliding attention window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic"}}, "rope_type 'dynamic'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
  ],
)
def test_a_feature_the_decoder_lacks_is_an_error_naming_it(llamas, tmp_path, change, named):
  with open(os.path.join(llamas["gqa"][0], hf_llama.CONFIG)) as f:
    config = json.load(f) | change
  (tmp_path / hf_llama.CONFIG).write_text(json.dumps(config))
  with pytest.raises(UserError, match="which model/transformer.py's Decoder does not have") as e:
    lm.pretrained_keys(str(tmp_path))
  assert named in str(e.value)


def test_rope_parameters_without_a_theta_take_the_top_level_one(llamas, tmp_path):
  with open(os.path.join(llamas["gqa"][0], hf_llama.CONFIG)) as f:
    config = json.load(f) | {"rope_parameters": {"rope_type": "default"}, "rope_theta": 123.0}
  (tmp_path / hf_llama.CONFIG).write_text(json.dumps(config))
  assert lm.pretrained_keys(str(tmp_path))["model.rope_base"] == (123.0, "rope_theta")


def test_files_that_are_not_whole_safetensors_are_one_line(llamas, tmp_path):
  """A Git LFS pointer (a clone without git-lfs), a truncated file, a broken index: UserErrors."""
  source = os.path.join(llamas["gqa"][0], hf_llama.SINGLE)
  with open(source, "rb") as f:
    whole = f.read()
  cases = {
    "lfs": b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 2471628800\n",
    "truncated": whole[: len(whole) // 2],
  }
  for name, data in cases.items():
    (tmp_path / name).mkdir()
    (tmp_path / name / hf_llama.SINGLE).write_bytes(data)
    with pytest.raises(UserError, match="is not a whole safetensors file"):
      hf_read.Tensors(str(tmp_path / name))
  (tmp_path / "index").mkdir()
  (tmp_path / "index" / hf_llama.INDEX).write_text("{not json")
  with pytest.raises(UserError, match="has no readable weight_map"):
    hf_read.Tensors(str(tmp_path / "index"))


def test_a_trained_run_exports_what_transformers_loads(tmp_path):
  """Our own text (byte tokens), trained 4 steps with Llama's tied layout, exported sharded: no
  missing or unexpected keys, transformers' logits equal ours, and AutoTokenizer (the byte tokenizer
  as a tokenizer.json, and a trained BPE) encodes and decodes as ours."""
  text = tmp_path / "text.txt"
  text.write_text("".join(f"line {i}: the cat sat on the mat, über alles.\n" for i in range(300)))
  data = str(tmp_path / "data")
  prepare.prepare([str(text)], data, seq_len=32)
  run, out = str(tmp_path / "run"), str(tmp_path / "hf")
  trained = run_main(
    "--config=configs/smoke_cpu.py:tiny",
    "--cpu_devices=8",
    f"--workdir={run}",
    "--config.steps=4",
    "--config.data.source=arrayrecord",
    f"--config.data.path={data}",
    "--config.data.seq_len=32",
    "--config.model.vocab_size=258",
    "--config.model.tie_embeddings=true",
    "--config.model.scale_tied_embeddings=false",
  )
  assert trained.returncode == 0, trained.stderr
  export = run_python("-m", "trainer.modes.export", f"--workdir={run}", "--format=hf", f"--out={out}")
  assert export.returncode == 0 and "its byte tokenizer" in export.stdout, export.stderr
  loaded = load(run)
  theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
  assert info["missing_keys"] == info["unexpected_keys"] == set() and not info["mismatched_keys"]
  assert loaded.step == 4
  comp = components.build(loaded.config, with_data=False)
  model = jitted(comp.mdef, (loaded.params, loaded.variables))
  tokens = np.random.default_rng(2).integers(2, 258, (2, 32)).astype(np.int32)
  assert off(model(tokens), their_logits(theirs.eval(), tokens)) < F32_TOLERANCE

  sharded = str(tmp_path / "sharded")  # The same weights in files of at most 20 kB, with an index.
  assert hf_export.write(sharded, loaded.config.model, loaded.params, {}, max_shard_bytes=20_000) > 1
  again = transformers.AutoModelForCausalLM.from_pretrained(sharded).eval()
  np.testing.assert_array_equal(their_logits(again, tokens), their_logits(theirs.eval(), tokens))

  sample = "the cat, über alles\n"
  byte_ids = list(tokenizers.ByteTokenizer().encode(sample.encode(), "test"))
  auto = transformers.AutoTokenizer.from_pretrained(out)
  assert auto(sample, add_special_tokens=False)["input_ids"] == byte_ids and auto.decode(byte_ids) == sample
  assert (auto.eos_token_id, auto.pad_token_id) == (tokenizers.EOS_ID, tokenizers.PAD_ID)

  bpe = str(tmp_path / "bpe_data")
  metadata = prepare.prepare([str(text)], bpe, seq_len=32, train_tokenizer="bpe:300")
  bpe_out = tmp_path / "bpe_hf"
  bpe_out.mkdir()
  assert tokenizers.write_hf_tokenizer(metadata, bpe, str(bpe_out))
  ids = tokenizers.HFTokenizer(os.path.join(bpe, tokenizers.TOKENIZER_FILE)).encode(sample.encode(), "t")
  auto = transformers.AutoTokenizer.from_pretrained(str(bpe_out))
  assert auto(sample, add_special_tokens=False)["input_ids"] == list(ids)
  assert auto.eos_token_id == metadata["eos_id"] and auto.pad_token_id == metadata["pad_id"]


def test_two_processes_each_read_only_the_half_their_devices_hold(tmp_path):
  """2 processes x 4 devices, FSDP over all 8 (every parameter split, fsdp_min_size=0): each process
  reads half of the params' bytes, exactly what its devices hold."""
  from tests.test_local_launcher import _launch

  path = str(tmp_path / "llama")
  config = transformers.LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
  )
  transformers.LlamaForCausalLM(config).save_pretrained(path)
  flags = [f"--config.init_from={path}", "--config.steps=1", "--config.sharding.strategy=fsdp"]
  flags += ["--config.mesh.dcn_fsdp=2", "--config.sharding.fsdp_min_size=0"]
  result = _launch(
    "--processes=2",
    "--cpu_devices=4",
    "--",
    "--config=configs/smoke_cpu.py:tiny,fsdp=4",
    *flags,
    f"--workdir={tmp_path / 'run'}",
    tag=str(tmp_path),
    timeout=240,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  reads, total = {}, None
  for line in result.stdout.splitlines():
    if "] init_from: process" in line:
      words = line.split()
      reads[int(words[3])] = (int(words[5].replace(",", "")), int(words[11].replace(",", "")))
      total = int(words[-1].rstrip(")").replace(",", ""))
  assert sorted(reads) == [0, 1], result.stdout
  assert total == 4 * (2 * 512 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64)
  assert reads == {0: (total // 2, total // 2), 1: (total // 2, total // 2)}


def test_a_config_extends_the_pretrained_rope_on_purpose(llamas, tmp_path, capsys):
  """A Llama with plain RoPE fine-tuned longer (configs/lm_8b_long.py): the config's llama3 scaling is
  kept and said; its shapes still come from config.json, and a shape given otherwise is still an error."""
  c = assemble.apply_args(assemble.config("lm"), "tiny")
  c.init_from, c.model.rope_scaling, c.model.rope_llama3_factor = llamas["tied"][0], "llama3", 4.0
  init_from.configure(c, str(tmp_path / "run"))
  assert (c.model.rope_scaling, c.model.rope_llama3_factor, c.model.embed_dim) == ("llama3", 4.0, 32)
  out = capsys.readouterr().out
  assert "keeps model.rope_scaling=llama3 (its rope_type says none): extended on purpose" in out
  c = assemble.apply_args(assemble.config("lm"), "tiny")
  c.init_from = llamas["tied"][0]
  init_from.configure(c, str(tmp_path / "plain"))
  assert c.model.rope_scaling == "none"  # Left at its default: the pretrained model's.
