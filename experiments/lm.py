"""Next-token language modelling with the Llama-style decoder (model/transformer.py).

Data: `data.source='synthetic'`, a seeded order-1 Markov chain whose entropy rate is the loss floor
(data/synthetic.py), or `'arrayrecord'`, token records written by `python -m data.prepare`
(data/arrayrecord.py). A record is {'tokens': int32[seq_len + 1]}; make_batch shifts it into inputs
and targets, masks pad targets and, with packing, separates documents.
"""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data import synthetic
from data.sources import DataSources, recipe_fingerprint
from errors import UserError
from experiments._lm_costs import inspect_notes, model_flops_per_example, routed_bytes_per_example
from experiments._lm_metrics import METRICS
from model import hf_llama, hf_read, losses, splash
from model.layers import RopeScaling
from model.transformer import Decoder, DecoderConfig
from trainer.experiment import Experiment

UNIT = "tokens"
# The decoder's own logical axes: the vocabulary split like the MLP's hidden dimension (tensor, fsdp_tp).
LOGICAL_AXES = {"vocab": "mlp", "act_vocab": "act_mlp"}


def check_config(config) -> None:
  m = config.model
  decoder_config(m)  # The decoder's own shape checks, as errors naming the model.* keys.
  if m.rope_scaling == "llama3" and m.rope_llama3_high_freq_factor <= m.rope_llama3_low_freq_factor:
    raise UserError(
      f"model.rope_llama3_high_freq_factor={m.rope_llama3_high_freq_factor} must exceed "
      f"model.rope_llama3_low_freq_factor={m.rope_llama3_low_freq_factor}"
    )
  if m.attention == "cudnn" and jax.default_backend() != "gpu":
    raise UserError(f"model.attention='cudnn' needs GPUs (this run has {jax.default_backend()}): use 'xla'")
  if m.attention == "splash" and config.data.seq_len % splash.LANE:
    raise UserError(
      f"model.attention='splash' needs data.seq_len a multiple of {splash.LANE}: got {config.data.seq_len}"
    )
  d = config.data
  if d.eval_tasks and d.source == "synthetic":
    raise UserError("data.eval_tasks needs text data with a tokenizer: the synthetic source has none")
  if d.eval_tasks and d.eval_max_new_tokens >= d.seq_len:
    raise UserError(
      f"data.eval_max_new_tokens={d.eval_max_new_tokens} must be below data.seq_len={d.seq_len}: "
      "the context takes the rest"
    )
  context = config.mesh.context
  if context != 1 and m.attention not in ("flash", "splash", "auto"):
    raise UserError(
      f"mesh.context={context} splits the sequence, which only model.attention='flash', 'splash' (or "
      f"'auto') attends across: got {m.attention!r}"
    )
  if context > 1 and m.attention == "splash" and config.data.seq_len % (2 * context * splash.LANE):
    raise UserError(
      f"model.attention='splash' over mesh.context={context} needs data.seq_len a multiple of "
      f"{2 * context * splash.LANE}: each device's two chunks a multiple of {splash.LANE} tokens"
    )
  if context > 1 and config.data.seq_len % (2 * context):
    raise UserError(
      f"data.seq_len={config.data.seq_len} must be a multiple of 2 x mesh.context={2 * context}: each "
      "context device holds an early and a late chunk (model/context.py)"
    )
  if m.loss_chunk and config.data.seq_len % m.loss_chunk:
    raise UserError(f"model.loss_chunk={m.loss_chunk} must divide data.seq_len={config.data.seq_len}")
  _check_moe(m)


def _check_moe(m) -> None:
  e = m.moe
  if not e.num_experts:
    return
  if e.top_k > e.num_experts:
    raise UserError(f"model.moe.top_k={e.top_k} must be at most model.moe.num_experts={e.num_experts}")
  if e.first_dense >= m.num_layers:
    raise UserError(
      f"model.moe.first_dense={e.first_dense} must be below model.num_layers={m.num_layers}: at least "
      "one block routes"
    )


def build_model(config, rngs: nnx.Rngs) -> Decoder:
  return Decoder(decoder_config(config.model), rngs=rngs)


def decoder_config(m) -> DecoderConfig:
  """config.model as the Decoder's config: the keys of the same name, RoPE's scaling and the mixture of
  experts' arguments; a UserError naming the model.* keys where their shapes do not fit."""
  fields = {f.name for f in dataclasses.fields(DecoderConfig)}
  same = {k: m[k] for k in fields if k in m and k not in ("rope_scaling", "moe")}
  e = m.moe
  try:
    return DecoderConfig(
      **same,
      rope_scaling=rope_scaling(m),
      moe=moe_args(m),
      first_dense=e.first_dense,
      balance_loss=e.balance_loss,
      router_z_loss=e.router_z_loss,
    )
  except ValueError as error:
    raise UserError(re.sub(rf"\b({'|'.join(sorted(fields))})\b", r"model.\1", str(error))) from None


