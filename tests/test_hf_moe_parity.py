"""Mixtures of experts against transformers itself (model/hf_moe.py): a random transformers Mixtral and
Qwen3-MoE read through init_from onto a sharded mesh give their float32 logits (to 1e-5 of the largest
logit; measured about 3e-7) and their greedy tokens; HF -> ours -> HF is tensor for tensor, in the
files and once transformers has loaded both; transformers 5's fused expert layout reads the same
params as the per-expert one; a dense Qwen3 (q/k norms) too; what neither layout can say is one
error line, on import and on export.

Routing: dropless, which drops nothing (parity needs routing that cannot drop); capacity routing with
room for all (capacity_factor = E / top_k) gives the same, and the default 1.25 does not (the figures
printed; docs/guides/hugging-face.md). On a mesh with the expert axis (expert 2, fsdp 2,
data 2): capacity routing with room for all; and the default capacity, under which sampling and the task
evaluators, which route dropless whatever training routes, still give transformers' tokens.
"""

import copy
import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from errors import UserError
from experiments import _lm_tasks, lm
from model import hf_export, hf_llama, hf_moe, hf_read, kv_cache
from model.sample import generate
from trainer import components, init_from
from trainer.config import assemble

torch = pytest.importorskip("torch", reason="the parity extra (make test installs it)")
transformers = pytest.importorskip("transformers", reason="the parity extra (make test installs it)")
from safetensors.torch import save_file  # noqa: E402  (torch's half of safetensors: with torch only)

F32_TOLERANCE = 1e-5
V = 96
SIZES = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# Mixtral: every block routes, top-2 of 4 renormalized. Qwen3-MoE: a dense first block (mlp_only_layers),
# q/k norms, top-2 of 4 not renormalized, tied embeddings.
MODELS = {
  "mixtral": (
    transformers.MixtralForCausalLM,
    transformers.MixtralConfig(
      **SIZES,
      intermediate_size=48,
      num_hidden_layers=2,
      num_local_experts=4,
      num_experts_per_tok=2,
      rope_theta=50_000.0,
      rms_norm_eps=1e-5,
    ),
  ),
  "qwen3_moe": (
    transformers.Qwen3MoeForCausalLM,
    transformers.Qwen3MoeConfig(
      **SIZES,
      intermediate_size=64,
      moe_intermediate_size=24,
      num_hidden_layers=3,
      num_experts=4,
      num_experts_per_tok=2,
      mlp_only_layers=[0],
      norm_topk_prob=False,
      tie_word_embeddings=True,
    ),
  ),
  "qwen3": (
    transformers.Qwen3ForCausalLM,
    transformers.Qwen3Config(**SIZES, intermediate_size=48, num_hidden_layers=2, tie_word_embeddings=False),
  ),
}
# Each read onto another layout: unrolled on fsdp 4; scanned (a dense stack, then a routed one) on
# tensor 2 x fsdp 2 with the experts split over tensor (the expert weights' mlp dimension then unsplit);
# the dense Qwen3 unrolled on tensor 2 x fsdp 2.
LAYOUTS = {
  "mixtral": ("fsdp=4", {}),
  "qwen3_moe": ("tensor=2,fsdp=2", {"model.scan_layers": True, "sharding.rules": (("experts", "tensor"),)}),
  "qwen3": ("tensor=2,fsdp=2", {}),
}


