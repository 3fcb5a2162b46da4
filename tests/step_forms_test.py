"""Step forms: nnx.jit's conventions over NNX objects and pure steps (traces, no compiles)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mnemojax
from mnemojax._src.errors import BatchSplitError, InvalidOptionError, UnsupportedStateError
from mnemojax._src.proxy import host_batch
from mnemojax._src.step_forms import Convention, NnxForm, PytreeForm, batch_splits, form_for
from tests import helpers as h


def _nnx_form():
    model, optimizer = h.make_mlp()
    return form_for(h.train_step, (model, optimizer, None)), model, optimizer


def test_nnx_form_reads_every_variable_and_writes_back_in_place():
    form, model, optimizer = _nnx_form()
    assert isinstance(form, NnxForm) and form.kind == "nnx"
    leaves = form.state_of((model, optimizer))
    assert len(leaves) == len(jax.tree.leaves(nnx.state((model, optimizer))))
    assert {"params", "opt_state", "other"} >= set(form.leaf_entries)
    assert {k[0] for k in form.leaf_keys} == {"model", "optimizer"}
    doubled = [x * 2 for x in leaves]
    assert form.result((model, optimizer), doubled, {"loss": 1.0}) == {"loss": 1.0}
    for got, want in zip(form.state_of((model, optimizer)), doubled, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert form.restored((model, optimizer), leaves, 7) == 7
    np.testing.assert_array_equal(np.asarray(form.state_of((model, optimizer))[0]),
                                  np.asarray(leaves[0]))


def test_nnx_form_pure_is_the_step_on_leaves():
    form, model, optimizer = _nnx_form()
    state_args, inputs = form.split_call((model, optimizer, h.make_batches(1)[0]))
    leaves = form.state_of(state_args)
    new, metrics = jax.jit(form.pure)(leaves, host_batch(inputs))
    assert np.isfinite(float(metrics["loss"]))
    assert len(new) == len(leaves)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(new, leaves, strict=True))
    # pure() does not touch the live model: it works on a merged copy.
    np.testing.assert_array_equal(np.asarray(form.state_of((model, optimizer))[0]),
                                  np.asarray(leaves[0]))


def test_nnx_form_rejects_another_model_and_a_call_that_lacks_one():
    form, model, optimizer = _nnx_form()
    other, other_opt = h.make_mlp(seed=1)
    with pytest.raises(UnsupportedStateError, match="another model"):
        form.state_of((other, other_opt))
    with pytest.raises(UnsupportedStateError, match="another model"):
        form.split_call((other, other_opt, h.make_batches(1)[0]))
    with pytest.raises(UnsupportedStateError, match="lacks optimizer"):
        form.split_call((model, None, h.make_batches(1)[0]))
    state_args, inputs = form.split_call((model, optimizer, h.make_batches(1)[0]))
    assert state_args == (model, optimizer) and inputs.layout.names == ("batch['x']",
                                                                          "batch['y']")


def test_nnx_form_forgets_its_device_arrays():
    form, model, optimizer = _nnx_form()
    structs = [(np.shape(x), x.dtype) for x in form.state_of((model, optimizer))]
    form.forget_arrays(structs)
    for x in form.state_of((model, optimizer)):
        assert isinstance(x, np.ndarray) and not x.any()


class _ArrayLeaves(nnx.Module):
    """Flax's array leaves (`nnx_toy_examples/07_array_leaves.py`): arrays an NNX object
    holds without a Variable, as attributes and in containers, beside a Param."""

    def __init__(self):
        self.count = jnp.array(0)
        self.w = jnp.ones((2, 3))
        self.items = nnx.List([jnp.zeros(3)])
        self.table = nnx.Dict(b=jnp.zeros(3))
        self.plain = nnx.data({"c": jnp.zeros(3)})
        self.p = nnx.Param(jnp.ones(3))


def _counting_step(m, batch):
    m.count += 1
    m.w = m.w * 2.0


def test_arrays_held_without_variables_are_state_written_back_in_place():
    m = _ArrayLeaves()
    form = form_for(_counting_step, (m, None))
    assert sorted(form.leaf_paths) == ["m/count", "m/items/0", "m/p", "m/plain/c",
                                       "m/table/b", "m/w"]
    leaves = form.state_of((m,))
    form.result((m,), [x + 1 for x in leaves], None)
    assert int(m.count) == 1 and float(m.w[0, 0]) == 2.0 and float(m.p[0]) == 2.0
    assert float(m.items[0][0]) == float(m.table["b"][0]) == float(m.plain["c"][0]) == 1.0
    assert form.untouched()  # (what it wrote is what the objects hold)
    state_args, inputs = form.split_call((m, None))
    new, _ = form.pure(form.state_of(state_args), host_batch(inputs))
    assert int(new[form.leaf_paths.index("m/count")]) == 2  # the step ran on them
    form.forget_arrays([(np.shape(x), x.dtype) for x in leaves])
    assert all(isinstance(x, np.ndarray) and not x.any() for x in form.state_of((m,)))


def test_numbers_held_as_state_become_arrays_and_numpy_stays_on_the_host():
    """``nnx.Variable(0)`` and ``nnx.Variable(1.5)`` are state, held as 0-d JAX arrays of
    JAX's dtype for them from the build on (strongly typed, as the compiled step sees
    them); numpy arrays (in a Variable or as a plain attribute) stay numpy until the step
    places them."""
    class Counted(nnx.Module):
        def __init__(self):
            self.calls = nnx.Variable(0)
            self.scale = nnx.Variable(1.5)
            self.table = nnx.Variable(np.arange(3.0, dtype=np.float32))
            self.raw = np.ones(2, np.float32)

    m = Counted()
    form = form_for(_counting_step, (m, None))
    assert sorted(form.leaf_paths) == ["m/calls", "m/raw", "m/scale", "m/table"]
    calls, scale = m.calls.get_raw_value(), m.scale.get_raw_value()
    assert isinstance(calls, jax.Array) and calls.dtype == jnp.int32 and not calls.weak_type
    assert scale.dtype == jnp.float32 and not scale.weak_type and float(scale) == 1.5
    assert isinstance(m.table.get_raw_value(), np.ndarray) and isinstance(m.raw, np.ndarray)


def test_an_object_of_arrays_the_step_does_not_carry_is_named_for_the_warning():
    """Guarded work warns of NNX objects whose arrays the step does not carry: array
    leaves count as Variables do (`uncarried_objects`)."""
    m = _ArrayLeaves()
    form = form_for(_counting_step, (m, None))
    assert form.uncarried_objects((m, m.items)) == []
    assert form.uncarried_objects((_ArrayLeaves(),)) == ["_ArrayLeaves"]

    class OnlyArrays(nnx.Module):
        def __init__(self):
            self.w = jnp.ones(2)

    assert form.uncarried_objects((OnlyArrays(),)) == ["OnlyArrays"]


def test_a_train_state_holding_nnx_states_is_a_pure_state():
    """Flax's `03_train_state`: a Linen `TrainState` whose fields are `nnx.State`s (their
    leaves Variables) and a graphdef is the pure form's state, not NNX objects changed in
    place; NNX objects elsewhere in the call still select the NNX form."""
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        counts: nnx.State
        graphdef: nnx.GraphDef

    model, optimizer = h.make_mlp()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = TrainState.create(apply_fn=None, graphdef=graphdef, params=params,
                              tx=optax.sgd(0.1), counts=rest)

    def step(state, batch):
        return state, {}

    assert form_for(step, (state, None)).kind == "pytree"
    assert form_for(step, (), {"state": state, "batch": None}).kind == "pytree"
    with pytest.raises(UnsupportedStateError, match=r"pure state .*\(MLP\)"):
        form_for(step, (state, model))  # (carried in place beside a pure state: refused)


def test_an_array_that_cannot_be_written_in_place_is_refused_naming_it():
    class InATuple(nnx.Module):
        def __init__(self):
            self.pair = nnx.data((jnp.ones(1), jnp.ones(2)))

    with pytest.raises(UnsupportedStateError, match=r"m/pair/0 is held inside a tuple"):
        form_for(_counting_step, (InATuple(), None))


def test_a_variable_holding_several_arrays_is_refused_naming_it():
    """What ``sow`` leaves in an Intermediate (a tuple of what it was given): a typed error naming the variable and the way out (a user trial met "could not read
    one partition spec per state leaf (11 specs for 12 leaves)")."""
    class Sown(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))
            self.seen = nnx.Intermediate((jnp.zeros(2), jnp.ones(2)))

    with pytest.raises(UnsupportedStateError,
                       match=r"variable m/seen holds a tuple of 2 arrays .*nnx.pop"):
        form_for(_counting_step, (Sown(), None))