def moe_args(m) -> dict | None:
  """model.moe.* as model/moe.MoE's keyword arguments; None for a dense model."""
  e = m.moe
  if not e.num_experts:
    return None
  return dict(
    num_experts=e.num_experts,
    top_k=e.top_k,
    expert_dim=e.expert_dim or m.mlp_dim,
    shared_dim=e.shared_dim,
    score=e.score,
    renormalize=e.renormalize,
    routing=e.routing,
    capacity_factor=e.capacity_factor,
  )


def rope_scaling(m) -> RopeScaling | None:
  if m.rope_scaling == "none":
    return None
  return RopeScaling(
    m.rope_llama3_factor,
    m.rope_llama3_low_freq_factor,
    m.rope_llama3_high_freq_factor,
    m.rope_llama3_original_max_len,
  )


def loss_sums(model: Decoder, batch: dict[str, jax.Array], rng=None, config=None):
  """Sum of next-token cross-entropy over valid tokens (in training plus z-loss and a mixture of
  experts' auxiliary losses: evaluation, whose `rng` is None, reports the cross-entropy the loss floor
  is comparable with), the valid-token count, and metric sums. Deterministic otherwise. The model
  carries model.z_loss, model.loss_chunk and model.moe's loss weights. From a mixture, each source's
  share of the valid tokens, `share_NAME`."""
  w = batch["weights"]  # [B, L]; 0 for padding rows and padding tokens.
  h, aux, order = model.hidden_aux_and_order(
    batch["inputs"], batch.get("positions"), batch.get("segment_ids"), w
  )
  # In the order a context axis split the states (order): the targets move, not the [B, L, D] states.
  targets, weights = (a if order is None else jnp.take(a, order, axis=1) for a in (batch["targets"], w))
  z_loss = model.z_loss if rng is not None else 0.0
  sums = losses.token_sums(model.logits, h, targets, weights, chunk=model.loss_chunk, z_loss=z_loss)
  metrics = {"accuracy": sums["correct"]}
  if z_loss:
    metrics.update(xent=sums["xent"], z_loss=sums["z_loss"])
  total = sums["xent"] + sums.get("z_loss", 0.0)
  if aux is not None:
    aux_loss, aux_metrics = moe_sums(aux, model)
    metrics.update(aux_metrics, xent=sums["xent"])
    if rng is not None:
      total = total + aux_loss
  if "source" in batch and config is not None:
    from data import mixture

    for k, name in enumerate(mixture.names(config.data.mixture)):
      metrics[f"share_{name}"] = jnp.sum(w * (batch["source"][:, None] == k))
  return total, jnp.sum(w), metrics


def moe_sums(aux: dict, model: Decoder) -> tuple[jax.Array, dict]:
  """The MoE layers' auxiliary sums (model/moe.py; over valid tokens, added up over layers) -> the loss
  term (model.moe.balance_loss and router_z_loss times their mean over layers: per token, once divided
  by the valid count) and metric sums, each a per-token mean once divided: moe_balance (1.0 when
  balanced), router_z, router_entropy (nats), moe_dropped (the share of assignments dropped) and
  expert_load_NN (expert NN's share of the assignments; 1 / num_experts when balanced)."""
  mean = {k: v / model.moe_layers for k, v in aux.items()}
  loss = model.balance_loss * mean["balance"] + model.router_z_loss * mean["router_z"]
  metrics = {
    "moe_balance": mean["balance"],
    "router_z": mean["router_z"],
    "router_entropy": mean["router_entropy"],
    "moe_dropped": mean["dropped"],
  }
  metrics.update({f"expert_load_{e:02d}": mean["load"][e] for e in range(mean["load"].shape[0])})
  return loss, metrics


# A longer context than the pretrained model's: RoPE scaled otherwise (trainer/init_from.py).
EXTENDABLE_KEYS = tuple(f"model.rope_{k}" for k in ("scaling", "base")) + tuple(
  f"model.rope_llama3_{k}" for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_len")
)


def pretrained_keys(path: str) -> dict:
  """The model keys a Hugging Face directory's config.json fixes (trainer/init_from.py): a Llama or
  Qwen3 (model/hf_llama.py), a Mixtral or Qwen3-MoE (model/hf_moe.py)."""
  return hf_llama.config_keys(hf_llama.read_config(path), os.path.join(path, hf_llama.CONFIG))