def save(cls, config, directory):
  """A random transformers model, its norms' scales drawn too (so a misplaced norm shows) and its
  router 10x larger than its init (decisive routing: no near-ties for rounding to flip)."""
  torch.manual_seed(0)
  model = cls(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.uniform_(0.5, 1.5)
      elif name.endswith("mlp.gate.weight"):
        p.mul_(10.0)
  model = model.eval()
  model.generation_config.eos_token_id = None  # Greedy decoding runs its whole length, as ours.
  model.save_pretrained(directory)
  return model


def read(path, args, **overrides):
  """(config, params) of our Decoder with init_from=path on 8 devices (args like `fsdp=4`), dropless."""
  c = assemble.apply_args(assemble.config("lm"), f"tiny,{args}")
  c.init_from = path
  for key, value in overrides.items():
    assemble.set_key(c, key, value)
  init_from.configure(c, os.path.join(path, "_unused_workdir"))
  if c.model.moe.num_experts:
    c.model.moe.routing = "dropless"
  comp = components.build(c)
  state = components.fresh_state(comp, c)
  fn = jax.jit(lambda w, tokens: comp.mdef.merge(*w)(tokens))
  weights = jax.device_get((state.params, state.variables))
  return c, weights[0], lambda tokens: fn(weights, tokens)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """{name: (directory, the transformers model, our config, our params, our logits function)}."""
  # torch's threads and XLA's share the cores: beside JAX on 2 cores its generate took 1.7-4.5 s, on one
  # thread 0.05 s. One thread for this module's tests; the setting is the process's, so it is restored.
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  root, out = tmp_path_factory.mktemp("hf_moe"), {}
  for name, (cls, config) in MODELS.items():
    path = str(root / name)
    theirs = save(cls, config, path)
    args, overrides = LAYOUTS[name]
    out[name] = (path, theirs, *read(path, args, **overrides))
  yield out
  torch.set_num_threads(threads)


def their_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def off(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3"])
def test_init_from_a_transformers_model_gives_its_logits_and_greedy_tokens(models, name):
  """transformers' greedy continuations of 3 prompts: our logits on them are theirs, and our greedy
  choice at every generated position is their token (greedy decoding of a causal model, teacher-forced
  on its own output); model.sample.generate decodes the Mixtral's from the prompts alone."""
  path, theirs, c, _, model = models[name]
  expected = {"mixtral": (4, False), "qwen3_moe": (4, True), "qwen3": (0, True)}[name]
  assert (c.model.moe.num_experts, c.model.qk_norm) == expected
  prompt = np.random.default_rng(0).integers(0, V, (3, 5)).astype(np.int32)
  with torch.no_grad():
    greedy = theirs.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=35, do_sample=False)
  tokens = greedy.numpy().astype(np.int32)  # [3, 40]
  logits = np.asarray(model(tokens))
  figure = off(logits, their_logits(theirs, tokens))
  print(f"{name}: float32 logits, max |diff| / max |logit| = {figure:.1e}")
  assert figure < F32_TOLERANCE
  np.testing.assert_array_equal(np.argmax(logits[:, 4:-1], axis=-1), tokens[:, 5:])
  if name == "mixtral":
    mine = generate(model, prompt, 12, 0.0, jax.random.PRNGKey(0), V)
    np.testing.assert_array_equal(np.asarray(mine), tokens[:, :17])


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3"])
def test_hf_to_ours_to_hf_is_tensor_for_tensor(models, name, tmp_path):
  """Written back from our params (per expert, as save_pretrained writes): the same tensors bit for
  bit; transformers loads it with no missing or unexpected keys, holds the same tensors (fused, in
  transformers 5) as it does from the original, and computes the same logits."""
  path, theirs, c, params, _ = models[name]
  out = str(tmp_path / "hf")
  hf_export.write(out, c.model, params, {})
  original, exported = hf_read.Tensors(path), hf_read.Tensors(out)
  assert exported.names() == original.names()
  for tensor in original.names():
    everything = (slice(None),) * len(original.shape(tensor))
    np.testing.assert_array_equal(exported.read(tensor, everything), original.read(tensor, everything))
  back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
  assert type(back) is type(theirs)
  assert info["missing_keys"] == info["unexpected_keys"] == set() and not info["mismatched_keys"]
  ours, reference = back.state_dict(), theirs.state_dict()
  assert ours.keys() == reference.keys()
  for key, value in reference.items():
    assert torch.equal(ours[key], value), key
  tokens = np.random.default_rng(3).integers(0, V, (2, 40))
  np.testing.assert_array_equal(their_logits(back.eval(), tokens), their_logits(theirs, tokens))


def test_transformers_5s_fused_experts_read_as_the_per_expert_files(models, tmp_path, capsys):
  """A file of transformers 5's in-memory layout (`mlp.experts.gate_up_proj` [E, 2F, D], down_proj,
  as its state dict holds it) gives the same params, bit for bit, slice by slice on the same mesh,
  reading no byte more than its devices hold (the gate's and up's rows of gate_up_proj apart)."""
  path, theirs, c, params, _ = models["qwen3_moe"]
  state = {k: v.detach().clone().contiguous() for k, v in theirs.state_dict().items()}
  assert "model.layers.1.mlp.experts.gate_up_proj" in state
  fused = tmp_path / "fused"
  fused.mkdir()
  save_file(state, str(fused / hf_llama.SINGLE), metadata={"format": "pt"})
  shutil.copy(os.path.join(path, hf_llama.CONFIG), fused / hf_llama.CONFIG)
  capsys.readouterr()
  _, again, _ = read(str(fused), *LAYOUTS["qwen3_moe"][:1], **LAYOUTS["qwen3_moe"][1])
  jax.tree.map(np.testing.assert_array_equal, again, params)
  words = next(line for line in capsys.readouterr().out.splitlines() if "init_from: process" in line).split()
  assert words[4] == words[10] == f"{sum(x.nbytes for x in jax.tree.leaves(params)):,}", words


def test_the_default_capacity_changes_an_imported_mixtral_and_e_over_k_does_not(models):
  """Capacity routing, one device: capacity_factor = E / top_k drops nothing and gives transformers'
  logits; the default 1.25 drops assignments and changes them (the figures are printed:
  docs/guides/hugging-face.md)."""
  _, theirs, c, params, _ = models["mixtral"]
  tokens = np.random.default_rng(4).integers(0, V, (8, 64)).astype(np.int32)
  reference = their_logits(theirs, tokens)
  for factor in (1.25, 4 / 2):
    mc = copy.deepcopy(c)
    mc.model.moe.routing, mc.model.moe.capacity_factor = "capacity", factor
    with nnx.use_eager_sharding(False):
      model = lm.build_model(mc, nnx.Rngs(0))
    nnx.update(model, jax.tree.map(jax.numpy.asarray, params))
    h, aux = nnx.jit(lambda model, tokens: model.hidden_and_aux(tokens))(model, tokens)
    logits = np.asarray(jax.jit(model.logits)(h))
    dropped = float(aux["dropped"]) / (tokens.size * c.model.num_layers)
    changed = float(np.mean(np.argmax(logits, -1) != np.argmax(reference, -1)))
    figure = off(logits, reference)
    print(
      f"capacity_factor {factor}: {dropped:.1%} of assignments dropped, max |diff| / max |logit| "
      f"{figure:.1e}, greedy token changed at {changed:.1%} of positions"
    )
    assert (dropped > 0 and figure > 1e-3) if factor == 1.25 else (dropped == 0 and figure < F32_TOLERANCE)


def edited(models, name, tmp_path, **change) -> str:
  with open(os.path.join(models[name][0], hf_llama.CONFIG)) as f:
    config = json.load(f) | change
  (tmp_path / hf_llama.CONFIG).write_text(json.dumps(config))
  return str(tmp_path)


@pytest.mark.parametrize(
  ("name", "change", "named"),
  [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("mixtral", {"sliding_window": 4096}, "a sliding attention window"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 64}, "a sliding attention window"),
    (
      "qwen3_moe",
      {"mlp_only_layers": [1]},
      "routed layers [0, 2] (decoder_sparse_step=1, mlp_only_layers=[1])",
    ),
    (
      "qwen3_moe",
      {"mlp_only_layers": [], "decoder_sparse_step": 2},
      "routed layers [1] (decoder_sparse_step=2",
    ),
    ("qwen3_moe", {"model_type": "qwen2_moe"}, "(mlp.shared_expert_gate.weight) and q/k/v biases (qkv_bias)"),
    ("qwen3", {"attention_bias": True}, "attention_bias=true (biases)"),
  ],
)
def test_a_layout_the_decoder_lacks_is_an_error_naming_it(models, tmp_path, name, change, named):
  with pytest.raises(UserError, match="which model/transformer.py's Decoder does not have") as e:
    lm.pretrained_keys(edited(models, name, tmp_path, **change))
  assert named in str(e.value)


