"""Model + optimizer construction and the (un-jitted) train steps: the GPT language model
(demo, bench), the MLP classifier (tests, chaos soak, test jobs) and a LoRA fine-tune of
frozen layers (micro-benchmark 10, tests). Each step is defined here once; its users bind
sizes and optimizers."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mnemojax.models.gpt import GPT, GPTConfig
from mnemojax.models.mlp import MLP


def build_gpt(cfg: GPTConfig, *, seed: int = 0, learning_rate: float = 3e-3):
    """A GPT and its AdamW optimizer, built without eager sharding (mnemojax or the caller
    places the state on a mesh). Init is jitted (an eager build compiles many small
    programs), once per configuration: every later build of it runs the same executable."""
    with nnx.use_eager_sharding(False):
        return _gpt_init(cfg, seed, learning_rate)()


@functools.lru_cache(maxsize=8)
def _gpt_init(cfg: GPTConfig, seed: int, learning_rate: float):
    @nnx.jit
    def init():
        model = GPT(cfg, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adamw(learning_rate, weight_decay=0.01),
                                    wrt=nnx.Param)

    return init


def lm_loss(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def lm_train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}


def build_mlp(*, seed: int = 0, din: int = 16, dhidden: int = 64, dout: int = 4,
              dropout: float = 0.0, optimizer: optax.GradientTransformation | None = None):
    """An MLP classifier and its optimizer (default: Adam, learning rate 1e-2), built
    without eager sharding (mnemojax or the caller places the state on a mesh)."""
    with nnx.use_eager_sharding(False):
        model = MLP(din, dhidden, dout, rngs=nnx.Rngs(seed), dropout=dropout)
        tx = optax.adam(1e-2) if optimizer is None else optimizer
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def classification_loss(model, batch):
    """Mean softmax cross-entropy of ``model(batch["x"])`` against integer ``batch["y"]``."""
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def mlp_train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(classification_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}


def shard_onto(model, optimizer, mesh) -> None:
    """Places model and optimizer state on `mesh` per their annotations (plain Flax)."""
    state = nnx.state((model, optimizer))
    specs = nnx.get_partition_spec(state)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    nnx.update((model, optimizer), jax.device_put(state, shardings))


class LoRAMLP(nnx.Module):
    """Frozen `nnx.Linear` layers of ``widths`` (tanh between them), each with a rank-
    ``rank`` `nnx.LoRA` beside it: the shape of a LoRA fine-tune, whose optimizer updates
    only the `nnx.LoRAParam`s (`build_lora_mlp`), so the step returns the base as given."""

    def __init__(self, widths: Sequence[int], rank: int, *, rngs: nnx.Rngs):
        self.layers = nnx.List([
            nnx.LoRA(a, rank, b, base_module=nnx.Linear(a, b, rngs=rngs), rngs=rngs)
            for a, b in zip(widths[:-1], widths[1:], strict=True)])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.tanh(x)
        return x


def build_lora_mlp(*, widths: Sequence[int] = (16, 32, 4), rank: int = 4, seed: int = 0,
                   learning_rate: float = 1e-2):
    """A `LoRAMLP` and its Adam optimizer over the LoRA parameters only."""
    model = LoRAMLP(widths, rank, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.LoRAParam)


def regression_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def lora_train_step(model, optimizer, batch):
    """One step on the LoRA parameters (the gradient of the rest is never taken)."""
    value, grads = nnx.value_and_grad(
        regression_loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, batch)
    optimizer.update(model, grads)
    return {"loss": value}
