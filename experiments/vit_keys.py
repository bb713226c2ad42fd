"""The keys of experiments/vit.py, each declared once (trainer/config/keys.py): default, rule, what
resuming with another value does, and meaning; and TINY, what a config's `:tiny` argument shrinks.
JAX-free: config files load it without the experiment's model.
"""

from trainer.config import keys
from trainer.config.keys import Key
from trainer.config.rules import real, whole

KEYS = {
  "data.num_examples": Key(100_000, whole(0), keys.DATA, "Training images per epoch."),
  "data.eval_examples": Key(1_024, whole(0), keys.DATA, "Held-out images, from a disjoint random stream."),
  "data.image_size": Key(16, whole(1), keys.DATA, "Height and width in pixels (one channel)."),
  "data.num_classes": Key(8, whole(2), keys.DATA, "Orientations, evenly spaced over 180 degrees."),
  "data.noise": Key(
    1.2, real(0.0), keys.DATA, "Standard deviation of the pixel noise (the grating's amplitude is 1)."
  ),
  "model.patch_size": Key(4, whole(1), keys.MODEL, "Pixels per patch side; image_size must be a multiple."),
  "model.embed_dim": Key(64, whole(1), keys.MODEL, "Width of the residual stream."),
  "model.num_layers": Key(2, whole(1), keys.MODEL, "Encoder blocks."),
  "model.num_heads": Key(4, whole(1), keys.MODEL, "Attention heads; embed_dim must be a multiple."),
  "model.mlp_dim": Key(128, whole(1), keys.MODEL, "Hidden width of the SwiGLU MLP."),
  "model.dropout": Key(
    0.1,
    real(0.0, 1.0, high_open=True),
    keys.MODEL,
    "Dropout rate after the embedding and each residual branch (training only).",
  ),
}

TINY = {
  "data.image_size": 8,
  "model.patch_size": 4,
  "model.embed_dim": 32,
  "model.num_layers": 1,
  "model.num_heads": 2,
  "model.mlp_dim": 64,
}