def test_qwen3_moe_layouts_read_as_the_first_k_dense(models, tmp_path):
  """decoder_sparse_step=2 over 2 layers routes layer 1 only: the first block dense; a sparse step
  that routes none is a dense Qwen3; its expert count under either name."""
  keys = lm.pretrained_keys(
    edited(models, "qwen3_moe", tmp_path, mlp_only_layers=[], decoder_sparse_step=2, num_hidden_layers=2)
  )
  assert keys["model.moe.first_dense"] == (1, "the first routed layer")
  keys = lm.pretrained_keys(edited(models, "qwen3_moe", tmp_path, mlp_only_layers=[0, 1, 2]))
  assert keys["model.moe.num_experts"][0] == 0 and keys["model.qk_norm"][0] is True
  config = json.loads((tmp_path / hf_llama.CONFIG).read_text())
  config["num_experts"] = config.pop("num_local_experts")  # transformers 4's name.
  (tmp_path / hf_llama.CONFIG).write_text(json.dumps(config | {"mlp_only_layers": [0]}))
  assert lm.pretrained_keys(str(tmp_path))["model.moe.num_experts"] == (4, "num_experts")


@pytest.mark.parametrize(
  ("change", "named"),
  [
    ({"model.moe.shared_dim": 16}, "shared experts (model.moe.shared_dim=16)"),
    ({"model.moe.score": "sigmoid"}, "model.moe.score='sigmoid'"),
    ({"model.moe.first_dense": 1, "model.qk_norm": False}, "first 1 blocks dense (model.moe.first_dense)"),
    (
      {"model.moe.renormalize": False, "model.qk_norm": False, "model.moe.first_dense": 0},
      "renormalize=False",
    ),
  ],
)
def test_what_neither_layout_says_is_refused_before_anything_is_written(models, tmp_path, change, named):
  c = models["qwen3_moe"][2]
  m = copy.deepcopy(c.model)
  for key, value in change.items():
    assemble.set_key(m, key.removeprefix("model."), value)
  with pytest.raises(UserError, match=named.replace("(", r"\(").replace(")", r"\)")):
    hf_export.write(str(tmp_path / "out"), m, {}, {})
  assert not (tmp_path / "out").exists()
  hf_moe.check_exportable(c.model)  # As imported, it exports.


