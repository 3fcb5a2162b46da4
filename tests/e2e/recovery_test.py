"""End to end: devices die mid-run; the run ends equal to a failure-free plain Flax run."""

import functools
import logging

import jax
import numpy as np
import pytest

import mnemojax
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8

STEPS = 7


@functools.cache
def reference(dropout: float = 0.0):
    return h.reference_run(h.make_batches(STEPS), dropout=dropout)


@pytest.mark.parametrize("shape", [(8, 1), (4, 2), (1, 8)], ids=["8x1", "4x2", "1x8"])
def test_one_device_lost(shape):
    faults = FaultInjector().lose_devices(3, [5])
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of(shape), faults=faults)
    h.assert_same_run(got, reference())
    [rec] = step.statistics.recoveries
    assert rec.step == 3 and rec.failed_devices == (5,)
    assert 5 not in rec.new_mesh_devices
    assert rec.old_mesh_shape == dict(zip(("data", "model"), shape, strict=True))
    assert set(rec.phases_s) == {"detect", "plan", "reshard", "compile", "replay"}
    if shape[0] > 1:  # a data axis: every shard still has a live copy
        assert rec.source == "live_replicas" and rec.plan_kind == "drop_replicas"
        assert rec.steps_lost == 0
        assert rec.new_mesh_shape["model"] == shape[1]
    else:  # fully model-sharded: the dead device's shards come from the host snapshot
        # The snapshot of step 2 may still be in flight when the device dies (its copy
        # then fails): step 1's snapshot is used and step 2 replayed. At most one step.
        assert rec.source in ("live_replicas+snapshot", "host_snapshot")
        assert rec.steps_lost <= 1 and rec.plan_kind == "shrink_model"
        assert rec.new_mesh_shape == {"data": 1, "model": 4}
    assert step.statistics.steps_run == STEPS


def test_two_devices_lost_at_different_steps_4x2():
    faults = FaultInjector().lose_devices(2, [3]).lose_devices(5, [4], surface="block")
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((4, 2)), faults=faults)
    h.assert_same_run(got, reference())
    first, second = step.statistics.recoveries
    assert (first.step, second.step) == (2, 5)
    assert first.new_mesh_shape == {"data": 3, "model": 2}
    # The healthy partner of device 3 (device 2) became a spare and replaced device 4.
    assert second.plan_kind == "spare_swap" and second.new_mesh_shape == {"data": 3, "model": 2}
    assert 2 in second.new_mesh_devices and 4 not in second.new_mesh_devices
    assert set(step.statistics.dead_devices) == {3, 4}


def test_two_devices_lost_fully_model_sharded_with_dropout_rng():
    """(1, 8): snapshots are the only source; the RNG state must round-trip exactly."""
    faults = FaultInjector().lose_devices(2, [1]).lose_devices(6, [0])
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((1, 8)), faults=faults,
                                dropout=0.25, settle=True)
    h.assert_same_run(got, reference(dropout=0.25))
    recs = step.statistics.recoveries
    assert [r.source for r in recs] == ["live_replicas+snapshot"] * 2
    assert [r.steps_lost for r in recs] == [0, 0]


def test_spare_swapped_in_keeps_mesh_shape():
    mesh = h.mesh_of((3, 2), devices=jax.devices()[:6])
    faults = FaultInjector().lose_devices(4, [2])
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=mesh, faults=faults,
                                spare_devices=jax.devices()[6:])
    h.assert_same_run(got, reference())
    [rec] = step.statistics.recoveries
    assert rec.plan_kind == "spare_swap"
    assert rec.new_mesh_shape == {"data": 3, "model": 2}
    assert rec.new_mesh_devices == (0, 1, 6, 3, 4, 5)
    # Only the groups through device 2 changed: one model group and one data group.
    assert rec.groups_changed == 2 and rec.groups_kept == 3
    assert step.statistics.spare_devices == (7,)


def _not_on_three_replicas(model, optimizer, batch):
    """A step that cannot be traced for three data replicas (as one that reshapes its
    batch into micro-batches by the data axis's width, for a width that does not fit)."""
    if jax.sharding.get_abstract_mesh().shape.get("data") == 3:
        raise ValueError("4 micro-batches per replica do not split 8 rows")
    return h.train_step(model, optimizer, batch)


def test_a_mesh_the_step_cannot_compile_for_is_planned_around(caplog):
    """The loss of one device of (4, 2) plans (3, 2), for which the step's trace fails:
    the recovery plans around that shape, (2, 2), and the run ends as the failure-free
    one (a user trial's job ended with a StepCompileError where (2, 2) worked)."""
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(_not_on_three_replicas, mesh=h.mesh_of((4, 2)),
                              options=h.no_precompile(),
                              fault_injector=FaultInjector().lose_devices(4, [3]))
    try:
        with caplog.at_level(logging.WARNING, logger="mnemojax"):
            losses = [float(step(model, optimizer, b)["loss"]) for b in h.make_batches(STEPS)]
        [rec] = step.statistics.recoveries
        assert rec.new_mesh_shape == {"data": 2, "model": 2} and rec.plan_kind == "drop_replicas"
        assert "cannot be compiled for mesh {'data': 3, 'model': 2}; planning around it" \
            in caplog.text
        assert step._require_built().builder.facts.refused_shapes == {(3, 2)}
    finally:
        step.close()
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), reference())


