"""The same config on differently shaped meshes follows the same loss trajectory."""

import numpy as np

from tests.conftest import tiny_config, train_losses
from trainer.train import train


def _losses(tmp_path, mesh):
  data, fsdp, tensor = mesh
  cfg = tiny_config(steps=5, **{"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor})
  workdir = str(tmp_path / "x".join(map(str, mesh)))
  train(cfg, workdir)
  losses = train_losses(workdir)
  assert sorted(losses) == [1, 2, 3, 4, 5]
  return np.array([losses[s] for s in sorted(losses)])


def test_data_fsdp_and_tensor_meshes_agree_for_5_steps(tmp_path):
  reference = _losses(tmp_path, (8, 1, 1))
  for mesh in [(1, 8, 1), (2, 2, 2)]:
    np.testing.assert_allclose(_losses(tmp_path, mesh), reference, rtol=1e-5, atol=0, err_msg=str(mesh))
  assert reference[-1] < reference[0]  # The trajectory moves: agreement is not trivial.
