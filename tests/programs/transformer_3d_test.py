"""An NNX transformer on a (data, fsdp, tensor) mesh, the batch split over (data, fsdp)
as MaxText does and the parameters annotated for FSDP (fsdp) and tensor parallelism
(tensor): through two device losses it ends equal to the plain nnx.jit run on the full
mesh, and an eval step then runs on ``train_step.mesh``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8
VOCAB, D, HEADS, FFN, SEQ, BATCH, STEPS = 32, 16, 2, 32, 8, 8, 6
AXES, BATCH_AXES = ("data", "fsdp", "tensor"), ("data", "fsdp")


def _dense(din, dout, names, rngs):
    return nnx.Linear(din, dout, rngs=rngs, use_bias=False, kernel_init=nnx.with_partitioning(
        nnx.initializers.normal(0.1), names))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.q, self.k, self.v = (_dense(D, D, ("fsdp", "tensor"), rngs) for _ in range(3))
        self.o = _dense(D, D, ("tensor", "fsdp"), rngs)
        self.up = _dense(D, FFN, ("fsdp", "tensor"), rngs)
        self.down = _dense(FFN, D, ("tensor", "fsdp"), rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        y = self.norm1(x)
        q, k, v = (f(y).reshape(b, t, HEADS, D // HEADS) for f in (self.q, self.k, self.v))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D // HEADS)
        causal = jnp.tril(jnp.ones((t, t), bool))
        attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        x = x + self.o(jnp.einsum("bhts,bshd->bthd", attn, v).reshape(b, t, D))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class TinyTransformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = _dense(VOCAB, D, ("tensor", "fsdp"), rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = _dense(D, VOCAB, ("fsdp", "tensor"), rngs)

    def __call__(self, tokens):
        x = self.embed(jax.nn.one_hot(tokens, VOCAB))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def lm_loss(model, batch):
    logits = model(batch["tokens"][:, :-1])
    targets = batch["tokens"][:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}


def make_program():
    with nnx.use_eager_sharding(False):
        model = TinyTransformer(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def make_batches():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)}
            for _ in range(STEPS)]


def _eval(model, mesh, batch):
    with jax.set_mesh(mesh):
        tokens = jax.device_put(batch["tokens"], NamedSharding(mesh, P(BATCH_AXES)))
        return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def test_two_device_losses_on_a_data_fsdp_tensor_mesh_match_the_plain_run():
    mesh, batches = h.mesh_of((2, 2, 2), AXES), make_batches()
    model, optimizer = make_program()
    step = mnemojax.resilient(
        train_step, mesh=mesh, options=h.no_precompile(data_axis=BATCH_AXES),
        fault_injector=FaultInjector().lose_devices(2, [2]).lose_devices(4, [5], surface="block"))
    try:
        losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
        first, second = step.statistics.recoveries
        # A data replica dropped (its healthy devices kept as spares), then a spare swapped
        # in for a device whose shards had no other copy.
        assert first.plan_kind == "drop_replicas" and second.plan_kind == "spare_swap"
        assert first.new_mesh_shape == second.new_mesh_shape == {
            "data": 1, "fsdp": 2, "tensor": 2}
        assert "snapshot" in second.source  # alone, or with the live replicas left
        assert step.mesh is not None and {2, 5}.isdisjoint(step.mesh.device_ids.flat)
        logits = _eval(model, step.mesh, batches[0])
    finally:
        step.close()
    assert all(r.steps_lost <= 1 for r in step.statistics.recoveries)

    plain_model, plain_opt = make_program()
    want = h.plain_mesh_run(train_step, plain_model, plain_opt, batches, mesh, P(BATCH_AXES))
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), want)
    np.testing.assert_allclose(logits, _eval(plain_model, mesh, batches[0]),
                               rtol=1e-5, atol=1e-5)
