"""Small Flax NNX models for the demo, the tests and the benchmarks.

Parameters are annotated with `nnx.with_partitioning` for a ``data x model`` mesh: only the
``model`` axis shards parameters; the ``data`` axis splits the batch.
"""

from mnemojax.models.gpt import GPT as GPT
from mnemojax.models.gpt import GPTConfig as GPTConfig
from mnemojax.models.mlp import MLP as MLP

__all__ = ["GPT", "GPTConfig", "MLP"]
