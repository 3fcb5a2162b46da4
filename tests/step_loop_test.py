"""The step's loop around a recovery: failures and retries while it replays, budgets
shared by the replay, and the record of a recovery cut short. Every run ends exactly like
the failure-free reference."""

import functools

import jax
import pytest

import mnemojax
from mnemojax._src import fault_injection
from mnemojax.testing import FaultInjector
from tests import helpers as h

STEPS = 7
# (1, 8): no live replica of any shard, snapshots every 3 steps: a loss at step 6 rolls
# back to the snapshot of step 3 and replays steps 4 and 5.
OPTS = h.no_precompile(snapshot=mnemojax.SnapshotOptions(unreplicated_every_steps=3))


@functools.cache
def _reference():
    return h.reference_run(h.make_batches(STEPS))


class _FailInReplay(FaultInjector):
    """Device 7 dies in step 6; device 1 dies when step `replayed` runs again."""

    def __init__(self, replayed: int):
        super().__init__()
        self.lose_devices(6, [7])
        self._replayed = replayed
        self._runs: dict[int, int] = {}

    def wrap(self, layer):
        inner = super().wrap(layer)
        injector = self

        class Layer:
            def __getattr__(self, name):
                return getattr(inner, name)

            def execute(self, executable, args, *, step, devices):
                injector._runs[step] = injector._runs.get(step, 0) + 1
                if step == injector._replayed and injector._runs[step] == 2:
                    injector._dead.add(1)
                    injector._failure_surfaced = True
                    raise fault_injection._device_error([1], f"replaying step {step}")
                return inner.execute(executable, args, step=step, devices=devices)

        return Layer()


def test_device_lost_while_replaying_recovers_again_exactly():
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((1, 8)),
                                faults=_FailInReplay(replayed=5), options=OPTS, settle=True)
    h.assert_same_run(got, _reference())
    stats = step.statistics
    assert stats.faults_during_recovery == 1 and len(stats.recoveries) == 2
    cut, done = stats.recoveries
    assert cut.source_step == 3 and cut.phases_s["replay"] > 0  # step 4 was replayed
    assert done.step == 6 and 1 not in done.new_mesh_devices and 7 not in done.new_mesh_devices
    assert cut.total_s > 0 and done.total_s > 0


def test_transient_error_while_replaying_is_retried_within_the_recovery():
    faults = FaultInjector().lose_devices(6, [7]).transient_error(4, times=2)
    got, step = h.resilient_run(h.make_batches(STEPS), mesh=h.mesh_of((1, 8)),
                                faults=faults, options=OPTS, settle=True)
    h.assert_same_run(got, _reference())
    stats = step.statistics
    assert stats.transient_retries == 2  # once in step 4, once in its replay
    [rec] = stats.recoveries
    assert rec.source_step == 3 and rec.steps_lost == 2 and rec.phases_s["replay"] > 0


def test_replay_shares_the_failed_steps_recovery_budget():
    """One recovery allowed per step: a second failure while replaying exhausts it, and the
    cut-short recovery is still recorded."""
    opts = h.no_precompile(
        snapshot=mnemojax.SnapshotOptions(unreplicated_every_steps=3),
        recovery=mnemojax.RecoveryOptions(stop=mnemojax.retry.stop_after_attempt(1)))
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((1, 8)), options=opts,
                              fault_injector=_FailInReplay(replayed=4))
    batches = h.make_batches(STEPS)
    try:
        for b in batches[:5]:
            step(model, optimizer, b)
            step.wait_snapshots()
        with pytest.raises(mnemojax.errors.RecoveryExhaustedError) as info:
            step(model, optimizer, batches[5])
        assert isinstance(info.value.last_error, mnemojax.errors.DeviceFailureError)
        assert info.value.last_error.failed_devices == (1,)
        assert isinstance(info.value.last_error.__cause__, jax.errors.JaxRuntimeError)
        [cut] = step.statistics.recoveries
        assert cut.step == 6 and cut.phases_s["replay"] == 0.0  # nothing replayed yet
    finally:
        step.close()