def test_hijax_variables_are_refused_naming_one():
    """Flax's experimental hijax variables (its ``hijax_basic`` example): Flax cannot read
    their partition specs, so the step failed with a TypeError from inside Flax (a user
    trial); now a typed error naming a variable."""
    with nnx.var_defaults(hijax=True):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(UnsupportedStateError, match=r"variable m/\w+ is a hijax variable"):
        form_for(_counting_step, (model, None))


def test_clones_remembered_stay_few_when_each_call_merges_the_model_anew():
    """A loop that merges its model anew each call (``nnx.merge(graphdef, state)``: the
    same Variables, a new object) makes a clone per call; the form remembers the newest
    few (it kept every one: memory grew with the step count, a review finding)."""
    model, optimizer = h.make_mlp()
    form = form_for(h.train_step, (model, optimizer, None))
    graphdef, state = nnx.split(model)
    batch = h.make_batches(1)[0]
    for _ in range(20):
        clone = nnx.merge(graphdef, state, copy=False)
        form.split_call((clone, optimizer, batch))
    assert len(form._aliases) <= 3 and len(form._found) <= 3 + len(form.objects)
    form.split_call((model, optimizer, batch))  # (the objects themselves still)


def test_typed_prng_keys_travel_as_raw_key_data():
    model, _ = h.make_mlp(dropout=0.5)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    form = form_for(h.train_step, (model, optimizer, None))
    leaves = form.state_of((model, optimizer))
    assert all(not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in leaves)
    assert any(impl is not None for impl in form.key_impls)
    form.result((model, optimizer), leaves, None)  # wraps the raw data back into keys
    keys = [v for v in jax.tree.leaves(nnx.state(model, nnx.RngKey))]
    assert keys and all(jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) for k in keys)