def open_pretrained(path: str, config, leaves) -> hf_read.Pretrained:
  """Its safetensors, read slice by slice into our params."""
  return hf_read.Pretrained(path, leaves, config.model)


def export_hf(run, out: str, weights: dict) -> list[str]:
  """A Hugging Face directory of `weights` (trainer.modes.export --format=hf): a Llama, with
  model.qk_norm a Qwen3, a mixture of experts a Mixtral or (qk_norm) a Qwen3-MoE; with the data set's
  tokenizer when it has one. What was written, for the command's last line."""
  from model import hf_export

  config, special, written = run.config, {}, []
  hf_llama.check_exportable(config.model)  # Before anything is written.
  d, metadata = config.data, None
  if d.source in ("arrayrecord", "mixture"):  # A mixture's data sets share one tokenizer.
    from data import arrayrecord, mixture

    path = d.path if d.source == "arrayrecord" else mixture.parse(d.mixture)[0][0]
    metadata = arrayrecord.load_metadata(path)
    special = {"eos_token_id": metadata["eos_id"], "pad_token_id": metadata["pad_id"]}
  with hf_export.replacing(out) as staged:  # An earlier export in `out` is replaced whole.
    if metadata is not None:
      from data import tokenizers

      if tokenizers.write_hf_tokenizer(metadata, path, staged):
        written.append(f"its {metadata['tokenizer']} tokenizer")
    files = hf_export.write(staged, config.model, weights, special)
  return [f"{files} safetensors file{'s' * (files > 1)}", "config.json", "generation_config.json", *written]


EXPORT_FORMATS = {"hf": export_hf}


def evaluators(config) -> list:
  """data.eval_tasks: multiple-choice and exact-match tasks, scored as lm-eval-harness scores them."""
  from experiments import _lm_tasks

  return _lm_tasks.evaluators(config)


def data_sources(config) -> DataSources:
  d = config.data
  if d.source == "synthetic":
    if d.packing:
      raise UserError("data.packing needs documents; the synthetic source has none (use arrayrecord)")
    if d.vocab_size > config.model.vocab_size:
      raise UserError(f"data.vocab_size={d.vocab_size} exceeds model.vocab_size={config.model.vocab_size}")
    chain = synthetic.MarkovChain(d.vocab_size, d.markov_concentration, config.seed)
    make = lambda n, split: synthetic.MarkovSource(chain, n, d.seq_len, config.seed, split)
    recipe = [d.vocab_size, d.markov_concentration, config.seed, d.num_examples, d.seq_len]
    return DataSources(
      train=make(d.num_examples, synthetic.TRAIN),
      eval=make(d.eval_examples, synthetic.EVAL),
      fingerprint=recipe_fingerprint("synthetic", recipe),
      make_batch=functools.partial(make_batch, pad_id=None, eos_id=None),
      loss_floor=chain.entropy_rate(),
    )
  if d.source == "arrayrecord":
    from data import arrayrecord

    metadata = _checked_metadata(d.path, config)
    return DataSources(
      train=arrayrecord.ArrayRecordSource(d.path, "train", d.seq_len),
      # An empty held-out split is allowed; components.build refuses it only when eval_steps > 0.
      eval=arrayrecord.ArrayRecordSource(d.path, "eval", d.seq_len)
      if metadata["num_records"]["eval"]
      else (),
      fingerprint=metadata["fingerprint"],
      make_batch=_make_batch(metadata, d.packing),
    )
  if d.source == "mixture":
    return _mixture(config)
  raise UserError(f"data.source={d.source!r}: use 'synthetic', 'arrayrecord' or 'mixture'")


def _checked_metadata(path: str, config) -> dict:
  from data import arrayrecord

  metadata = arrayrecord.load_metadata(path)
  arrayrecord.check_compatible(metadata, config.data.seq_len, config.model.vocab_size)
  if metadata.get("loss_weights") and not config.data.packing:
    raise UserError(
      f"data.path={path} holds prompt/response examples packed whole into records: set "
      "data.packing=True, so that each attends only to itself"
    )
  return metadata


def _make_batch(metadata: dict, packing: bool):
  eos_id = metadata["eos_id"] if packing else None
  return functools.partial(make_batch, pad_id=metadata["pad_id"], eos_id=eos_id)


