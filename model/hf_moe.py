"""Hugging Face's mixtures of experts <-> model/moe.py inside model/transformer.py's Decoder: Mixtral
(`MixtralForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`), their config.json keys and their routed
MLPs' tensor names. Everything else (attention, norms, embeddings, dense blocks, reading slice by
slice, writing) is model/hf_llama.py's, which asks this file about routed blocks; what both read alike
is model/hf_common.py's.

Ours stacks the experts: gate, up [E, D, F], down [E, F, D], the router [D, E] in float32. Files hold
one tensor per expert (Mixtral `model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight` [F, D] for
gate, w3 up, w2 down [D, F]; Qwen3-MoE `model.layers.{i}.mlp.experts.{j}.gate_proj.weight`, up_proj,
down_proj), as transformers 4's modules hold them and as transformers 5's save_pretrained writes them
(5.25 seen). transformers 5 fuses them in memory (`mlp.experts.gate_up_proj` [E, 2F, D], gate then up;
`mlp.experts.down_proj` [E, D, F]; Mixtral's router renamed `mlp.gate.weight`), so a file saved from its
state dict holds those: both layouts are read, a slice of experts reading only their rows. Exports
write the per-expert layout, which transformers 4 and 5 both load.

Which one a mixture exports as: with model.qk_norm a Qwen3-MoE (the first model.moe.first_dense blocks
dense: `mlp_only_layers`), without it a Mixtral (every block routes, the top-k renormalized). What
neither can say is refused, on import and on export, with one line naming it: shared experts (Qwen2-MoE's
are scaled by a sigmoid gate of their own, and its attention has q/k/v biases), sigmoid scores, router
jitter noise, sliding windows, and routed layers that are not "the first k dense, then all routed".
"""

from errors import UserError
from model import hf_common
from model.hf_common import Layout

MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe")  # qwen2_moe: only to say why it is refused.
_FUSED = ".mlp.experts.gate_up_proj"  # transformers 5's in-memory name: a file of the fused layout.


def routed_mlp(m, present=frozenset()) -> dict:
  """A routed block's MLP tensors by our path inside the block, for model config `m`: Qwen3-MoE's
  names with model.qk_norm, else Mixtral's; the fused layout when the file (`present`) has it."""
  layer = "model.layers.{i}"
  if any(name.endswith(_FUSED) for name in present):
    return {
      ("mlp", "router"): Layout(f"{layer}.mlp.gate.weight", True, (1, 1)),
      ("mlp", "gate"): Layout(f"{layer}.mlp.experts.gate_up_proj", True, (1, 1), True, 0, 2),
      ("mlp", "up"): Layout(f"{layer}.mlp.experts.gate_up_proj", True, (1, 1), True, 1, 2),
      ("mlp", "down"): Layout(f"{layer}.mlp.experts.down_proj", True, (1, 1), True),
    }
  mlp, (gate, up, down) = (
    (f"{layer}.mlp", ("gate_proj", "up_proj", "down_proj"))
    if m.qk_norm
    else (f"{layer}.block_sparse_moe", ("w1", "w3", "w2"))
  )
  return {
    ("mlp", "router"): Layout(f"{mlp}.gate.weight", True, (1, 1)),
    ("mlp", "gate"): Layout(f"{mlp}.experts.{{j}}.{gate}.weight", True, (1, 1), True),
    ("mlp", "up"): Layout(f"{mlp}.experts.{{j}}.{up}.weight", True, (1, 1), True),
    ("mlp", "down"): Layout(f"{mlp}.experts.{{j}}.{down}.weight", True, (1, 1), True),
  }