def _gemma_like():
    """NNX objects anywhere: positional, keyword, nested; numbers and statics."""
    model, optimizer = h.make_mlp()
    rngs = nnx.Rngs(dropout=3)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))

    def step(model, optimizer, rngs, batch, metrics, scale, pad_id, *, extra):
        key = rngs.dropout()
        loss, grads = nnx.value_and_grad(h.loss_fn)(model, batch)
        optimizer.update(model, grads)
        metrics.update(loss=loss)
        noise = jax.random.uniform(key, ())
        return {"loss": loss * scale + pad_id + extra["offset"] + 0 * noise,
                "scale_dtype": jnp.zeros((), jnp.bfloat16) * scale, "model": model}

    return step, model, optimizer, rngs, metrics


def test_nnx_objects_anywhere_are_state_and_numbers_are_weakly_typed_inputs():
    step, model, optimizer, rngs, metrics = _gemma_like()
    conv = Convention(step, static_argnames=("pad_id",))
    batch = h.make_batches(1)[0]
    args = (model, optimizer, rngs, batch, metrics, 0.5, 2)
    kwargs = {"extra": {"offset": np.float32(1.0)}}
    form = form_for(step, args, kwargs, conv)
    assert [n for n in form.object_names] == ["model", "optimizer", "rngs", "metrics"]
    assert ("rngs", "dropout", "count") in form.leaf_keys
    state_args, inputs = form.split_call(args, kwargs)
    assert inputs.layout.names == ("batch['x']", "batch['y']", "scale",
                                   "extra['offset']")
    assert inputs.layout.statics == ((6, 2),) and inputs.layout.weak == (False, False, True,
                                                                         False)
    host = host_batch(inputs)
    assert host.leaves[2].dtype == np.float32  # a Python float: float32, weakly typed
    leaves = form.state_of(state_args)
    new, out = jax.jit(form.pure)(leaves, host)
    assert out["scale_dtype"].dtype == jnp.bfloat16  # 0.5 stayed weak, as under nnx.jit
    count = form.leaf_keys.index(("rngs", "dropout", "count"))
    assert int(new[count]) == int(leaves[count]) + 1  # the Rngs counter is state
    # A carried object returned by the step comes back as the caller's own.
    got = form.result(state_args, new, out)
    assert got["model"] is model
    assert int(rngs.dropout.count.get_value()) == 1
    np.testing.assert_allclose(float(got["loss"]), float(out["loss"]))
    # Another static value is another layout (another compile), the same otherwise.
    assert form.split_call(args, kwargs)[1].layout is inputs.layout
    other = form.split_call((*args[:6], 3), kwargs)[1].layout
    assert other != inputs.layout and other.statics == ((6, 3),)


def test_inputs_are_checked_by_name():
    step, model, optimizer, rngs, metrics = _gemma_like()
    form = form_for(step, (model, optimizer, rngs, h.make_batches(1)[0], metrics, 0.5, 0),
                    {"extra": {"offset": 1.0}})
    batch = h.make_batches(1)[0]
    with pytest.raises(BatchSplitError, match=r"batch\['x'\] has 24 examples and input "
                                              r"extra\['offset'\] has 2"):
        form.split_call((model, optimizer, rngs, batch, metrics, 0.5, 0),
                        {"extra": {"offset": np.zeros(2, np.float32)}})
    with pytest.raises(UnsupportedStateError, match=r"input extra\['offset'\] is a str .*"
                                                    "static_argnames"):
        form.split_call((model, optimizer, rngs, batch, metrics, 0.5, 0),
                        {"extra": {"offset": "one"}})
    with pytest.raises(BatchSplitError, match=r"offset'\] has 2: .*replicated_argnames"):
        form.split_call((model, optimizer, rngs, batch, metrics, 0.5, 0),
                        {"extra": {"offset": np.zeros(2, np.float32)}})
    conv = Convention(step, static_argnums=(6,))
    form = form_for(step, (model, optimizer, rngs, batch, metrics, 0.5, 0),
                    {"extra": {"offset": 1.0}}, conv)
    with pytest.raises(UnsupportedStateError, match="static argument 'pad_id' is a list"):
        form.split_call((model, optimizer, rngs, batch, metrics, 0.5, [0]),
                        {"extra": {"offset": 1.0}})
    with pytest.raises(UnsupportedStateError, match=r"step\(model, optimizer, .*missing"):
        form_for(step, (model, optimizer, rngs, batch))


