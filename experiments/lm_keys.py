"""The keys of experiments/lm.py, each declared once (trainer/config/keys.py): default, rule, what
resuming with another value does, and meaning; and TINY, what a config's `:tiny` argument shrinks.
JAX-free: config files load it without the experiment's model.
"""

from trainer.config import keys
from trainer.config.keys import Key
from trainer.config.rules import boolean, one_of, real, text, whole

KEYS = {
  "data.source": Key(
    "synthetic",
    one_of("synthetic", "arrayrecord", "mixture"),
    keys.DATA,
    "'synthetic' (seeded Markov chain with a known loss floor), 'arrayrecord' (data.path) or "
    "'mixture' (data.mixture).",
  ),
  "data.mixture": Key(
    "",
    text,
    keys.DATA,
    "mixture: 'PATH:WEIGHT,PATH:WEIGHT,...', data.prepare outputs and their weights (normalized); each "
    "batch mixes them, and the metrics report each one's share of tokens as share_NAME (data/mixture.py).",
  ),
  "data.num_examples": Key(1_000_000, whole(0), keys.DATA, "Synthetic: training records per epoch."),
  "data.eval_examples": Key(
    1_024, whole(0), keys.DATA, "Synthetic: held-out records, disjoint from the training records."
  ),
  "data.seq_len": Key(
    64, whole(1), keys.DATA, "Tokens per example the model sees (records hold seq_len + 1)."
  ),
  "data.eval_tasks": Key(
    "",
    text,
    keys.FREE,
    "Local JSON Lines tasks 'PATH,PATH' scored at every evaluation as lm-eval-harness scores them: "
    "multiple-choice eval_NAME_acc, greedy exact match eval_NAME_exact_match (experiments/_lm_tasks.py).",
  ),
  "data.eval_max_new_tokens": Key(
    16, whole(1), keys.FREE, "Exact-match tasks: at most this many tokens generated (lm-eval's max_gen_toks)."
  ),
  "data.vocab_size": Key(64, whole(2, 4096), keys.DATA, "Synthetic: vocabulary of the Markov chain."),
  "data.markov_concentration": Key(
    0.1,
    real(0.0, low_open=True),
    keys.DATA,
    "Synthetic: Dirichlet concentration of each row; lower = lower entropy.",
  ),
  "data.path": Key(
    "",
    text,
    keys.DATA,
    "arrayrecord: directory written by `python -m data.prepare` (record counts come from it).",
  ),
  "data.packing": Key(
    False, boolean, keys.DATA, "arrayrecord: documents packed per sequence attend only within themselves."
  ),
  "model.vocab_size": Key(64, whole(2), keys.MODEL, "Must be >= the data's vocabulary."),
  "model.embed_dim": Key(64, whole(2), keys.MODEL, "Width of the residual stream."),
  "model.num_layers": Key(2, whole(1), keys.MODEL, "Decoder blocks."),
  "model.num_heads": Key(4, whole(1), keys.MODEL, "Attention heads."),
  "model.head_dim": Key(
    0, whole(0), keys.MODEL, "Width of each attention head (even); 0: embed_dim // num_heads."
  ),
  "model.num_kv_heads": Key(
    0, whole(0), keys.MODEL, "Key/value heads (grouped-query attention) dividing num_heads; 0: num_heads."
  ),
  "model.mlp_dim": Key(256, whole(1), keys.MODEL, "Hidden width of the SwiGLU MLP."),
  "model.rope_base": Key(10_000.0, real(1.0, low_open=True), keys.MODEL, "RoPE frequency base (theta)."),
  "model.rope_scaling": Key(
    "none",
    one_of("none", "llama3"),
    keys.MODEL,
    "'llama3': Llama 3's RoPE frequency scaling (Hugging Face rope_type llama3) with the four "
    "model.rope_llama3_* keys; 'none': plain RoPE.",
  ),
  "model.rope_llama3_factor": Key(8.0, real(1.0), keys.MODEL, "llama3 scaling: long wavelengths / factor."),
  "model.rope_llama3_low_freq_factor": Key(
    1.0, real(0.0, low_open=True), keys.MODEL, "llama3 scaling: wavelengths above original / this are scaled."
  ),
  "model.rope_llama3_high_freq_factor": Key(
    4.0, real(0.0, low_open=True), keys.MODEL, "llama3 scaling: wavelengths below original / this are kept."
  ),
  "model.rope_llama3_original_max_len": Key(
    8192, whole(1), keys.MODEL, "llama3 scaling: the context length the model was first trained with."
  ),
  "model.norm_eps": Key(1e-6, real(0.0, low_open=True), keys.MODEL, "RMSNorm's epsilon."),
  "model.attention": Key(
    "auto",
    one_of("einsum", "flash", "splash", "xla", "cudnn", "auto"),
    keys.MODEL,
    "'auto': the fastest correct kernel where the run is (flash under mesh.context > 1, splash on TPUs, "
    "cuDNN on GPUs in bfloat16, else einsum); 'einsum' ([B, H, L, L] scores), 'flash' (key/value "
    "blocks, no [L, L] array), 'splash' (JAX's Pallas TPU kernel; interpreted elsewhere, slowly), "
    "'xla' or 'cudnn' (jax.nn.dot_product_attention). model/layers.py ATTENTION.",
  ),
  "model.context_attention": Key(
    "ring",
    one_of("ring", "all_gather"),
    keys.FREE,
    "Under mesh.context > 1: 'ring' passes key/value chunks around the context devices (memory ~ L / "
    "context), 'all_gather' gathers them all once per layer (memory ~ L for K and V). model/context.py.",
  ),
  "model.attention_block": Key(
    0,
    whole(0),
    keys.FREE,
    "'flash' and 'splash': queries and keys per tile, the largest divisor of each chunk's length up to "
    "this (splash: a multiple of 128); 0: by kernel (flash 512, splash 1024). The scores of one "
    "[block, block] tile exist at a time.",
  ),
  "model.qk_norm": Key(
    False,
    boolean,
    keys.MODEL,
    "RMSNorm of each query and key head over head_dim before RoPE, a learned scale each (Qwen3's q_norm, "
    "k_norm; init_from of a Qwen3 sets it).",
  ),
  "model.scan_layers": Key(
    False,
    boolean,
    keys.MODEL,
    "Scanned: one compiled block run num_layers times over stacked params (compile time flat in depth); "
    "unrolled: num_layers copies in the program. Checkpoints of one do not restore into the other.",
  ),
  "model.remat": Key(
    "none",
    one_of("none", "full", "dots", "dots_no_batch", "block_outputs"),
    keys.MODEL,
    "Rematerialization of each block in the backward pass: 'none', 'full', 'dots', 'dots_no_batch' or "
    "'block_outputs' (model/transformer.py REMAT: what each keeps). Less memory for more compute.",
  ),
  "model.tie_embeddings": Key(False, boolean, keys.MODEL, "One table embeds and unembeds."),
  "model.scale_tied_embeddings": Key(
    True,
    boolean,
    keys.MODEL,
    "Tied (the table starts at 1/sqrt(embed_dim) either way): lookups are scaled by sqrt(embed_dim); "
    "False: looked up as they are (Llama's tied layout, which init_from of a Hugging Face model sets).",
  ),
  "model.z_loss": Key(
    0.0, real(0.0), keys.MODEL, "Weight of z-loss (logsumexp^2 per token) added to the loss; 0: none."
  ),
  "model.loss_chunk": Key(
    0,
    whole(0),
    keys.MODEL,
    "Positions per piece of the sequence whose logits exist at once in the loss (0: the whole sequence); "
    "must divide data.seq_len. For a large vocabulary: [batch, loss_chunk, vocab] float32 at a time.",
  ),
  "model.moe.num_experts": Key(
    0,
    whole(0),
    keys.MODEL,
    "Routed experts per mixture-of-experts MLP (model/moe.py); 0: every MLP dense. docs/guides/moe.md.",
  ),
  "model.moe.top_k": Key(2, whole(1), keys.MODEL, "Experts each token is routed to."),
  "model.moe.expert_dim": Key(
    0, whole(0), keys.MODEL, "Hidden width of each routed expert; 0: model.mlp_dim."
  ),
  "model.moe.shared_dim": Key(
    0,
    whole(0),
    keys.MODEL,
    "Hidden width of the shared experts every token passes through (summed); 0: none.",
  ),
  "model.moe.first_dense": Key(
    0,
    whole(0),
    keys.MODEL,
    "The first this many blocks keep a dense MLP of model.mlp_dim (DeepSeek's layout).",
  ),
  "model.moe.score": Key(
    "softmax",
    one_of("softmax", "sigmoid"),
    keys.MODEL,
    "The router's scores: 'softmax' over the experts (Mixtral, Qwen3-MoE) or 'sigmoid' per expert.",
  ),
  "model.moe.renormalize": Key(
    True, boolean, keys.MODEL, "The top-k scores are divided by their sum (Mixtral; Qwen3's norm_topk_prob)."
  ),
  "model.moe.routing": Key(
    "capacity",
    one_of("capacity", "dropless", "every"),
    keys.MODEL,
    "'capacity' (per-sequence expert buffers of capacity_factor, fixed shapes, all-to-all over the expert "
    "axis), 'dropless' (grouped matmuls, exact; GPUs), 'every' (every expert on every token: the reference). "
    "Sampling and the task evaluators route dropless whatever this says (model/kv_cache.py).",
  ),
  "model.moe.capacity_factor": Key(
    1.25,
    real(0.0, low_open=True),
    keys.MODEL,
    "capacity routing: each expert takes ceil(factor x seq_len x top_k / num_experts) tokens of a sequence; "
    "the rest are dropped (metric moe_dropped). num_experts / top_k drops nothing.",
  ),
  "model.moe.balance_loss": Key(
    0.01,
    real(0.0),
    keys.MODEL,
    "Weight of the per-sequence load-balancing loss (Switch's E x sum f_e P_e, 1.0 when balanced), per "
    "token and MoE layer.",
  ),
  "model.moe.router_z_loss": Key(
    0.001,
    real(0.0),
    keys.MODEL,
    "Weight of the router z-loss (logsumexp^2 of router logits), per token and layer.",
  ),
}

TINY = {
  # A recipe's grouped heads and loss chunks would not divide the tiny sizes: their defaults instead.
  "model.num_kv_heads": 0,
  "model.loss_chunk": 0,
  "data.source": "synthetic",
  "data.packing": False,
  "data.vocab_size": 32,
  "data.seq_len": 16,
  "model.vocab_size": 32,
  "model.embed_dim": 32,
  "model.num_layers": 1,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
  # A mixture of experts keeps its expert count and top_k (its routing is what a pulse checks), with
  # experts as wide as the tiny MLP and every (the one) block routed.
  "model.moe.expert_dim": 0,
  "model.moe.first_dense": 0,
}