def on_the_expert_axis(path, **moe):
  """(config, components, fresh state) of the Mixtral at `path` read slice by slice onto (expert 2,
  fsdp 2, data 2), with model.moe.KEY = VALUE for each of `moe`."""
  c = assemble.apply_args(assemble.config("lm"), "tiny,data=2,fsdp=2,expert=2")
  c.init_from = path
  init_from.configure(c, os.path.join(path, "_unused_workdir"))
  for key, value in moe.items():
    c.model.moe[key] = value
  comp = components.build(c)
  return c, comp, components.fresh_state(comp, c)


def test_a_mixtral_on_a_mesh_with_the_expert_axis_gives_its_logits(models):
  """Read slice by slice onto (expert 2, fsdp 2, data 2): each device holds half of the experts, and
  capacity routing with room for every token (capacity_factor = E / top_k) gives transformers' logits."""
  path, theirs, *_ = models["mixtral"]
  _, comp, state = on_the_expert_axis(path, routing="capacity", capacity_factor=4 / 2)
  gate = state.params["blocks"][0]["mlp"]["gate"]
  assert {s.data.shape[0] for s in gate.addressable_shards} == {2}  # [E/2, D, F] per device.
  fn = jax.jit(lambda w, tokens: comp.mdef.merge(*w)(tokens))
  tokens = np.random.default_rng(0).integers(0, V, (8, 40)).astype(np.int32)
  figure = off(fn((state.params, state.variables), tokens), their_logits(theirs, tokens))
  print(f"mixtral on (expert 2, fsdp 2, data 2): max |diff| / max |logit| = {figure:.1e}")
  assert figure < F32_TOLERANCE


def test_sampling_and_task_scoring_drop_nothing_whatever_training_routes(models):
  """Inference routes dropless (model/kv_cache.py): under the default capacity routing (1.25), which
  drops assignments of these prompts in training's pass (counted here), sampling (experiments/sample.py's
  kv_cache.generate, on one device) continues 3-token prompts with transformers' greedy tokens, and on
  (expert 2, fsdp 2, data 2) the task evaluators' greedy continuations and log-likelihoods
  (experiments/_lm_tasks.py) of 16-token rows are transformers'."""
  path, theirs, *_ = models["mixtral"]
  c, comp, state = on_the_expert_axis(path)
  assert (c.model.moe.routing, c.model.moe.capacity_factor) == ("capacity", 1.25)  # The defaults.
  model = comp.mdef.merge(state.params, state.variables)
  rng = np.random.default_rng(0)
  short, rows = (rng.integers(0, V, (32, n)).astype(np.int32) for n in (3, 16))
  for tokens in (short, rows):  # A capacity counted from these few tokens drops.
    assert float(nnx.jit(lambda m, t: m.hidden_and_aux(t)[1]["dropped"])(model, tokens)) > 0
  with torch.no_grad():
    expected = [
      theirs.generate(torch.tensor(t, dtype=torch.long), max_new_tokens=8, do_sample=False)
      for t in (short, rows)
    ]

  one = comp.mdef.merge(*jax.device_put((state.params, state.variables), jax.local_devices()[0]))
  sampled = kv_cache.generate(one, jax.numpy.asarray(short), 8, 0.0, jax.random.PRNGKey(0), V)
  np.testing.assert_array_equal(np.asarray(sampled), expected[0].numpy())
  continued = _lm_tasks.continuations(model, rows.tolist(), 8)
  np.testing.assert_array_equal(continued, expected[1].numpy()[:, 16:])
  pairs = [(r[:12].tolist(), r[12:].tolist()) for r in rows]
  scores = _lm_tasks.loglikelihoods(model, pairs, c.data.seq_len, V)
  logp = torch.log_softmax(torch.tensor(their_logits(theirs, rows)), -1).numpy()
  reference = np.take_along_axis(logp[:, 11:15], rows[:, 12:, None], -1).sum((1, 2))
  print(f"log-likelihoods: max |diff| {np.max(np.abs(scores - reference)):.1e}")
  np.testing.assert_allclose(scores, reference, atol=1e-4)
