"""Input validation as a class: every key the trainer and every experiment declares has a rule and a
resume class, and a wrong value of each kind ends in one UserError (an `error:` line) naming the key."""

import math
import subprocess
import sys

import pytest

import experiments
from configs import base
from errors import UserError
from tests.conftest import REPO
from trainer import experiment as experiment_lib
from trainer.config import assemble, keys
from trainer.config import rules as config_rules
from trainer.config import trainer_keys as declarations

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
    if isinstance(default, bool) or rule is config_rules.text:
      continue
    refused = [v for v in CANDIDATES[type(default)] if rule(v) is not None]
    assert refused, f"{key}: its rule refuses no value of its type"
    for value in refused:
      cfg = base.get_config(experiment)
      assemble.set_key(cfg, key, value)
      with pytest.raises(UserError, match=rf"^{key}="):
        check(cfg)


def _check(experiment):
  declared = assemble.declared(experiment)
  module = experiment_lib.load(experiment)
  return lambda cfg: (config_rules.check(cfg, declared), module.check_config(cfg))


def test_every_trainer_key_has_a_rule_and_refuses_wrong_values():
  trainer_keys = assemble.dotted_keys(base.get_config("lm")) - set(experiments.load_keys("lm").KEYS)
  assert trainer_keys == set(declarations.KEYS)
  _walk("lm", {k: key.rule for k, key in declarations.KEYS.items()}, _check("lm"))


@pytest.mark.parametrize("name", experiments.available())
def test_every_experiment_key_has_a_rule_and_refuses_wrong_values(name):
  own = experiments.load_keys(name).KEYS
  assert set(own) <= assemble.dotted_keys(base.get_config(name))
  _walk(name, {k: key.rule for k, key in own.items()}, _check(name))


def test_a_key_is_declared_with_its_rule_and_resume_class_or_not_at_all():
  with pytest.raises(TypeError):
    keys.Key(1, config_rules.whole(0), "One thing.")  # No resume class.
  with pytest.raises(TypeError, match="needs a rule, a resume class"):
    keys.Key(1, None, keys.FREE, "One thing.")
  with pytest.raises(ValueError, match="breaks its own rule"):
    keys.Key(-1, config_rules.whole(0), keys.FREE, "One thing.")
  refused = {k for k, key in assemble.declared("lm").items() if key.on_resume.kind == "refused"}
  assert refused == {"seed", "global_batch_size", "experiment"}
  with pytest.raises(
    UserError, match="allow_changed_keys='steps': must be a comma-separated list of experiment"
  ):
    config_rules.check(
      _set(base.get_config("lm"), "checkpoint.allow_changed_keys", "steps"), assemble.declared("lm")
    )


def test_the_lm_keys_offer_what_the_model_implements():
  from model.layers import ATTENTION
  from model.transformer import REMAT

  own = experiments.load_keys("lm").KEYS
  for key, names in (("model.attention", ATTENTION), ("model.remat", REMAT)):
    assert [n for n in names if own[key].rule(n) is None] == list(names)
    assert own[key].rule("other") is not None


def test_loading_a_config_file_imports_neither_jax_nor_the_model():
  code = (
    "import sys; from configs import smoke_cpu, vit_smoke_cpu; smoke_cpu.get_config('tiny'); "
    "vit_smoke_cpu.get_config(); heavy = [m for m in sys.modules if m.split('.')[0] in "
    "('jax', 'flax', 'model', 'data', 'orbax', 'grain') or m in ('trainer.train', 'experiments.lm')]; "
    "print(heavy)"
  )
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


def _set(cfg, key, value):
  assemble.set_key(cfg, key, value)
  return cfg


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
    assemble.set_key(cfg, key, value)
  with pytest.raises(UserError, match=fragment):
    experiment_lib.load("lm").check_config(cfg)
