"""A two-layer MLP classifier, hidden layer sharded along the ``model`` axis."""

from __future__ import annotations

from flax import nnx

_init = nnx.initializers.lecun_normal()


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs,
                 dropout: float = 0.0):
        self.l1 = nnx.Linear(din, dhidden, rngs=rngs,
                             kernel_init=nnx.with_partitioning(_init, (None, "model")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("model",)))
        self.l2 = nnx.Linear(dhidden, dout, rngs=rngs,
                             kernel_init=nnx.with_partitioning(_init, ("model", None)))
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x):
        h = nnx.relu(self.l1(x))
        if self.dropout is not None:
            h = self.dropout(h)
        return self.l2(h)