def test_convention_resolves_names_and_positions_like_jax_jit():
    def step(model, optimizer, batch, label_smoothing, pad_id=0):
        return None

    conv = Convention(step, static_argnames=("pad_id",), donate_argnums=(0, 1))
    assert conv.static_argnums == {4} and conv.static_argnames == {"pad_id"}
    assert conv.donate_argnames == {"model", "optimizer"} and conv.donated("optimizer")
    assert Convention(step, static_argnums=-1).static_argnames == {"pad_id"}
    with pytest.raises(InvalidOptionError, match="no parameter 'pad'.*pad_id"):
        Convention(step, static_argnames=("pad",))
    with pytest.raises(InvalidOptionError, match="5 positional arguments, so 7"):
        Convention(step, donate_argnums=7)
    with pytest.raises(InvalidOptionError, match="expected an int"):
        Convention(step, static_argnums="pad_id")


@pytest.mark.parametrize("jit", [jax.jit, nnx.jit,
                                 functools.partial(nnx.jit, static_argnames="batch")])
def test_a_jitted_step_is_refused_naming_the_fix(jit):
    with pytest.raises(InvalidOptionError, match=r"already jitted .*mlp_train_step.__wrapped__"):
        mnemojax.resilient(jit(h.train_step))
    with pytest.raises(InvalidOptionError, match="already jitted"):
        mnemojax.resilient(mesh=None)(jit(h.train_step))


def test_closing_over_mutated_nnx_state_names_the_object_and_the_fix():
    model, optimizer = h.make_mlp()
    rngs = nnx.Rngs(dropout=0)

    def step(model, optimizer, batch):
        key = rngs.dropout()  # mutates an Rngs the step closes over
        return {"loss": jax.random.uniform(key, ())}

    form = form_for(step, (model, optimizer, None))
    state_args, inputs = form.split_call((model, optimizer, h.make_batches(1)[0]))
    with pytest.raises(UnsupportedStateError,
                       match=r"step closes over rngs \(an flax.Rngs\).*pass rngs to the step"):
        jax.eval_shape(form.pure, form.state_of(state_args), host_batch(inputs))

    def nested(model, optimizer, rngs, batch):
        def loss_fn(model):  # closes over rngs inside an inner transform
            return jnp.mean(model(batch["x"])) * jax.random.uniform(rngs.dropout(), ())

        return {"loss": nnx.grad(loss_fn)(model)}

    form = form_for(nested, (model, optimizer, rngs, None))
    state_args, inputs = form.split_call((model, optimizer, rngs, h.make_batches(1)[0]))
    with pytest.raises(UnsupportedStateError, match=r"inner nnx transform"):
        jax.eval_shape(form.pure, form.state_of(state_args), host_batch(inputs))


def test_a_step_that_changes_its_state_structure_is_told_to_pop_intermediates():
    model, optimizer = h.make_mlp()

    def step(model, optimizer, batch):
        model.h = nnx.Intermediate(jnp.mean(batch["x"]))
        return {}

    form = form_for(step, (model, optimizer, None))
    state_args, inputs = form.split_call((model, optimizer, h.make_batches(1)[0]))
    with pytest.raises(UnsupportedStateError, match=r"added \['model/h'\].*nnx.pop"):
        jax.eval_shape(form.pure, form.state_of(state_args), host_batch(inputs))


def test_pytree_form_round_trips_state_and_checks_it():
    state = {"w": jnp.ones((4, 2)), "n": jnp.zeros((), jnp.int32), "key": jax.random.key(0)}

    def step(s, batch):
        return {**s, "w": s["w"] + batch, "n": s["n"] + 1}, {"loss": jnp.sum(s["w"])}

    form = form_for(step, (state, 1.0))
    assert isinstance(form, PytreeForm)
    state_args, inputs = form.split_call((state, 1.0))
    leaves = form.state_of(state_args)
    new, metrics = form.pure(leaves, host_batch(inputs))
    out_state, out_metrics = form.result(state_args, new, metrics)
    assert int(out_state["n"]) == 1 and float(out_metrics["loss"]) == 8.0
    assert jax.dtypes.issubdtype(out_state["key"].dtype, jax.dtypes.prng_key)
    restored, k = form.restored(form.split_restore((state,), {}), leaves, 3)
    assert k == 3 and float(restored["w"][0, 0]) == 1.0
    with pytest.raises(UnsupportedStateError, match="has 1 leaves"):
        form.state_of(({"w": jnp.ones(2)},))
    # The state by keyword, the input by keyword.
    form = form_for(step, (), {"s": state, "batch": 1.0})
    assert form.split_call((), {"s": state, "batch": 2.0})[0][0] is state


