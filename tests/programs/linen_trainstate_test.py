"""A Linen program: ``flax.training.train_state.TrainState`` and a ``jax.jit``-style step
``step(state, batch) -> (state, metrics)``. TrainState holds ``apply_fn`` and ``tx`` as
static fields: they ride in the pytree structure, and every state mnemojax hands back
(after a step, a recovery or a restore) is a TrainState with them.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import mnemojax
from mnemojax.testing import FaultInjector
from tests import helpers as h

STEPS = 6


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(h.DOUT)(x)


def make_state():
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, h.DIN)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(1e-2))


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def run(step, batches):
    state = initial = make_state()
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    # The static fields ride along: the same functions as the state started with.
    assert state.apply_fn == initial.apply_fn and state.tx is initial.tx
    return state, losses


@pytest.fixture(scope="module")
def reference():
    return run(jax.jit(train_step), h.make_batches(STEPS))


def test_two_device_losses_end_with_the_plain_runs_train_state(reference):
    faults = FaultInjector().lose_devices(2, [3]).lose_devices(4, [5], surface="block")
    step = mnemojax.resilient(train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=faults)
    try:
        state, losses = run(step, h.make_batches(STEPS))
    finally:
        step.close()
    want_state, want_losses = reference
    assert len(step.statistics.recoveries) == 2
    assert isinstance(state, train_state.TrainState)
    assert int(state.step) == STEPS
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    got, want = jax.tree.leaves(state), jax.tree.leaves(want_state)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_the_restore_path_rebuilds_the_train_state():
    from mnemojax._src.step_forms import form_for

    state = make_state()
    form = form_for(train_step, (state, h.make_batches(1)[0]))
    restored, k = form.restored(form.split_restore((state,), {}), form.state_of((state,)), 4)
    assert k == 4 and isinstance(restored, train_state.TrainState)
    assert restored.apply_fn == state.apply_fn and restored.tx is state.tx
    assert jax.tree.structure(restored) == jax.tree.structure(state)
