"""The fault matrix: every fault kind ends recovered-and-exact or in a typed error.

Cells already covered elsewhere (named here so the matrix is complete):
  device loss x (8,1)/(4,2)/(1,8), spare, pure form  -> tests/e2e/recovery_test.py
  transient error -> retried in place                 -> tests/api_test.py
  retry / recovery / run-wide budget exhausted        -> tests/api_test.py
  every in-memory copy lost -> Orbax, or typed error  -> tests/persistent_test.py,
                                                         tests/e2e/recovery_test.py
  snapshot budget exceeded -> snapshots off + warning -> tests/snapshot_test.py
  preemption (SIGTERM), memory pressure               -> tests/persistent_test.py
  NaN loss -> NonFiniteLossError (default)            -> tests/api_test.py
  device lost during guarded work (an eval)           -> tests/guard_test.py
"""

import numpy as np
import pytest
from flax import nnx

import mnemojax
from mnemojax.errors import NonFiniteLossError, NonFiniteSkipWarning
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8
STEPS = 6


def _reference():
    return h.reference_run(h.make_batches(STEPS))


def test_hang_is_detected_by_the_watchdog_and_recovered():
    faults = FaultInjector().hang(3, [6])
    opts = h.no_precompile(recovery=mnemojax.RecoveryOptions(hang_timeout_s=1.0,
                                                             probe_timeout_s=1.0))
    try:
        got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((4, 2)),
                                    faults=faults, options=opts)
    finally:
        faults.release_hung()
    h.assert_same_run(got, _reference())
    [rec] = step.statistics.recoveries
    assert rec.failed_devices == (6,) and rec.source == "live_replicas" and rec.hang
    assert rec.phases_s["detect"] < 5.0
    assert 1.0 <= rec.waited_s < 5.0  # the step ran until the watchdog's 1 s: not in total_s


def test_second_fault_during_recovery_is_recovered_exactly():
    faults = FaultInjector().lose_devices(3, [1]).lose_devices_during_recovery(3, [4])
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((4, 2)), faults=faults)
    h.assert_same_run(got, _reference())
    [rec] = step.statistics.recoveries
    assert rec.failed_devices == (1, 4)
    assert step.statistics.faults_during_recovery == 1
    assert {1, 4}.isdisjoint(rec.new_mesh_devices)


def test_corrupt_snapshot_is_never_restored():
    """(1, 8): the snapshot of step 3 gets a flipped bit, then device 5 dies in step 4.
    The corrupt copy fails its CRC, the one of step 2 is used, step 3 is replayed."""
    faults = FaultInjector().corrupt_snapshot(4).lose_devices(4, [5])
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((1, 8)), faults=faults,
                                settle=True)
    h.assert_same_run(got, _reference())
    [rec] = step.statistics.recoveries
    assert step.statistics.corrupt_snapshots_detected == 1
    assert rec.source == "host_snapshot" and rec.source_step == 2 and rec.steps_lost == 1


def test_corrupt_snapshot_that_is_never_needed_is_still_noticed():
    faults = FaultInjector().corrupt_snapshot(3)
    opts = h.no_precompile(snapshot=mnemojax.SnapshotOptions(every_steps=1))
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((4, 2)), faults=faults,
                                options=opts, settle=True)
    h.assert_same_run(got, _reference())
    assert step.statistics.corrupt_snapshots_scrubbed == 1
    assert step.statistics.recoveries == []


def _nan_batch(batch):
    return {"x": np.full_like(batch["x"], np.nan), "y": batch["y"]}


def test_nan_skip_batch_policy_keeps_state_and_says_so():
    batches = h.make_batches(STEPS)
    poisoned = list(batches)
    poisoned.insert(3, _nan_batch(batches[0]))
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                              options=h.no_precompile(nonfinite="skip_batch"))
    with pytest.warns(NonFiniteSkipWarning, match="batch skipped"):
        for b in poisoned:
            step(model, optimizer, b)
    step.close()
    assert step.statistics.skipped_batches == [4]
    assert step.statistics.steps_run == STEPS
    h.assert_same_run(h.Run([], h.host_state(model, optimizer)),
                      h.Run([], _reference().state))


def test_device_loss_in_a_nan_step_recovers_then_skips_the_batch():
    """The step fed a NaN batch also loses a device: it recovers onto the new mesh, then
    skips the batch; the model keeps the recovered state (not the old mesh's arrays)."""
    batches = h.make_batches(STEPS)
    poisoned = list(batches)
    poisoned.insert(3, _nan_batch(batches[0]))
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                              fault_injector=FaultInjector().lose_devices(4, [5]),
                              options=h.no_precompile(nonfinite="skip_batch"))
    with pytest.warns(NonFiniteSkipWarning, match="batch skipped"):
        for b in poisoned[:4]:
            step(model, optimizer, b)
    # Right after the skip, the model holds the recovered arrays, none on the lost device.
    devices = {d.id for d in model.l1.kernel.get_value().sharding.device_set}
    assert 5 not in devices and len(devices) == 6
    for b in poisoned[4:]:
        step(model, optimizer, b)
    step.close()
    [rec] = step.statistics.recoveries
    assert rec.step == 4 and 5 not in rec.new_mesh_devices
    assert step.statistics.skipped_batches == [4] and step.statistics.steps_run == STEPS
    h.assert_same_run(h.Run([], h.host_state(model, optimizer)),
                      h.Run([], _reference().state))


def test_nan_in_gradients_with_finite_loss_is_caught():
    def poisoned_grads(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(h.loss_fn)(model, batch)
        grads = jax_tree_nan_first(grads)
        optimizer.update(model, grads)
        return {"loss": loss}

    def jax_tree_nan_first(tree):
        import jax

        leaves, treedef = jax.tree.flatten(tree)
        leaves[0] = leaves[0] * np.nan
        return jax.tree.unflatten(treedef, leaves)

    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(poisoned_grads, mesh=h.mesh_of((4, 2)),
                              options=h.no_precompile())
    with pytest.raises(NonFiniteLossError, match="new state"):
        step(model, optimizer, h.make_batches(1)[0])
    assert np.isfinite(h.host_state(model, optimizer)[0]).all()
    step.close()
    # check_state=False keeps only the loss check: the NaN state goes through unnoticed.
    step = mnemojax.resilient(poisoned_grads, mesh=h.mesh_of((4, 2)),
                              options=h.no_precompile(check_state=False))
    step(model, optimizer, h.make_batches(1)[0])
    assert not np.isfinite(h.host_state(model, optimizer)[0]).all()
    step.close()