def _mixture(config) -> DataSources:
  """data.mixture's data sets as one source of each split, weighted (data/mixture.py)."""
  from data import arrayrecord, mixture

  d = config.data
  parts = mixture.parse(d.mixture)
  metas = [_checked_metadata(path, config) for path, _ in parts]
  for (path, _), m in zip(parts[1:], metas[1:], strict=True):
    if (m["pad_id"], m["eos_id"]) != (metas[0]["pad_id"], metas[0]["eos_id"]):
      raise UserError(
        f"data.mixture: {path} pads with {m['pad_id']} and ends documents with {m['eos_id']}, "
        f"{parts[0][0]} with {metas[0]['pad_id']} and {metas[0]['eos_id']}: mix data sets of one tokenizer"
      )
  weighted = any(m.get("loss_weights") for m in metas)

  def split(name: str):
    kept = [k for k, m in enumerate(metas) if m["num_records"][name]]  # Held-out splits may be empty.
    if not kept:
      return ()
    sources = [arrayrecord.ArrayRecordSource(parts[k][0], name, d.seq_len) for k in kept]
    return mixture.MixtureSource(sources, [parts[k][1] for k in kept], weighted, ids=kept)

  train = split("train")
  shares = ", ".join(
    f"{n} {w:.0%} ({p:.2f} passes)"
    for n, (_, w), p in zip(mixture.names(d.mixture), parts, train.passes(), strict=True)
  )
  if jax.process_index() == 0:
    print(f"mixture of {len(parts)} data sets, {len(train):,} records per epoch: {shares}", flush=True)
  recipe = [[m["fingerprint"], w] for m, (_, w) in zip(metas, parts, strict=True)]
  return DataSources(
    train=train,
    eval=split("eval"),
    fingerprint=recipe_fingerprint("mixture", recipe, order=mixture.ORDER),
    make_batch=_make_batch(metas[0], d.packing),
    eval_sets={  # Each data set's own held-out loss: eval_NAME_loss.
      name: arrayrecord.ArrayRecordSource(path, "eval", d.seq_len)
      for name, (path, _), m in zip(mixture.names(d.mixture), parts, metas, strict=True)
      if m["num_records"]["eval"]
    },
  )


def example_batch(config) -> dict[str, np.ndarray]:
  """One row shaped as data_sources' batches are, from the config alone (--mode=inspect compiles from it)."""
  d = config.data
  packed = d.source in ("arrayrecord", "mixture") and d.packing
  records = {"tokens": np.zeros((1, d.seq_len + 1), np.int32)}
  if d.source == "mixture":
    records["source"] = np.zeros(1, np.int32)
  return make_batch(records, np.ones(1, bool), pad_id=0, eos_id=0 if packed else None)


def make_batch(records, valid, pad_id: int | None, eos_id: int | None) -> dict[str, np.ndarray]:
  """Token records [rows, seq_len + 1] -> inputs, targets, weights [rows, seq_len] (0 on padding rows,
  pad targets, targets whose loss weight is 0 (a prompt's, in prompt/response data) and, when packed,
  across documents); with `eos_id` (packing) also segment_ids and positions restarting at each
  document."""
  tokens = records["tokens"]
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  weights = np.broadcast_to(valid[:, None], inputs.shape)
  if pad_id is not None:
    weights = weights & (targets != pad_id)
  if "loss_weights" in records:
    weights = weights & (records["loss_weights"][:, 1:] > 0)
  batch = {"inputs": inputs, "targets": targets}
  if "source" in records:  # From a mixture: which data set each row came from.
    batch["source"] = np.asarray(records["source"], np.int32)
  if eos_id is not None:
    batch.update(segments(inputs, eos_id))
    weights = weights & (inputs != eos_id)  # After a document's end comes another document.
  batch["weights"] = weights.astype(np.float32)
  return batch


def segments(inputs: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
  """Segment ids (1, 2, ...) and in-document positions of packed rows [rows, L]; a document's
  end-of-document token belongs to it, the next token starts a new segment."""
  is_eos = inputs == eos_id
  starts = np.zeros_like(is_eos)
  starts[:, 0] = True
  starts[:, 1:] = is_eos[:, :-1]
  segment_ids = np.cumsum(starts, axis=1).astype(np.int32)
  idx = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
  first = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
  return {"segment_ids": segment_ids, "positions": (idx - first).astype(np.int32)}


EXPERIMENT = Experiment(
  UNIT=UNIT,
  LOGICAL_AXES=LOGICAL_AXES,
  check_config=check_config,
  build_model=build_model,
  data_sources=data_sources,
  loss_sums=loss_sums,
  pretrained_keys=pretrained_keys,
  open_pretrained=open_pretrained,
  EXTENDABLE_KEYS=EXTENDABLE_KEYS,
  EXPORT_FORMATS=EXPORT_FORMATS,
  METRICS=METRICS,
  example_batch=example_batch,
  model_flops_per_example=model_flops_per_example,
  routed_bytes_per_example=routed_bytes_per_example,
  inspect_notes=inspect_notes,
  evaluators=evaluators,
)