def config_keys(hf: dict, file: str) -> dict[str, tuple[object, str]]:
  """Our keys from a Mixtral's or Qwen3-MoE's config.json (hf_llama.config_keys' contract)."""
  kind = hf["model_type"]
  unsupported = lambda what: hf_common.unsupported(file, what)
  if kind == "qwen2_moe":
    raise unsupported(
      "model_type 'qwen2_moe': a shared expert scaled by a sigmoid gate of its own "
      "(mlp.shared_expert_gate.weight) and q/k/v biases (qkv_bias)"
    )
  keys = hf_common.common_keys(hf, file)
  n = hf["num_hidden_layers"]
  if kind == "mixtral":
    if hf.get("router_jitter_noise"):
      raise unsupported(f"router_jitter_noise={hf['router_jitter_noise']} (noise on the experts' input)")
    hf_common.whole(hf, file, "num_local_experts", "num_experts_per_tok", "intermediate_size")
    experts, width, routed = hf["num_local_experts"], hf["intermediate_size"], range(n)
    keys |= {
      "model.mlp_dim": (width, "intermediate_size"),
      "model.moe.expert_dim": (width, "intermediate_size"),
      "model.moe.renormalize": (True, "Mixtral's renormalized top-k"),
      "model.qk_norm": (False, "model_type mixtral"),
    }
  else:
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    hf_common.whole(hf | {"num_experts": experts}, file, "num_experts", "num_experts_per_tok")
    hf_common.whole(hf, file, "intermediate_size", "moe_intermediate_size")
    dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
    routed = [i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0]
    keys |= {
      "model.mlp_dim": (hf["intermediate_size"], "intermediate_size"),
      "model.qk_norm": (True, "model_type qwen3_moe"),
    }
    if not routed:  # A dense model in Qwen3-MoE's clothes: a Qwen3.
      return keys | {"model.moe.num_experts": (0, "decoder_sparse_step, mlp_only_layers")}
    if routed != list(range(routed[0], n)):
      raise unsupported(
        f"routed layers {routed} (decoder_sparse_step={step}, mlp_only_layers={sorted(dense)}); it "
        "routes every block after the first model.moe.first_dense"
      )
    keys |= {
      "model.moe.expert_dim": (hf["moe_intermediate_size"], "moe_intermediate_size"),
      "model.moe.renormalize": (bool(hf.get("norm_topk_prob", False)), "norm_topk_prob"),
    }
  return keys | {
    "model.moe.num_experts": (experts, "num_local_experts" if kind == "mixtral" else "num_experts"),
    "model.moe.top_k": (hf["num_experts_per_tok"], "num_experts_per_tok"),
    "model.moe.first_dense": (routed[0], "the first routed layer"),
    "model.moe.shared_dim": (0, f"model_type {kind}"),
    "model.moe.score": ("softmax", f"model_type {kind}"),
  }


def check_exportable(m) -> None:
  e = m.moe
  if e.shared_dim:
    raise UserError(
      f"this run has shared experts (model.moe.shared_dim={e.shared_dim}), which neither Mixtral's nor "
      "Qwen3-MoE's Hugging Face layout has"
    )
  if e.score != "softmax":
    raise UserError(
      f"this run's router scores are model.moe.score={e.score!r}; Mixtral and Qwen3-MoE take a softmax"
    )
  if not m.qk_norm and e.first_dense:
    raise UserError(
      f"this run keeps its first {e.first_dense} blocks dense (model.moe.first_dense), and a mixture "
      "without model.qk_norm exports as a Mixtral, whose blocks all route"
    )
  if not m.qk_norm and not e.renormalize:
    raise UserError(
      "this run does not renormalize its top-k scores (model.moe.renormalize=False), and a mixture "
      "without model.qk_norm exports as a Mixtral, which always does"
    )


def hf_config(m, common: dict) -> dict:
  """config.json of model config `m`, a mixture of experts; `common`, what every family writes alike."""
  e = m.moe
  if not m.qk_norm:
    return (
      {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
      | common
      | {
        "intermediate_size": e.expert_dim or m.mlp_dim,
        "num_local_experts": e.num_experts,
        "num_experts_per_tok": e.top_k,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
      }
    )
  return (
    {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    | common
    | {
      "intermediate_size": m.mlp_dim,
      "moe_intermediate_size": e.expert_dim or m.mlp_dim,
      # transformers 5 names it num_local_experts, 4 num_experts: both, so that both read it.
      "num_experts": e.num_experts,
      "num_local_experts": e.num_experts,
      "num_experts_per_tok": e.top_k,
      "norm_topk_prob": e.renormalize,
      "decoder_sparse_step": 1,
      "mlp_only_layers": list(range(e.first_dense)),
      "attention_bias": False,
      "use_sliding_window": False,
      "sliding_window": None,
    }
  )
