"""Step forms: one interface over the NNX and the pure step (no compiles here)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mnemojax._src.errors import UnsupportedStateError
from mnemojax._src.step_forms import NnxForm, PytreeForm, form_for
from tests import helpers as h


def _nnx_form():
    model, optimizer = h.make_mlp()
    return form_for(h.train_step, (model, optimizer, None)), model, optimizer


def test_nnx_form_reads_every_variable_and_writes_back_in_place():
    form, model, optimizer = _nnx_form()
    assert isinstance(form, NnxForm) and form.kind == "nnx" and form.arity == 3
    leaves = form.state_of((model, optimizer))
    assert len(leaves) == len(jax.tree.leaves(nnx.state((model, optimizer))))
    assert {"params", "opt_state", "other"} >= set(form.leaf_entries)
    assert form.leaf_keys[0][0] in ("model", "optimizer")
    doubled = [x * 2 for x in leaves]
    assert form.result((model, optimizer), doubled, {"loss": 1.0}) == {"loss": 1.0}
    for got, want in zip(form.state_of((model, optimizer)), doubled, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert form.restored((model, optimizer), leaves, 7) == 7
    np.testing.assert_array_equal(np.asarray(form.state_of((model, optimizer))[0]),
                                  np.asarray(leaves[0]))


def test_nnx_form_pure_is_the_step_on_leaves():
    form, model, optimizer = _nnx_form()
    leaves = form.state_of((model, optimizer))
    batch = h.make_batches(1)[0]
    new, metrics = form.pure(leaves, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert len(new) == len(leaves)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(new, leaves, strict=True))
    # pure() does not touch the live model: it works on a merged copy.
    np.testing.assert_array_equal(np.asarray(form.state_of((model, optimizer))[0]),
                                  np.asarray(leaves[0]))


def test_nnx_form_rejects_another_model_and_wrong_arity():
    form, model, optimizer = _nnx_form()
    other, other_opt = h.make_mlp(seed=1)
    with pytest.raises(UnsupportedStateError, match="another model"):
        form.state_of((other, other_opt))
    with pytest.raises(UnsupportedStateError, match=r"step\(model, optimizer, batch\)"):
        form.split_call((model, None))
    assert form.split_call((model, optimizer, "b")) == ((model, optimizer), "b")


def test_nnx_form_forgets_its_device_arrays():
    form, model, optimizer = _nnx_form()
    structs = [(np.shape(x), x.dtype) for x in form.state_of((model, optimizer))]
    form.forget_arrays(structs)
    for x in form.state_of((model, optimizer)):
        assert isinstance(x, np.ndarray) and not x.any()


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


def test_pytree_form_round_trips_state_and_checks_it():
    state = {"w": jnp.ones((4, 2)), "n": jnp.zeros((), jnp.int32), "key": jax.random.key(0)}

    def step(s, batch):
        return {**s, "w": s["w"] + batch, "n": s["n"] + 1}, {"loss": jnp.sum(s["w"])}

    form = form_for(step, (state, None))
    assert isinstance(form, PytreeForm) and form.arity == 2
    leaves = form.state_of((state,))
    new, metrics = form.pure(leaves, 1.0)
    out_state, out_metrics = form.result((state,), new, metrics)
    assert int(out_state["n"]) == 1 and float(out_metrics["loss"]) == 8.0
    assert jax.dtypes.issubdtype(out_state["key"].dtype, jax.dtypes.prng_key)
    restored, k = form.restored((state,), leaves, 3)
    assert k == 3 and float(restored["w"][0, 0]) == 1.0
    with pytest.raises(UnsupportedStateError, match="has 1 leaves"):
        form.state_of(({"w": jnp.ones(2)},))


def test_pytree_form_rejects_bad_states_and_returns():
    with pytest.raises(UnsupportedStateError, match="pytree of arrays"):
        form_for(lambda s, b: (s, {}), ({"name": "not an array"}, None))
    form = form_for(lambda s, b: s, ({"w": jnp.ones(2)}, None))
    with pytest.raises(UnsupportedStateError, match=r"return \(state, metrics\)"):
        form.pure(form.state_of(({"w": jnp.ones(2)},)), None)
    form = form_for(lambda s, b: ({"v": s["w"]}, {}), ({"w": jnp.ones(2)}, None))
    with pytest.raises(UnsupportedStateError, match="another structure"):
        form.pure(form.state_of(({"w": jnp.ones(2)},)), None)


def test_form_for_names_the_supported_signatures():
    model, optimizer = h.make_mlp()
    with pytest.raises(UnsupportedStateError, match="not an nnx.Optimizer"):
        form_for(h.train_step, (model, {"not": "an optimizer"}, None))
    with pytest.raises(UnsupportedStateError, match="pass the optimizer too"):
        form_for(h.train_step, (model, None))
    with pytest.raises(UnsupportedStateError, match="4 positional arguments"):
        form_for(h.train_step, (1, 2, 3, 4))