def test_pytree_form_takes_python_numbers_in_the_state():
    state = {"w": jnp.ones(2), "step": 0}  # a fresh TrainState's step is an int
    form = form_for(lambda s, b: (s, {}), (state, None))
    leaves = form.state_of((state,))
    assert leaves[0].dtype == np.int32 and form.leaf_paths == ["step", "w"]


def test_pytree_form_rejects_bad_states_and_returns():
    with pytest.raises(UnsupportedStateError, match="pytree of arrays"):
        form_for(lambda s, b: (s, {}), ({"name": "not an array"}, None))

    def pure(form, state):
        args, inputs = form.split_call((state, None))
        return form.pure(form.state_of(args), inputs)

    form = form_for(lambda s, b: [s], ({"w": jnp.ones(2)}, None))
    with pytest.raises(UnsupportedStateError, match=r"returns \(state, out\) or the state; "
                                                    "it returned list"):
        pure(form, {"w": jnp.ones(2)})
    form = form_for(lambda s, b: ({"v": s["w"]}, {}), ({"w": jnp.ones(2)}, None))
    with pytest.raises(UnsupportedStateError, match="another structure"):
        pure(form, {"w": jnp.ones(2)})


def test_form_for_names_the_supported_signatures():
    with pytest.raises(UnsupportedStateError, match="NNX objects .* its state as first"):
        form_for(lambda *a: None, ())


def test_a_pure_step_may_return_its_state_alone():
    """The Flax dropout guide's ``train_step(state, batch, dropout_key) -> state``."""
    state = {"w": jnp.ones(2), "n": jnp.zeros((), jnp.int32)}

    def step(s, batch):
        return {"w": s["w"] + batch, "n": s["n"] + 1}

    form = form_for(step, (state, None))
    args, inputs = form.split_call((state, np.float32(2.0)))
    new, out = form.pure(form.state_of(args), host_batch(inputs))
    assert out is None
    got = form.result(args, new, out)
    assert isinstance(got, dict) and int(got["n"]) == 1
    np.testing.assert_array_equal(np.asarray(got["w"]), [3.0, 3.0])


def _key_step(s, batch, key, table):
    noise = jax.random.normal(key, s["w"].shape)
    return {"w": s["w"] + jnp.mean(batch["x"]) * noise + table[0]}, {"noise": noise}


def test_prng_keys_and_named_arguments_are_replicated_inputs_and_keys_are_wrapped_again():
    state = {"w": jnp.zeros(3)}
    batch = {"x": np.ones((8, 2), np.float32)}
    conv = Convention(_key_step, replicated_argnames=("table",))
    key = jax.random.key(5)
    args = (state, batch, key, np.arange(4, dtype=np.float32))
    form = form_for(_key_step, args, None, conv)
    state_args, inputs = form.split_call(args)
    layout = inputs.layout
    assert layout.names == ("batch['x']", "key", "table")
    assert layout.replicated == (False, True, True)
    assert layout.key_impls[0] is None and layout.key_impls[2] is None
    assert layout.key_impls[1] == jax.random.key_impl(key)
    # The key travels as its raw data (a plain array on the host); the step gets a key.
    np.testing.assert_array_equal(inputs.leaves[1], np.asarray(jax.random.key_data(key)))
    assert jax.tree.leaves(batch_splits(inputs)) == [True, False, False]
    new, out = jax.jit(form.pure)(form.state_of(state_args), host_batch(inputs))
    np.testing.assert_allclose(np.asarray(out["noise"]),
                               np.asarray(jax.random.normal(key, (3,))), rtol=1e-6)
    # A typed key with a leading dimension is per-example, part of the batch (a fresh
    # form: no layout cached from the 0-d key's call).
    keys = jax.random.split(key, 8)
    fresh = form_for(_key_step, args, None, conv)
    per_example = fresh.split_call((state, batch, keys, args[3]))[1].layout
    assert per_example.replicated == (False, False, True)
    with pytest.raises(BatchSplitError, match="and input key has 4"):
        fresh.split_call((state, batch, jax.random.split(key, 4), args[3]))
    # Another impl is another layout.
    rbg = jax.random.key(5, impl="rbg")
    other = form.split_call((state, batch, rbg, args[3]))[1].layout
    assert other != layout and other.key_impls[1] == jax.random.key_impl(rbg)
    # Unnamed, a raw key (uint32[2]) is part of the batch: the sizes disagree.
    plain = form_for(_key_step, args)
    with pytest.raises(BatchSplitError, match="and input key has 2: .*replicated_argnames"):
        plain.split_call((state, batch, jax.random.key_data(key), np.zeros(8, np.float32)))


