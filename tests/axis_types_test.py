"""Meshes keep the user's axis types (Auto, Explicit, mixed) through recoveries; a model
written for Explicit axes (``out_sharding`` on its activations) trains, loses two devices,
and ends equal to the plain ``nnx.jit`` run on the same mesh; an eval step then runs on
``train_step.mesh``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax.models.tasks import classification_loss
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8
STEPS = 6


class ActivationSpecMLP(nnx.Module):
    """A tensor-parallel MLP whose activations carry ``out_sharding`` specs (which need
    Explicit axes: a spec naming an Auto axis is an error)."""

    def __init__(self, hidden_spec, out_spec, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(h.DIN, h.DHIDDEN, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, (None, "model")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                             ("model",)))
        self.l2 = nnx.Linear(h.DHIDDEN, h.DOUT, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("model", None)))
        self.hidden_spec, self.out_spec = hidden_spec, out_spec

    def __call__(self, x):
        x = nnx.relu(self.l1(x, out_sharding=self.hidden_spec))
        return self.l2(x, out_sharding=self.out_spec)


def _train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(classification_loss)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss}


KINDS = {  # axis types (data, model), activation specs (hidden, logits)
    "auto": ((AxisType.Auto, AxisType.Auto), (None, None)),
    "explicit": ((AxisType.Explicit, AxisType.Explicit), (P("data", "model"), P("data", None))),
    "mixed": ((AxisType.Explicit, AxisType.Auto), (P("data", None), P("data", None))),
}


def _mesh(kind):
    return jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8],
                         axis_types=KINDS[kind][0])


def _build(kind):
    with nnx.use_eager_sharding(False):
        model = ActivationSpecMLP(*KINDS[kind][1], rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _plain_run(kind, batches):
    model, optimizer = _build(kind)
    return h.plain_mesh_run(_train_step, model, optimizer, batches, _mesh(kind),
                            P("data")), model


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_axis_types_survive_two_device_losses_and_the_math_is_unchanged(kind):
    batches = h.make_batches(STEPS)
    model, optimizer = _build(kind)
    faults = FaultInjector().lose_devices(2, [5]).lose_devices(4, [2])
    step = mnemojax.resilient(_train_step, mesh=_mesh(kind), options=h.no_precompile(),
                              fault_injector=faults)
    try:
        with jax.set_mesh(_mesh(kind)):  # a training loop under the user's mesh, as Flax's
            losses = [float(step(model, optimizer, b)["loss"]) for b in batches]  # examples
            # The ambient mesh followed the step: eager reads of the state work.
            assert jax.sharding.get_mesh() == step.mesh
            assert np.isfinite(float(jnp.sum(model.l1.kernel.get_value())))
        assert jax.sharding.get_mesh().empty  # the with block restored what it had
        assert len(step.statistics.recoveries) == 2
        assert step.mesh is not None
        # A replica dropped, then one regrouped from the healthy leftovers.
        assert dict(step.mesh.shape) == {"data": 3, "model": 2}
        assert tuple(step.mesh.axis_types) == KINDS[kind][0]  # the user's types, kept
        kernel = model.l1.kernel.get_value()
        assert kernel.sharding.mesh.axis_types == KINDS[kind][0]
        # User code after a recovery: an eval step, plain nnx.jit, on the current mesh.
        logits = _eval(model, step.mesh, batches[0])
    finally:
        step.close()
    plain, plain_model = _plain_run(kind, batches)
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), plain)
    np.testing.assert_allclose(logits, _eval(plain_model, _mesh(kind), batches[0]),
                               rtol=1e-5, atol=1e-5)


def _eval(model, mesh, batch):
    """The supported way to run user code on the model after a recovery: under
    ``jax.set_mesh(train_step.mesh)``, the batch placed on that mesh."""
    with jax.set_mesh(mesh):
        x = jax.device_put(batch["x"], jax.sharding.NamedSharding(mesh, P("data")))
        return np.asarray(nnx.jit(lambda m, x: m(x))(model, x))


class _FsdpByArrays(nnx.Module):
    """Parameters made as Flax's explicit-sharding guide makes them: the arrays carry
    their sharding (``out_sharding``), the ``nnx.Param``s no sharding metadata."""

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w1 = nnx.Param(jax.random.normal(k1, (h.DIN, h.DHIDDEN),
                                              out_sharding=P("fsdp", None)) * 0.1)
        self.w2 = nnx.Param(jax.random.normal(k2, (h.DHIDDEN, h.DOUT),
                                              out_sharding=P("fsdp", None)) * 0.1)

    def __call__(self, x):
        w1 = jax.sharding.reshard(self.w1[...], P(None, None))  # FSDP: gathered to use
        w2 = jax.sharding.reshard(self.w2[...], P(None, None))
        return nnx.relu(x @ w1) @ w2


def test_the_functional_idiom_keeps_array_shardings_and_guards_its_eval():
    """The Flax functional idiom (a user trial): ``graphdef, state = nnx.split((model,
    optimizer))``, a pure step ``step(state, batch) -> (state, metrics)`` over an Explicit
    ("data", "fsdp") mesh, parameters sharded by their arrays only. The FSDP layout was
    dropped (replicated silently; a mesh of one device per process failed on it), and
    ``guard`` of an eval taking that state raised IndexError (``nnx.state`` of a State
    of a tuple split). Both now as under ``jax.jit``."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[:8],
                         axis_types=(AxisType.Explicit, AxisType.Explicit))
    with jax.set_mesh(mesh):
        model = _FsdpByArrays(jax.random.key(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(classification_loss)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    def evaluate(state, batch):
        model, _ = nnx.merge(graphdef, state)
        return classification_loss(model, batch)

    train_step = mnemojax.resilient(step, mesh=mesh, options=h.no_precompile())
    batches = h.make_batches(2)
    for batch in batches:
        state, metrics = train_step(state, batch)
    assert state[0]["w1"][...].sharding.spec == P("fsdp", None)
    assert state[1]["opt_state"][0]["mu"]["w1"][...].sharding.spec == P("fsdp", None)
    guarded = train_step.guard(lambda state: jax.jit(evaluate)(
        state, train_step.place(batches[-1])))
    with jax.set_mesh(train_step.mesh):
        got = float(guarded(state))
        want = float(jax.jit(evaluate)(state, train_step.place(batches[-1])))
    assert got == want and np.isfinite(got)
    train_step.close()


def test_nnx_objects_whose_arrays_carry_the_sharding_keep_it():
    """The same parameters passed as NNX objects (model, optimizer): the spec comes from a
    variable's annotation, else from its array's `NamedSharding` (they were replicated)."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), devices=jax.devices()[:8],
                         axis_types=(AxisType.Explicit, AxisType.Explicit))
    with jax.set_mesh(mesh):
        model = _FsdpByArrays(jax.random.key(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    train_step = mnemojax.resilient(_train_step, mesh=mesh, options=h.no_precompile())
    train_step(model, optimizer, h.make_batches(1)[0])
    assert model.w1[...].sharding.spec == P("fsdp", None)
    assert optimizer.opt_state[0].mu["w1"][...].sharding.spec == P("fsdp", None)
    train_step.close()


class _NarrowHead(nnx.Module):
    """Flax's FSDP example's MLP: the head ``w2`` (32, 1) is annotated ``(None, 'model')``,
    which a 4-wide ``model`` axis cannot divide; JAX leaves it replicated."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (1, 32)), out_sharding=(None, "model"))
        self.w2 = nnx.Param(init(rngs.params(), (32, 1)), out_sharding=(None, "model"))

    def __call__(self, x):
        return nnx.relu(x @ self.w1) @ self.w2


def test_an_annotation_that_does_not_divide_keeps_the_layout_jax_gave(caplog):
    """Flax's FSDP example runs unchanged (a user trial: it was refused with
    ShardingMismatchError): a variable whose annotation does not divide its array over the
    mesh keeps the layout JAX gave that array, with a warning naming it; one step equals
    plain ``nnx.jit``'s (allclose: the batch is split here)."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8],
                         axis_types=(AxisType.Auto, AxisType.Auto))

    @nnx.jit
    def create():
        return _NarrowHead(nnx.Rngs(0))

    with jax.set_mesh(mesh):
        model, plain = create(), create()
    assert model.w2[...].sharding.spec == P() and model.w1[...].sharding.spec == P(None, "model")

    def step(model, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param),
                                       grads))
        return loss

    x = np.linspace(-2, 2, 32, dtype=np.float32)[:, None]
    y = 0.8 * x ** 2
    with caplog.at_level("WARNING", logger="mnemojax"):
        train_step = mnemojax.resilient(step, mesh=mesh, options=h.no_precompile())
        loss = train_step(model, x, y)
    with jax.set_mesh(mesh):
        want = nnx.jit(step)(plain, x, y)
    assert "model/w2: its sharding annotation P(None, 'model') does not " \
           "divide its shape (32, 1)" in caplog.text and "model/w1" not in caplog.text
    # (The batch is split over "data" here, not in the plain call: sums in another order.)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.w2[...]), np.asarray(plain.w2[...]),
                               atol=1e-6)
    assert model.w1[...].sharding.spec == P(None, "model")
    train_step.close()


def test_logical_names_read_after_their_rules_closed_keep_the_layout_the_rules_gave():
    """Flax's GSPMD guide: the model is made inside ``nnx.logical_axis_rules``, its
    variables annotated with logical names, and trained outside that block, where Flax
    returns those names unresolved. Each keeps the layout its array was given (as
    ``nnx.jit`` runs it; a user trial: refused, "names mesh axis 'hidden'"), and a step
    equals plain ``nnx.jit``'s."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8],
                         axis_types=(AxisType.Auto, AxisType.Auto))
    rules = (("embed", None), ("hidden", "model"))

    def make():
        init = nnx.initializers.lecun_normal()
        return nnx.Linear(h.DIN, h.DHIDDEN, rngs=nnx.Rngs(0),
                          kernel_init=nnx.with_partitioning(init, ("embed", "hidden")),
                          bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                          ("hidden",)))

    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        model, plain = make(), make()
    assert nnx.get_partition_spec(nnx.state(model))["kernel"].get_value() == P(
        "embed", "hidden")  # (unresolved out here)

    def step(model, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param),
                                       grads))
        return loss

    x = np.linspace(-1, 1, 8 * h.DIN, dtype=np.float32).reshape(8, h.DIN)
    train_step = mnemojax.resilient(step, mesh=mesh, options=h.no_precompile())
    loss = train_step(model, x)
    with jax.set_mesh(mesh):
        want = nnx.jit(step)(plain, x)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.kernel[...]), np.asarray(plain.kernel[...]),
                               atol=1e-6)
    assert model.kernel[...].sharding.spec == P(None, "model")
    assert model.bias[...].sharding.spec == P("model")
    train_step.close()