def test_snapshot_cadence_rolls_back_and_replays_buffered_batches():
    """With snapshots every 3 steps on (1, 8), a loss at step 6 restores step 3 and
    replays steps 4 and 5 from the kept batches: same math, two steps recomputed. Settled:
    a copy of step 3 still running at step 6 (seen once under the full suite) would be
    lost with device 7, and the recovery would rightly go back to step 0."""
    opts = h.no_precompile(snapshot=mnemojax.SnapshotOptions(unreplicated_every_steps=3))
    faults = FaultInjector().lose_devices(6, [7])
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((1, 8)), faults=faults,
                                options=opts, settle=True)
    h.assert_same_run(got, reference())
    [rec] = step.statistics.recoveries
    assert rec.source == "host_snapshot" and rec.source_step == 3 and rec.steps_lost == 2


def _pure_step(state, batch):
    import jax.numpy as jnp

    def loss(w):
        return jnp.mean((batch["x"] @ w["w"] + w["b"] - batch["t"]) ** 2)

    value, grads = jax.value_and_grad(loss)(state["params"])
    params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
    return {"params": params, "count": state["count"] + 1}, {"loss": value}


def _pure_run(mesh, faults):
    rng = np.random.default_rng(1)
    batches = [{"x": rng.normal(size=(24, 8)).astype(np.float32),
                "t": rng.normal(size=(24, 2)).astype(np.float32)} for _ in range(STEPS)]
    state = {"params": {"w": np.zeros((8, 2), np.float32), "b": np.zeros((2,), np.float32)},
             "count": np.zeros((), np.int32)}
    step = mnemojax.resilient(mesh=mesh, options=h.no_precompile(),
                              fault_injector=faults)(_pure_step)
    losses = []
    try:
        for b in batches:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
    finally:
        step.close()
    return state, losses, step, batches


def test_pure_pytree_step():
    ref_state = {"params": {"w": np.zeros((8, 2), np.float32), "b": np.zeros((2,), np.float32)},
                 "count": np.zeros((), np.int32)}
    _, _, _, batches = _pure_run(h.mesh_of((8,), ("data",)), None)
    jitted = jax.jit(_pure_step)
    ref_losses = []
    for b in batches:
        ref_state, m = jitted(ref_state, b)
        ref_losses.append(float(m["loss"]))
    state, losses, step, _ = _pure_run(h.mesh_of((8,), ("data",)),
                                       FaultInjector().lose_devices(4, [6]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-5), state, ref_state)
    [rec] = step.statistics.recoveries
    assert rec.new_mesh_shape == {"data": 6}  # 7 survivors; 6 is the widest dividing 24
    assert int(state["count"]) == STEPS


def test_no_surviving_copy_and_no_snapshot_is_a_typed_error():
    opts = h.no_precompile(snapshot=mnemojax.SnapshotOptions(unreplicated_every_steps=0))
    with pytest.raises(mnemojax.errors.StateUnavailableError, match="no host snapshot"):
        h.resilient_run(h.make_batches(3), mesh=h.mesh_of((1, 8)), options=opts,
                        faults=FaultInjector().lose_devices(2, [4]))


def test_donated_state_recovers_from_the_snapshot():
    """With donation, a step that fails after launch has consumed its inputs: the live
    state is gone and recovery must (and does) use the host snapshot of the last step."""
    opts = h.no_precompile(snapshot=mnemojax.SnapshotOptions(every_steps=1),
                           compile=mnemojax.CompileOptions(precompile=False, cache_dir=None,
                                                           donate_state=True))
    faults = FaultInjector().lose_devices(4, [1], surface="block")
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((4, 2)), faults=faults,
                                options=opts)
    h.assert_same_run(got, reference())
    [rec] = step.statistics.recoveries
    assert rec.source == "host_snapshot" and rec.source_step == 3 and rec.steps_lost == 0


def _step_with_grads(model, optimizer, batch):
    from flax import nnx

    loss, grads = nnx.value_and_grad(h.loss_fn)(model, batch)
    optimizer.update(model, grads)
    return {"loss": loss, "grads": grads}


def test_gradients_are_a_separate_snapshot_entry_with_their_own_cadence():
    opts = h.no_precompile(snapshot=mnemojax.SnapshotOptions(every_steps=1,
                                                             grads_every_steps=2))
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(_step_with_grads, mesh=h.mesh_of((4, 2)), options=opts)
    for b in h.make_batches(3):
        step(model, optimizer, b)
    step.wait_snapshots()
    stats = step.statistics
    assert stats.grads_snapshot_step == 2  # cadence 2: steps 2 (and 4, ...)
    params_bytes = stats.snapshot_bytes_by_entry["params"]
    assert stats.grads_snapshot_bytes == params_bytes  # one gradient per parameter
    assert stats.snapshot_bytes_by_entry.keys() == {"params", "opt_state"}  # kept apart
    step.close()
