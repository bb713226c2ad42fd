"""A learnable synthetic source with a known optimum: sequences from a seeded order-1 Markov chain.

The chain's entropy rate is the lowest expected next-token loss any model can reach, so a run can
be judged against it. Records are random-access and depend only on (seed, split, index).
"""

import numpy as np

TRAIN, EVAL = 0, 1  # Split ids: eval records come from a disjoint stream of the same chain.


class MarkovChain:
  """Transition matrix rows drawn from Dirichlet(concentration); start state from the stationary law."""

  def __init__(self, vocab_size: int, concentration: float, seed: int):
    rng = np.random.default_rng([seed, 0x6D61726B])  # 'mark': independent of the data-order stream.
    self.transitions = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
    self.cdf = np.cumsum(self.transitions, axis=1)
    self.cdf[:, -1] = 1.0  # Guard against rounding: searchsorted must always land inside.
    self.stationary = _stationary(self.transitions)
    self.start_cdf = np.cumsum(self.stationary)
    self.start_cdf[-1] = 1.0

  def entropy_rate(self) -> float:
    """Nats per token: sum_i pi_i H(P_i), the floor of the next-token loss."""
    p = self.transitions
    row_entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
    return float(self.stationary @ row_entropy)

  def sample(self, uniforms: np.ndarray) -> np.ndarray:
    """Sequences [n, length] by inverse-CDF sampling of uniforms [n, length]; vectorized over the n
    sequences (a chain is sequential in its length only)."""
    n, length = uniforms.shape
    out = np.empty((n, length), np.int32)
    state = np.sum(self.start_cdf[None, :] <= uniforms[:, :1], axis=1)
    out[:, 0] = state
    for i in range(1, length):
      state = np.sum(self.cdf[state] <= uniforms[:, i : i + 1], axis=1)
      out[:, i] = state
    return out


def _stationary(p: np.ndarray) -> np.ndarray:
  """The distribution pi with pi P = pi: (P^T - I) pi = 0 with one equation replaced by sum(pi) = 1.
  A linear solve, not an eigendecomposition (np.linalg.eig took 17 s at a vocabulary of 1024)."""
  n = len(p)
  a = p.T - np.eye(n)
  a[-1] = 1.0
  b = np.zeros(n)
  b[-1] = 1.0
  pi = np.linalg.solve(a, b)
  return pi / pi.sum()


class MarkovSource:
  """Grain random-access source: record i is {'tokens': int32[seq_len + 1]}."""

  def __init__(self, chain: MarkovChain, num_records: int, seq_len: int, seed: int, split: int):
    self.chain, self.num_records, self.seq_len = chain, num_records, seq_len
    self.seed, self.split = seed, split

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return self.__getitems__([index])[0]

  def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
    """Grain's batched read: many records in one vectorized pass, each still a function of its index."""
    for i in indices:
      if not 0 <= i < self.num_records:
        raise IndexError(i)
    uniforms = np.stack(
      [np.random.default_rng([self.seed, self.split, int(i)]).random(self.seq_len + 1) for i in indices]
    )
    return [{"tokens": row} for row in self.chain.sample(uniforms)]
