"""A learnable synthetic image set: oriented gratings in noise, the class being the orientation.

Record i is a function of (seed, split, i) only: a sinusoidal grating of random spatial frequency and
phase at the orientation of its class (num_classes orientations evenly spaced over 180 degrees, with
a small random jitter), plus Gaussian pixel noise. No download, deterministic, and hard enough that
noise bounds the accuracy a small model reaches.
"""

import numpy as np

TRAIN, EVAL = 0, 1  # Split ids: eval records come from a disjoint random stream.
_STREAM = 0x696D67  # 'img': independent of every other seeded stream.


class GratingSource:
  """Grain random-access source: record i is {'image': float32[size, size, 1], 'label': int32[]}."""

  def __init__(
    self, num_records: int, image_size: int, num_classes: int, noise: float, seed: int, split: int
  ):
    self.num_records, self.image_size, self.num_classes = num_records, image_size, num_classes
    self.noise, self.seed, self.split = noise, seed, split
    grid = (np.arange(image_size, dtype=np.float64) + 0.5) / image_size - 0.5
    self._y, self._x = np.meshgrid(grid, grid, indexing="ij")  # [size, size], centred on 0.

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.__getitems__([index])[0]

  def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
    out = []
    for i in indices:
      if not 0 <= i < self.num_records:
        raise IndexError(i)
      rng = np.random.default_rng([self.seed, _STREAM, self.split, int(i)])
      label = int(rng.integers(self.num_classes))
      spacing = np.pi / self.num_classes
      angle = label * spacing + rng.uniform(-0.2, 0.2) * spacing
      cycles = rng.uniform(1.5, 3.5)  # Periods across the image.
      phase = rng.uniform(0, 2 * np.pi)
      along = self._x * np.cos(angle) + self._y * np.sin(angle)
      image = np.cos(2 * np.pi * cycles * along + phase)
      image = image + self.noise * rng.standard_normal(image.shape)
      out.append({"image": image[..., None].astype(np.float32), "label": np.int32(label)})
    return out
