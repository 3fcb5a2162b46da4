"""The gemma-shaped program on an Explicit (fsdp, tensor) mesh, as google/flax
examples/gemma runs: parameters annotated for FSDP and tensor parallelism, activations
with ``out_sharding`` specs (which need Explicit axes), the example's step signature
``(model, optimizer, rngs, batch, metrics, label_smoothing, pad_id)`` with dropout and a
MultiMetric, the batch split over fsdp. Through two device losses (the fsdp axis shrinks,
lost shards come from the host snapshot) it matches the plain nnx.jit run on the full
mesh, and an eval step then runs on ``train_step.mesh``."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax.models.tasks import shard_onto
from mnemojax.testing import FaultInjector
from tests import helpers as h
from tests.programs.gemma_style_test import PAD, VOCAB, make_batches, train_step

pytestmark = pytest.mark.needs8
D = 16


class ExplicitLM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.1)
        self.embedding = nnx.Param(init(rngs.params(), (VOCAB, D)),
                                   out_sharding=("tensor", "fsdp"))
        self.hidden = nnx.Linear(D, 2 * D, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, ("fsdp", "tensor")))
        self.out = nnx.Linear(2 * D, VOCAB, rngs=rngs,
                              kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")))
        self.dropout = nnx.Dropout(0.2)

    def __call__(self, tokens, rngs: nnx.Rngs):
        x = self.embedding[...].at[tokens].get(out_sharding=P("fsdp", None, None))
        x = self.dropout(x, rngs=rngs)
        h = nnx.gelu(self.hidden(x, out_sharding=P("fsdp", None, "tensor")))
        return self.out(h, out_sharding=P("fsdp", None, None))


def _mesh():
    return jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=jax.devices()[:8],
                         axis_types=(AxisType.Explicit,) * 2)


def make_program(mesh=None):
    with nnx.use_eager_sharding(False):
        model = ExplicitLM(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    if mesh is not None:
        shard_onto(model, optimizer, mesh)
    return (model, optimizer, nnx.Rngs(dropout=7),
            nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy()))


def _eval(model, mesh, batch):
    with jax.set_mesh(mesh):
        tokens = jax.device_put(batch["tokens"][:, :-1], NamedSharding(mesh, P("fsdp")))
        logits = nnx.jit(lambda m, t: m(t, nnx.Rngs(dropout=0)))(model, tokens)
        return np.asarray(logits)


def _run(step, program, batches, mesh=None):
    model, optimizer, rngs, metrics = program
    losses = []
    with jax.set_mesh(mesh) if mesh is not None else _nothing():
        for b in batches:
            if mesh is not None:
                b = jax.device_put(b, NamedSharding(mesh, P("fsdp")))
            losses.append(float(step(model, optimizer, rngs, b, metrics, 0.1, PAD)["loss"]))
    return losses


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _state(model, optimizer):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]


def test_explicit_fsdp_tensor_program_through_two_losses_matches_the_plain_run():
    batches = make_batches()
    program = make_program()
    step = mnemojax.resilient(
        train_step, mesh=_mesh(), options=h.no_precompile(),  # the batch axis: fsdp, inferred
        fault_injector=FaultInjector().lose_devices(2, [3]).lose_devices(4, [5],
                                                                         surface="block"))
    try:
        losses = _run(step, program, batches)
        recoveries = step.statistics.recoveries
        assert len(recoveries) == 2 and all(r.steps_lost <= 1 for r in recoveries)
        first = recoveries[0]  # fsdp 4 -> 2; device 3's shards had no other copy
        assert first.plan_kind == "drop_replicas" and "snapshot" in first.source
        assert first.new_mesh_shape == {"fsdp": 2, "tensor": 2}
        assert step.mesh is not None
        assert tuple(step.mesh.axis_types) == (AxisType.Explicit,) * 2
        assert step.options.data_axis == "fsdp"
        # (the snapshots read from the packs the step writes, on Explicit axes too)
        assert step.statistics.snapshots_packed >= len(batches) - 2
        logits = _eval(program[0], step.mesh, batches[0])
    finally:
        step.close()

    mesh = _mesh()
    plain = make_program(mesh)
    want = _run(nnx.jit(train_step), plain, batches, mesh)
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_state(*program[:2]), _state(*plain[:2]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    got_metrics, want_metrics = program[3].compute(), plain[3].compute()
    for k, v in want_metrics.items():
        np.testing.assert_allclose(float(got_metrics[k]), float(v), rtol=1e-5, atol=1e-6)
    assert int(program[2].dropout.count.get_value()) == int(plain[2].dropout.count.get_value())
    np.testing.assert_allclose(logits, _eval(plain[0], mesh, batches[0]), rtol=1e-5, atol=1e-5)