class _Vector(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((8,)))


@pytest.mark.parametrize("types", [(AxisType.Explicit, AxisType.Explicit),
                                   (AxisType.Explicit, AxisType.Auto)])
def test_a_step_that_reshards_its_state_on_explicit_axes_trains_and_is_checked(types):
    """A step on Explicit axes whose state leaf comes out in another layout than the
    state's (its own ``jax.sharding.reshard``; a user trial's minimal case) failed in the
    state's finiteness check (shard_map refused the layout); it now trains as ``nnx.jit``
    does (the leaf keeps the state's layout), and a NaN it makes in that leaf is still
    caught by the check (the loss stays finite)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8],
                         axis_types=types)

    def step(model, x):
        model.w[...] = jax.sharding.reshard(model.w[...] * x.mean(), P("data"))
        return {"loss": jnp.mean(jnp.nan_to_num(model.w[...]))}  # (finite: the state's check)

    x = np.full((8, 2), 2.0, np.float32)
    model, plain = _Vector(), _Vector()
    train_step = mnemojax.resilient(step, mesh=mesh, options=h.no_precompile())
    with jax.set_mesh(mesh):
        for _ in range(2):
            train_step(model, x)
            nnx.jit(step)(plain, x)
        np.testing.assert_array_equal(np.asarray(model.w[...]), np.asarray(plain.w[...]))
        with pytest.raises(mnemojax.errors.NonFiniteLossError):
            train_step(model, np.full((8, 2), np.nan, np.float32))
    train_step.close()
