"""FSDP plus tensor parallelism on a (data, fsdp, tensor) mesh, the batch split over
(data, fsdp) as MaxText does: a device loss shrinks the fsdp axis (the parameters are
resharded over the survivors, the lost shards come from the host snapshot), and the run
ends equal to the plain ``nnx.jit`` run on the full mesh."""

import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax.models.tasks import classification_loss
from mnemojax.testing import FaultInjector
from tests import helpers as h

# Slow (the default suite's budget): tests/programs/explicit_gemma_test.py shrinks an fsdp
# axis from the snapshot and tests/programs/transformer_3d_test.py splits the batch over
# (data, fsdp) in the default suite; this MLP variant runs in `make test-slow`.
pytestmark = [pytest.mark.needs8, pytest.mark.slow]
AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


class FsdpMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(h.DIN, h.DHIDDEN, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")))
        self.l2 = nnx.Linear(h.DHIDDEN, h.DOUT, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(classification_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}


def _build():
    with nnx.use_eager_sharding(False):
        model = FsdpMLP(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _mesh():
    return h.mesh_of((1, 4, 2), AXES)


def test_fsdp_axis_shrinks_and_lost_shards_come_from_the_snapshot():
    batches = h.make_batches(6)
    model, optimizer = _build()
    step = mnemojax.resilient(
        _train_step, mesh=_mesh(), options=h.no_precompile(data_axis=BATCH_AXES),
        fault_injector=FaultInjector().lose_devices(2, [1]).lose_devices(4, [4]))
    try:
        losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
        first, second = step.statistics.recoveries
    finally:
        step.close()
    assert step.statistics.unreplicated_state
    assert first.plan_kind == "drop_replicas" and first.new_mesh_shape == {
        "data": 1, "fsdp": 2, "tensor": 2}  # fsdp 4 -> 2: it divides the sharded dims
    assert first.source != "live_replicas"  # device 1's shards had no other copy
    assert all(r.steps_lost <= 1 for r in (first, second))
    assert step.mesh is not None and dict(step.mesh.shape)["tensor"] == 2

    want = h.plain_mesh_run(_train_step, *_build(), batches, _mesh(), P(BATCH_AXES))
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), want)