def test_an_input_that_turns_0_d_or_back_is_laid_out_again():
    def step(s, batch, w):
        return s, {"loss": jnp.sum(batch) + jnp.sum(w)}

    state = {"a": jnp.zeros(2)}
    form = form_for(step, (state, None, None))
    split = form.split_call((state, np.ones(8), np.ones(8)))[1].layout
    whole = form.split_call((state, np.ones(8), np.float32(2.0)))[1].layout
    assert split.replicated == (False, False) and whole.replicated == (False, True)
    assert form.split_call((state, np.ones(8), np.ones(8)))[1].layout is split
    with pytest.raises(BatchSplitError, match="input batch has 8 examples and input w has 3"):
        form.split_call((state, np.ones(8), np.ones(3)))


def test_a_replicated_argument_that_holds_the_state_is_refused():
    state = {"w": jnp.zeros(3)}
    batch = {"x": np.ones((8, 2), np.float32)}
    args = (state, batch, jax.random.key(0), np.zeros(2, np.float32))
    conv = Convention(_key_step, replicated_argnames=("s", "table"))
    with pytest.raises(InvalidOptionError, match="replicated argument 's' holds the step's "
                                                 "state"):
        form_for(_key_step, args, None, conv).split_call(args)


def test_an_argument_both_static_and_replicated_is_refused():
    with pytest.raises(InvalidOptionError, match="'table' of _key_step is both static and "
                                                 "replicated"):
        Convention(_key_step, static_argnames="table", replicated_argnums=3)
    with pytest.raises(InvalidOptionError, match="replicated_argnames=.*no parameter 'tabel'"):
        Convention(_key_step, replicated_argnames="tabel")


