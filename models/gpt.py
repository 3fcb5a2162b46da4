"""A small GPT-style decoder (pre-norm, causal self-attention, GELU MLP) in Flax NNX.

Sharding (Megatron-style along ``model``): attention heads and the MLP hidden dimension
are split over ``model``; embeddings, norms and output projections' outputs are replicated.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

_init = nnx.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 512

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} is invalid: expected an int >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    def param_count(self) -> int:
        d, f, v, t = self.d_model, self.d_ff, self.vocab_size, self.seq_len
        per_layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        return v * d + t * d + self.n_layers * per_layer + 2 * d + d * v + v


def _dense(din, dout, spec, rngs, bias_spec=None):
    return nnx.Linear(din, dout, rngs=rngs, kernel_init=nnx.with_partitioning(_init, spec),
                      bias_init=nnx.with_partitioning(nnx.initializers.zeros, bias_spec or (None,)))


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = _dense(d, 3 * d, (None, "model"), rngs, ("model",))
        self.proj = _dense(d, d, ("model", None), rngs)
        self.fc = _dense(d, cfg.d_ff, (None, "model"), rngs, ("model",))
        self.out = _dense(cfg.d_ff, d, ("model", None), rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (z.reshape(b, t, h, d // h) for z in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h).astype(x.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = nnx.softmax(jnp.where(mask, att, jnp.finfo(att.dtype).min), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(nnx.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.tok = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs,
                             embedding_init=nnx.with_partitioning(_init, (None, None)))
        self.pos = nnx.Param(_init(rngs.params(), (cfg.seq_len, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = _dense(cfg.d_model, cfg.vocab_size, (None, None), rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
