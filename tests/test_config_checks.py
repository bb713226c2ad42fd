"""Input validation as a class: every key of configs/base.py and of every experiment has a rule, and
a wrong value of each kind ends in one UserError (an `error:` line) naming the key."""

import math

import pytest

import experiments
from configs import base
from errors import UserError
from trainer import config_checks, configuration

# Wrong values of the default's own type (ml_collections refuses another type when the value is set).
CANDIDATES = {
  int: [-(2**40), -5, -1, 0, 2**40],
  float: [-1.0, 0.0, 1.0, 1.5, math.nan, math.inf, -math.inf],
  str: ["", "no-such-value"],
  tuple: [(("x",),), ((1, 2, 3),)],
}


def _get(cfg, key):
  for part in key.split("."):
    cfg = cfg[part]
  return cfg


def _walk(experiment, rules, check):
  """Each key: the values of its type its rule refuses raise a UserError naming the key; at least one is
  refused (booleans and free text such as a path: the type is the whole rule, which ml_collections
  enforces)."""
  for key, rule in rules.items():
    default = _get(base.get_config(experiment), key)
    assert rule(default) is None, (key, default)  # The default itself is allowed.
    if isinstance(default, bool) or rule is config_checks.text:
      continue
    refused = [v for v in CANDIDATES[type(default)] if rule(v) is not None]
    assert refused, f"{key}: its rule refuses no value of its type"
    for value in refused:
      cfg = base.get_config(experiment)
      configuration.set_key(cfg, key, value)
      with pytest.raises(UserError, match=rf"^{key}="):
        check(cfg)


def test_every_trainer_key_has_a_rule_and_refuses_wrong_values():
  trainer_keys = configuration.keys(base.get_config("lm")) - configuration.keys(
    experiments.load("lm").default_config()
  )
  assert trainer_keys == set(config_checks.RULES)
  _walk("lm", config_checks.RULES, config_checks.check)


@pytest.mark.parametrize("name", experiments.available())
def test_every_experiment_key_has_a_rule_and_refuses_wrong_values(name):
  module = experiments.load(name)
  assert configuration.keys(module.default_config()) == set(module.CONFIG_RULES)
  _walk(name, module.CONFIG_RULES, module.check_config)


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    ({"model.loss_chunk": 48}, "model.loss_chunk=48 must divide data.seq_len=64"),
    ({"model.attention": "cudnn"}, "model.attention='cudnn' needs GPUs"),
    ({"model.num_kv_heads": 3}, "model.num_kv_heads=3 must divide model.num_heads=4"),
  ],
)
def test_lm_keys_that_depend_on_each_other_are_checked_together(overrides, fragment):
  cfg = base.get_config("lm")
  for key, value in overrides.items():
    configuration.set_key(cfg, key, value)
  with pytest.raises(UserError, match=fragment):
    experiments.load("lm").check_config(cfg)