class _Parts(nnx.Module):
    """The containers a Flax model holds submodules in, and state that is no Variable."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
        self.named = nnx.Dict({"a": nnx.Linear(4, 4, rngs=rngs)})
        self.plain = nnx.data([nnx.Linear(4, 4, rngs=rngs)])
        self.seq = nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.relu)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.arr = jnp.zeros(3)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.drop(self.bn(self.seq(self.named["a"](x) + self.plain[0](x))))


def test_the_graph_check_sees_replaced_parts_and_not_what_training_loops_do():
    """`NnxForm.changed_in_place` (model surgery between steps was silently ignored, a
    user trial): a submodule or Variable replaced anywhere is seen, and a change of
    structure refused; what ordinary loops do between steps is not a change: an nnx.jit
    step or eval (it rebuilds pytree containers and sets attributes again in another
    order), model.eval() then model.train(), a metrics reset, a reseed, an array leaf
    set anew."""
    model = _Parts(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    form = NnxForm(h.train_step, model, optimizer, metrics,
                   names=["model", "optimizer", "metrics"])

    @nnx.jit
    def train(model, optimizer, metrics, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss)

    train(model, optimizer, metrics, jnp.ones((2, 4)))
    nnx.jit(lambda m, x: m(x))(model, jnp.ones((2, 4)))
    model.eval()
    model.train()
    metrics.reset()
    nnx.reseed(model, dropout=3)
    model.arr = jnp.ones(3)
    assert form._fingerprint.same()  # (the per-call check alone: no nnx.split needed)
    assert form.changed_in_place() is None
    for replace, path in [
            (lambda: model.layers.__setitem__(1, nnx.Linear(4, 4, rngs=nnx.Rngs(1))),
             "model/layers/1/kernel"),
            (lambda: model.named.__setitem__("a", nnx.Linear(4, 4, rngs=nnx.Rngs(1))),
             "model/named/a/kernel"),
            (lambda: model.plain.__setitem__(0, nnx.Linear(4, 4, rngs=nnx.Rngs(1))),
             "model/plain/0/kernel"),
            (lambda: setattr(model.bn, "scale", nnx.Param(jnp.ones(4))), "model/bn/scale")]:
        replace()
        replaced = form.changed_in_place()
        assert replaced is not None and path in replaced, (path, replaced)
        form.rebind()
        assert form.changed_in_place() is None
    model.eval()  # a static attribute set anew: another structure
    with pytest.raises(UnsupportedStateError, match=r"structure of model, optimizer, metrics "
                                                    r"changed since this step was built \(model"
                                                    r"/\w+/(deterministic|use_running_average)"
                                                    r": False -> True.*model.eval\(\)"):
        form.changed_in_place()
    model.train()
    assert form.changed_in_place() is None


def test_a_hyperparameter_replaced_in_the_optimizers_state_is_seen():
    """optax's idiom ``opt_state.hyperparams['learning_rate'] = x`` replaces the Variable
    the step carries (`nnx.jit` traces again and uses the new value): it was silently
    ignored, the step training on with the old rate (a user trial). A plain value there is
    another structure, refused naming the in-place form; a value set in place, or a new
    Variable of the same kind, is carried."""
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    form = NnxForm(h.train_step, model, optimizer, names=["model", "optimizer"])
    hyperparams = optimizer.opt_state[1].hyperparams
    lr = hyperparams["learning_rate"]
    lr[...] = 1e-3  # in place: the same Variable, read at the next call
    assert form.changed_in_place() is None
    hyperparams["learning_rate"] = type(lr)(jnp.asarray(1e-4))  # a new Variable
    assert form.changed_in_place() == ["optimizer/opt_state/1/hyperparams/learning_rate"]
    form.rebind()
    assert form.changed_in_place() is None
    hyperparams["learning_rate"] = jnp.asarray(1e-5)  # a plain array: another structure
    with pytest.raises(UnsupportedStateError, match=r"\(optimizer/opt_state/\S+/hyperparams/"
                                                    r"learning_rate replaced\).*"
                                                    r"hyperparams\['learning_rate'\]\[...\]"):
        form.changed_in_place()


def test_values_changed_since_the_step_are_told_from_equal_copies_written_back():
    """What a recovery across processes undoes (`NnxForm.replaced_since_written`, said in
    a warning): a leaf given other values since the step wrote it (a metrics reset); not
    one an nnx.jit call wrote back as an equal copy (a review saw every leaf named)."""
    form, model, optimizer = _nnx_form()
    leaves = form.state_of((model, optimizer))
    form.result((model, optimizer), leaves, None)  # as the step writes its new state
    assert form.replaced_since_written() == []
    nnx.jit(lambda m, x: m(x))(model, jnp.ones((2, h.DIN)))  # writes equal copies back
    model.l1.bias.set_value(jnp.copy(model.l1.bias.get_value()))
    assert form.replaced_since_written() == []
    model.l2.kernel.set_value(model.l2.kernel.get_value() + 1.0)
    assert form.replaced_since_written() == ["model/l2/kernel"]


def test_a_submodule_made_on_the_mesh_for_a_model_built_off_it_is_the_same_structure():
    """The README builds the model under ``nnx.use_eager_sharding(False)``; a submodule
    made later inside ``jax.set_mesh`` differs only in that flag of its variables' metadata
    (nothing a compiled step computes): it is carried, not refused as another structure
    (a user trial; ``nnx.jit`` takes it). An added variable is named as added."""
    model, optimizer = h.make_mlp()  # (built under nnx.use_eager_sharding(False))
    form = NnxForm(h.train_step, model, optimizer)
    with jax.set_mesh(h.mesh_of((4, 2))):  # made as the MLP does, eager sharding on
        model.l2 = nnx.Linear(h.DHIDDEN, h.DOUT, rngs=nnx.Rngs(1), kernel_init=(
            nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None))))
    assert form.changed_in_place() == ["model/l2/bias", "model/l2/kernel"]
    form.rebind(["model/l2/bias", "model/l2/kernel"])
    # what a recovery across processes before the next step's commit undoes, and says
    assert form.replaced_since_written() == ["model/l2/bias", "model/l2/kernel"]
    form.result((model, optimizer), form.state_of((model, optimizer)), None)
    assert form.replaced_since_written() == []
    form.adopt((h.make_mlp(seed=2)[0], optimizer))  # another model passed in its place
    assert form.replaced_since_written() == [p for p in form.leaf_paths
                                             if p.startswith("model/")]
    model = form.objects[0]
    model.extra = nnx.Param(jnp.zeros(3))
    with pytest.raises(UnsupportedStateError, match=r"\(model/extra added\)"):
        form.changed_in_place()


class _WithEmpty(nnx.Module):
    """A model with variables holding no array (a cache filled lazily, optax's MaskedNode
    in an optimizer's state): not carried, rebuilt as they are."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((8,)))
        self.c = nnx.Variable(None)
        self.e = nnx.Variable(jnp.zeros((8,)))


def test_a_variable_given_an_array_or_none_between_steps_is_refused_not_ignored():
    """A variable holding None given an array between steps was silently ignored (the
    step rebuilt it as None: 24 where nnx.jit gives 48), and one swap with another
    failed with a raw error (a review): both are another structure, refused naming the
    variables; a carried variable set to None is refused naming it."""
    model = _WithEmpty()
    form = NnxForm(lambda m, x: None, model, names=["model"])
    assert form.leaf_paths == ["model/e", "model/w"]
    model.c.set_value(jnp.full((8,), 3.0))
    with pytest.raises(UnsupportedStateError, match=r"\(model/c holds an array now\)"):
        form.changed_in_place()
    model.e.set_value(None)  # (with c given an array: a swap)
    with pytest.raises(UnsupportedStateError,
                       match=r"model/c holds an array now, model/e holds none now"):
        form.changed_in_place()
    model.c.set_value(None)  # (only e set to None: the graph check sees no change)
    with pytest.raises(UnsupportedStateError, match=r"model/e held an array .* holds None now"):
        form.state_of((model,))
    # Another object passed in place, with the swap: not taken as the same structure (it
    # reached `adopt`'s assertion before).
    form = NnxForm(lambda m, x: None, _WithEmpty(), names=["model"])
    other = _WithEmpty()
    other.c.set_value(jnp.zeros((8,)))
    other.e.set_value(None)
    assert form.replacements((other, np.ones(8)), {}) is None
    assert form.replacements((_WithEmpty(), np.ones(8)), {}) is not None


def test_a_step_that_swaps_which_variables_hold_arrays_is_refused():
    # (the count of arrays is the same: values would have gone to the other variable)
    def swap(model, x):
        model.c.set_value(model.e.get_value() + x)
        model.e.set_value(None)
        return {"loss": jnp.sum(model.w[...])}

    step = mnemojax.resilient(swap, mesh=h.mesh_of((4, 2)), options=h.no_precompile())
    try:
        with pytest.raises(UnsupportedStateError, match=r"added \['model/c'\], removed "
                                                        r"\['model/e'\]"):
            step(_WithEmpty(), np.ones((8,), np.float32))
    finally:
        step.close()


def test_equal_typed_keys_read_as_equal_values_and_other_keys_do_not():
    """Across processes a recovery names the state leaves changed outside the step by
    comparing this process's shards (`_same_local_values`). Typed PRNG keys (a dropout
    stream's ``rngs.key``, written back equal by an ``nnx.jit`` eval) were always "unsure",
    so named as changed: the warning said the dropout stream may have been rewound (a user
    trial). They are compared by their data and impl."""
    import time

    from mnemojax._src.step_forms import _same_local_values

    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8),
                          jax.sharding.NamedSharding(mesh, jax.P("data")))
    deadline = time.monotonic() + 10
    assert _same_local_values(keys, jax.random.wrap_key_data(jax.random.key_data(keys) + 0),
                              deadline)
    other = jax.random.wrap_key_data(jax.random.key_data(keys).at[3, 0].add(1))
    assert not _same_local_values(keys, other, deadline)
    rbg = jax.random.split(jax.random.key(0, impl="rbg"), 8)  # (another impl, other data)
    assert not _same_local_values(keys, rbg, deadline)
    assert not _same_local_values(keys, jax.random.key_data(keys), deadline)


