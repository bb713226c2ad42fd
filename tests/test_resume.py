"""An interrupted run resumed from its checkpoint continues exactly (bitwise) as if never stopped."""

from tests.conftest import tiny_config, train_losses
from trainer.train import train


def test_resume_is_bitwise_identical(tmp_path):
  config = tiny_config(steps=7, **{"checkpoint.every": 3})
  train(config, str(tmp_path / "straight"))

  train(config, str(tmp_path / "interrupted"), stop_after=4)
  assert max(train_losses(str(tmp_path / "interrupted"))) == 4
  train(config, str(tmp_path / "interrupted"))

  straight = train_losses(str(tmp_path / "straight"))
  resumed = train_losses(str(tmp_path / "interrupted"))
  assert sorted(resumed) == list(range(1, 8))
  assert resumed == straight  # Exact equality, every step after the interruption included.
