"""A mesh axis that a `jax.shard_map` in the step maps over keeps its width in every
recovery (`RecoveryOptions.shrink_shard_map_axes`): the map's body sees its local shapes
and ``axis_size`` change with it, so a pipeline written for two stages, narrowed to one,
trained other math silently (a user trial: `shrink_model`, ``math_changed`` False)."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax._src.compiler import USER_SCOPE
from mnemojax._src.distributed import jax_private
from mnemojax.errors import MeshTooSmallError
from mnemojax.testing import FaultInjector

pytestmark = pytest.mark.needs8

D = 8


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "stage"), devices=jax.devices()[:int(np.prod(shape))],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _stages(w, x):
    """Two stages, one per device along 'stage': each tick applies the local stage and
    passes the activations on; after as many ticks as stages they are back on stage 0."""
    n = jax.lax.axis_size("stage")
    h = x
    for _ in range(n):
        h = jnp.tanh(h @ w[0])
        if n > 1:
            h = jax.lax.ppermute(h, "stage", [(i, (i + 1) % n) for i in range(n)])
    return jax.lax.psum(jnp.where(jax.lax.axis_index("stage") == 0, h, 0.0), "stage")


class _Pipeline(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("stage", None, None))
        self.w = nnx.Param(init(rngs.params(), (2, D, D)))


def _train_step(model, optimizer, x):
    def loss(m):
        out = jax.shard_map(_stages, in_specs=(P("stage"), P("data")),
                            out_specs=P("data"))(m.w[...], x)
        return jnp.mean(out ** 2)

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return {"loss": value}


def wrapped_scope(f, *args):
    with jax.named_scope(USER_SCOPE):
        return f(*args)


def test_the_axes_a_shard_map_maps_over_are_read_from_the_users_scope_only():
    """Only the equations traced in the user's scope count (mnemojax's own shard_maps,
    the finiteness check and the packs, map over every axis), nested calls included."""
    mesh = _mesh((1, 2))
    mine = jax.shard_map(lambda a: a * 2.0, mesh=mesh, in_specs=P("data"),
                         out_specs=P("data"))

    def wrapped(w, x):
        with jax.named_scope(USER_SCOPE):
            inner = jax.jit(lambda w, x: jax.lax.scan(
                lambda c, _: (c + jax.shard_map(
                    lambda w, x: jax.lax.psum(x @ w[0], "stage"), mesh=mesh,
                    in_specs=(P("stage"), P()), out_specs=P(), axis_names={"stage"})(
                        w, x).sum(), None), 0.0, None, length=2)[0])(w, x)
        return inner, mine(x)

    with jax.set_mesh(mesh):
        traced = jax.jit(wrapped).trace(jnp.ones((2, 3, 3)), jnp.ones((2, 3)))
    assert jax_private.shard_map_axes(traced.jaxpr, USER_SCOPE) == {"stage"}
    assert jax_private.shard_map_axes(traced.jaxpr, "elsewhere") == frozenset()

    # Without axis_names= a shard_map makes every axis manual; only those its specs split
    # along or its collectives name count ('stage' here only through the ppermute).
    def data_only(x):
        with jax.named_scope(USER_SCOPE):
            y = jax.shard_map(lambda x: x * 2.0, mesh=mesh, in_specs=P("data"),
                              out_specs=P("data"))(x)
            z = jax.shard_map(lambda x: jax.lax.ppermute(x, "stage", [(0, 1), (1, 0)]),
                              mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(x)
        return y, z

    with jax.set_mesh(mesh):
        traced = jax.jit(data_only).trace(jnp.ones((2, 3)))
        alone = jax.jit(lambda x: wrapped_scope(jax.shard_map(
            lambda x: x * 2.0, mesh=mesh, in_specs=P("data"), out_specs=P("data")), x)
        ).trace(jnp.ones((2, 3)))
    assert jax_private.shard_map_axes(traced.jaxpr, USER_SCOPE) == {"data", "stage"}
    assert jax_private.shard_map_axes(alone.jaxpr, USER_SCOPE) == {"data"}


def _pipeline_losing_a_stage(**recovery):
    """The pipeline on a (data 1, stage 2) mesh, its state placed, and its resilient step
    (with ``RecoveryOptions(**recovery)``) that loses device 1 at its second call; the
    two batches."""
    mesh = _mesh((1, 2))
    with jax.set_mesh(mesh), nnx.use_eager_sharding(False):
        model = _Pipeline(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        state = nnx.state((model, optimizer))
        nnx.update((model, optimizer), jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), state,
            nnx.get_partition_spec(state)))
    step = mnemojax.resilient(
        _train_step, mesh=mesh,
        options=mnemojax.ResilienceOptions(
            compile=mnemojax.CompileOptions(precompile=False, cache_dir=None),
            recovery=mnemojax.RecoveryOptions(**recovery)),
        fault_injector=FaultInjector().lose_devices(2, [1]))
    xs = [np.random.default_rng(i).normal(size=(4, D)).astype(np.float32) for i in range(2)]
    return mesh, model, optimizer, step, xs


def test_a_pipelines_stage_axis_is_kept_whole_and_its_loss_is_a_typed_error():
    """On a (data 1, stage 2) mesh the loss of a stage's device leaves no plan that keeps
    the stage axis: `MeshTooSmallError` naming it (it was narrowed to one stage, which the
    body then applied alone). The option lets a body written for any width narrow it."""
    mesh, model, optimizer, step, xs = _pipeline_losing_a_stage()
    try:
        with jax.set_mesh(mesh):
            step(model, optimizer, xs[0])
            assert step._require_built().builder.facts.shard_map_axes == {"data", "stage"}
            assert step._rules().fixed_axes == ("stage",)  # ('data' is the batch axis)
            with pytest.raises(MeshTooSmallError, match="axis 'stage' kept whole"):
                step(model, optimizer, xs[1])
        step.options = dataclasses.replace(step.options, recovery=dataclasses.replace(
            step.options.recovery, shrink_shard_map_axes=True))
        assert step._rules().fixed_axes == ()
    finally:
        step.close()


def test_a_recovery_that_narrows_a_mapped_axis_under_the_option_says_so(caplog):
    """With ``shrink_shard_map_axes=True`` the loss of a stage's device narrows 'stage'
    from 2 to 1, and the log says that the math is the same only if the body is (trial
    38: nothing said so)."""
    mesh, model, optimizer, step, xs = _pipeline_losing_a_stage(shrink_shard_map_axes=True)
    try:
        with jax.set_mesh(mesh), caplog.at_level(logging.WARNING, logger="mnemojax"):
            for x in xs:
                step(model, optimizer, x)
        assert step.statistics.recoveries[0].new_mesh_shape == {"data": 1, "stage": 1}
        [said] = [r.getMessage() for r in caplog.records if "narrows mesh axes" in r.getMessage()]
        assert "'stage' 2 -> 1" in said and "shrink_shard_map_axes" in said
    finally:
        step.close()
