"""`ResilientStep.guard`: an eval step beside the resilient train step survives a device
loss that surfaces inside it, and the run ends where a failure-free one ends."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mnemojax
from mnemojax.errors import UnsupportedStateError
from tests import helpers as h

pytestmark = pytest.mark.needs8

STEPS = 6
EVAL = h.EVAL_BATCH


def _eval(model, batch):
    return {"loss": h.loss_fn(model, batch)}


def test_a_device_lost_during_a_guarded_eval_is_recovered_and_the_eval_runs_again():
    batches = h.make_batches(STEPS)
    want, want_evals = h.reference_run(batches), h.reference_evals(batches)
    faults = mnemojax.testing.FaultInjector().lose_devices_beside(3, [5])
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), fault_injector=faults,
                              options=h.no_precompile())
    calls = []

    @step.guard
    @nnx.jit
    def eval_step(model, batch):
        calls.append(1)  # once per trace: the eval traces again on the new mesh
        return _eval(model, batch)

    try:
        first = float(eval_step(model, EVAL)["loss"])  # before the first step: unguarded
        losses, evals, meshes = [], [], []
        for b in batches:
            losses.append(float(step(model, optimizer, b)["loss"]))
            evals.append(float(eval_step(model, EVAL)["loss"]))
            meshes.append({d.id for d in step.mesh.devices.flat})
    finally:
        step.close()
    untrained, _ = h.make_mlp()
    assert first == pytest.approx(float(nnx.jit(_eval)(untrained, EVAL)["loss"]), abs=1e-6)
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), want)
    np.testing.assert_allclose(evals, want_evals, rtol=1e-5, atol=1e-5)
    [rec] = step.statistics.recoveries
    assert rec.guarded and rec.step == 4 and rec.steps_lost == 0
    assert rec.failed_devices == (5,) and rec.source_step == 3
    # (each mesh read after that step's eval: the third eval recovered)
    assert all(5 in m for m in meshes[:2]) and all(5 not in m for m in meshes[2:])
    assert len(calls) == 3  # the first, the (4, 2) and the new mesh's trace


def test_a_guarded_functions_own_error_is_raised_as_it_is_and_recovers_nothing():
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((1, 1)), options=h.no_precompile())

    @step.guard
    def broken(model, batch):
        raise ValueError(f"bad eval batch {sorted(batch)}")

    try:
        step(model, optimizer, h.make_batches(1)[0])
        with pytest.raises(ValueError, match=r"bad eval batch \['x', 'y'\]"):
            broken(model, EVAL)
        assert step.statistics.recoveries == [] and step.step_count == 1
        assert broken.__name__ == "broken"
    finally:
        step.close()


def test_guarding_a_step_whose_state_only_the_caller_holds_is_refused():
    def pure_step(state, batch):
        return jax.tree.map(lambda w: w - 0.1 * jnp.mean(batch["x"]), state), {"loss": 0.0}

    step = mnemojax.resilient(pure_step, mesh=h.mesh_of((1, 1)), options=h.no_precompile(
        nonfinite="ignore"))
    guarded = step.guard(lambda state: state["w"].sum())
    try:
        state = {"w": np.ones((4,), np.float32)}
        assert float(guarded(state)) == 4.0  # before the first step: unguarded
        state, _ = step(state, h.make_batches(1)[0])
        with pytest.raises(UnsupportedStateError, match="pytree that only its caller holds"):
            guarded(state)
    finally:
        step.close()
