"""Batches (issue 14): a fixed global batch size, replay from mnemojax's own copies, and no
trace of a call that raised. Recoveries end exactly like the failure-free reference."""

import numpy as np
import pytest

import mnemojax
from mnemojax.testing import FaultInjector
from tests import helpers as h

STEPS = 6
# (1, 8) and a snapshot every 3 steps: a loss in step 5 rolls back to step 3 and replays 4.
OPTS = h.no_precompile(snapshot=mnemojax.SnapshotOptions(unreplicated_every_steps=3))


def _step(faults=None, options=OPTS):
    return mnemojax.resilient(h.train_step, mesh=h.mesh_of((1, 8)), options=options,
                              fault_injector=faults)


@pytest.mark.parametrize("size", [h.BATCH + 8, h.BATCH - 8])
def test_a_batch_of_another_size_is_refused_never_truncated(size):
    model, optimizer = h.make_mlp()
    step = _step()
    try:
        step(model, optimizer, h.make_batches(1)[0])
        before = h.host_state(model, optimizer)
        with pytest.raises(mnemojax.errors.BatchSplitError,
                           match=f"has {size} examples, the first one had {h.BATCH}"):
            step(model, optimizer, h.make_batches(1, batch=size)[0])
        assert step.step_count == 1
        for a, b in zip(before, h.host_state(model, optimizer), strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        step.close()


def test_a_loader_that_refills_one_buffer_replays_exactly():
    """The caller passes the same arrays every step, refilled in place: a rollback replay
    must use the batch of that step, not what the buffer holds now."""
    batches = h.make_batches(STEPS)
    buffer = {k: v.copy() for k, v in batches[0].items()}
    model, optimizer = h.make_mlp()
    step = _step(FaultInjector().lose_devices(5, [3]))
    try:
        for b in batches:
            for k in buffer:
                np.copyto(buffer[k], b[k])
            step(model, optimizer, buffer)
            step.wait_snapshots()
        [rec] = step.statistics.recoveries
        assert rec.source == "host_snapshot" and rec.steps_lost == 1
    finally:
        step.close()
    got = h.Run([], h.host_state(model, optimizer))
    want = h.reference_run(batches)
    h.assert_same_run(got, h.Run([], want.state))


def test_a_call_that_raised_leaves_no_trace_for_the_replay():
    """Step 4's call raises (a NaN batch under nonfinite='raise', caught by the user); the
    user goes on with the good batch 4. A rollback in step 6 replays the good batch 4 and
    5, never the poisoned one."""
    batches = h.make_batches(STEPS)
    poisoned = {"x": np.full_like(batches[3]["x"], np.nan), "y": batches[3]["y"]}
    model, optimizer = h.make_mlp()
    step = _step(FaultInjector().lose_devices(6, [2]))
    try:
        for i, b in enumerate(batches):
            if i == 3:
                with pytest.raises(mnemojax.errors.NonFiniteLossError):
                    step(model, optimizer, poisoned)
                assert step.step_count == 3
            step(model, optimizer, b)
            step.wait_snapshots()
        [rec] = step.statistics.recoveries
        assert rec.source_step == 3 and rec.steps_lost == 2  # replays the good 4 and 5
    finally:
        step.close()
    want = h.reference_run(batches)
    h.assert_same_run(h.Run([], h.host_state(model, optimizer)), h.Run([], want.state))
