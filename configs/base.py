"""The config every other config starts from: `get_config(EXPERIMENT)` is every key the trainer declares
(trainer/config/trainer_keys.py) and every key the experiment declares (experiments/NAME_keys.py), at
their defaults, locked: a key declared nowhere is an error. Each declaration says the key's meaning,
rule and what resuming with another value does. Values only; loading it imports no JAX.
"""

import ml_collections

from trainer.config import assemble


def get_config(experiment: str = "lm") -> ml_collections.ConfigDict:
  return assemble.config(experiment)
