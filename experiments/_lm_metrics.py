"""The metrics the LM's loss_sums returns (the Experiment's METRICS): docs/reference/metrics.md lists
them, and tests/test_metrics_reference.py checks a run writes no other."""

from trainer.observe.fields import Field

METRICS = (
  Field("accuracy", "The share of valid tokens whose target has the highest logit (ties count as right)."),
  Field("xent", "The cross-entropy alone.", "model.z_loss > 0 (in training), or a mixture of experts"),
  Field("z_loss", "The z-loss term alone.", "model.z_loss > 0, in training"),
  Field("moe_balance", "The load-balancing loss, per token (1.0 when balanced).", "a mixture of experts"),
  Field("router_z", "The router's z-loss, per token.", "a mixture of experts"),
  Field("router_entropy", "The router's entropy, nats per token.", "a mixture of experts"),
  Field("moe_dropped", "The share of expert assignments dropped (over capacity).", "a mixture of experts"),
  Field(
    "expert_load_NN",
    "Expert NN's share of the assignments (1 / num_experts when balanced).",
    "a mixture of experts",
  ),
  Field("share_NAME", "Data set NAME's share of the valid tokens.", "data.source=mixture"),
)