def _k_updates(model, optimizer, stack):
    """K updates in one call, over a stack of K micro-batches (K, B, ...) (MaxText's and
    T5X's steps per loop)."""
    out = None
    for k in range(stack["x"].shape[0]):
        out = h.train_step(model, optimizer, {"x": stack["x"][k], "y": stack["y"][k]})
    return out


def _stacks(batches, k):
    return [{name: np.stack([b[name] for b in batches[i:i + k]]) for name in ("x", "y")}
            for i in range(0, len(batches), k)]


def test_a_stack_of_micro_batches_is_split_along_the_example_axis_it_is_given():
    """``example_axes={"stack": 1}``: each (K, B, ...) input is split along B over the data
    axis (the plain run of the 12 micro-batches in order is the reference), also through a
    device loss; without it, K = 4 is taken for the examples and refused on a data axis of
    width 8, the message naming example_axes."""
    batches = h.make_batches(12)
    with pytest.raises(BatchSplitError, match=r"example_axes=\{name: 1\}"):
        step = mnemojax.resilient(_k_updates, mesh=h.mesh_of((8, 1)),
                                  options=h.no_precompile())
        try:
            step(*h.make_mlp(), stack=_stacks(batches, 4)[0])
        finally:
            step.close()
    model, optimizer = h.make_mlp()
    faults = mnemojax.testing.FaultInjector().lose_devices(2, [3])
    step = mnemojax.resilient(_k_updates, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=faults, example_axes={"stack": 1})
    try:
        for stack in _stacks(batches, 4):
            step(model, optimizer, stack=stack)
        stats = step.statistics
    finally:
        step.close()
    [rec] = stats.recoveries
    assert rec.examples_per_step == h.BATCH, rec  # the micro-batch's, not K
    for got, want in zip(h.host_state(model, optimizer), h.reference_run(batches).state,
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_example_axes_naming_a_static_argument_or_an_axis_an_input_lacks_is_refused():
    with pytest.raises(InvalidOptionError, match="static or replicated"):
        Convention(_k_updates, static_argnames=("stack",), example_axes={"stack": 1})
    with pytest.raises(InvalidOptionError, match="has no parameter 'batch'"):
        Convention(_k_updates, example_axes={"batch": 1})
    with pytest.raises(InvalidOptionError, match="axes >= 0"):
        Convention(_k_updates, example_axes={"stack": -1})
    args = (*h.make_mlp(), {"x": np.zeros((4,), np.float32)})
    form = form_for(_k_updates, args, None, Convention(_k_updates, example_axes={2: 1}))
    with pytest.raises(BatchSplitError, match=r"shape \(4,\), which has no example axis 1"):
        form.split_call(args)
