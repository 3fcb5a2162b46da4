"""A program in the shape of the Flax Linen dropout guide: a ``TrainState`` and a step
``train_step(state, batch, dropout_key) -> state`` that folds the step number into a
dropout key passed in every call, and returns the state alone.

Its own code (not the guide's text): the guide's signature and its key handling. The key
is an input every device takes whole (a typed ``jax.random.key``, or a raw
``jax.random.PRNGKey`` named in ``replicated_argnames``); through device losses, the
replayed steps get the same key and the run matches the plain ``jax.jit`` one.
"""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import mnemojax
from mnemojax.testing import FaultInjector
from tests import helpers as h

STEPS = 6


class Model(nn.Module):
    @nn.compact
    def __call__(self, x, training: bool):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.Dropout(rate=0.5, deterministic=not training)(x)
        return nn.Dense(h.DOUT)(x)


def train_step(state, batch, dropout_key):
    dropout_train_key = jax.random.fold_in(key=dropout_key, data=state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"], training=True,
                                rngs={"dropout": dropout_train_key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    grads = jax.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)


def make_state():
    model = Model()
    params = model.init(jax.random.key(0), np.zeros((1, h.DIN), np.float32),
                        training=False)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(1e-2))


def run(step, dropout_key, *, keys=None):
    """`keys`: one key per step instead of the same `dropout_key` every step."""
    state = make_state()
    for i, b in enumerate(h.make_batches(STEPS)):
        state = step(state, b, dropout_key if keys is None else keys[i])
    return state


def assert_same_state(got, want):
    assert isinstance(got, train_state.TrainState) and int(got.step) == STEPS
    a, b = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def reference():
    return run(jax.jit(train_step), jax.random.key(1))


def test_a_typed_dropout_key_input_through_two_device_losses(reference):
    faults = FaultInjector().lose_devices(2, [3]).lose_devices(4, [5], surface="block")
    step = mnemojax.resilient(train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=faults)
    try:
        got = run(step, jax.random.key(1))
    finally:
        step.close()
    assert len(step.statistics.recoveries) == 2
    assert_same_state(got, reference)
    # The key does the work: another key is another model.
    other = jax.tree.leaves(run(jax.jit(train_step), jax.random.key(2)).params)
    assert any(not np.allclose(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(got.params), other, strict=True))


def test_a_raw_prng_key_named_replicated_through_a_device_loss(reference):
    raw = jax.random.key_data(jax.random.key(1))  # what jax.random.PRNGKey(1) gives
    faults = FaultInjector().lose_devices(3, [2])
    step = mnemojax.resilient(train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=faults, replicated_argnames="dropout_key")
    try:
        got = run(step, np.asarray(raw))
    finally:
        step.close()
    assert len(step.statistics.recoveries) == 1
    assert_same_state(got, reference)  # fold_in takes a raw key as it takes a typed one


def test_replayed_steps_get_their_own_keys():
    """Another raw key every step, and the state donated (as the Flax examples' jit does):
    a loss rolls back to the initial snapshot and replays steps 1-3, each with the key it
    was first called with (kept for replay), then runs step 4 with its own."""
    keys = [np.asarray(k) for k in jax.random.key_data(jax.random.split(jax.random.key(3),
                                                                        STEPS))]
    want = run(jax.jit(train_step, donate_argnums=0), None, keys=keys)
    step = mnemojax.resilient(train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=FaultInjector().lose_devices(4, [2]),
                              donate_argnums=0, replicated_argnames="dropout_key")
    try:
        got = run(step, None, keys=keys)
    finally:
        step.close()
    [rec] = step.statistics.recoveries
    assert (rec.source, rec.source_step, rec.steps_lost) == ("host_snapshot", 0, 3)
    assert_same_state(got, want)
