"""Generated training data: a deterministic low-entropy token language.

Each token has a few likely successors (a fixed random bigram table), so a small model's
loss falls quickly from ln(vocab) and runs are comparable across processes and machines.
"""

from __future__ import annotations

import numpy as np


class BigramCorpus:
    def __init__(self, vocab_size: int, seq_len: int, *, seed: int = 0, branching: int = 4):
        if vocab_size < 2 or seq_len < 2 or branching < 1:
            raise ValueError(
                f"vocab_size={vocab_size}, seq_len={seq_len}, branching={branching}: expected "
                "vocab_size >= 2, seq_len >= 2, branching >= 1")
        rng = np.random.default_rng(seed)
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.successors = rng.integers(0, vocab_size, size=(vocab_size, branching))

    def batch(self, index: int, batch_size: int) -> dict[str, np.ndarray]:
        """Batch number `index`: the same for the same (seed, index, batch_size)."""
        rng = np.random.default_rng([self.seed, index])
        tokens = np.empty((batch_size, self.seq_len + 1), np.int32)
        tokens[:, 0] = rng.integers(0, self.vocab_size, size=batch_size)
        choice = rng.integers(0, self.successors.shape[1], size=(batch_size, self.seq_len))
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
