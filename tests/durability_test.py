"""What outlives the process (mnemojax._src.durability.Durability): periodic Orbax saves,
restore onto another mesh, preemption signals, memory-pressure checkpoints, the event log.

Durability is driven directly with state leaves: no step is compiled.
"""

import os
import signal

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.durability import Durability
from mnemojax._src.events import read_events
from mnemojax.errors import PreemptionExit
from tests import helpers as h

pytestmark = pytest.mark.needs8

KEYS = [("model", "w"), ("optimizer", "count")]
SPECS = [P(None, "model"), P()]


def _host(step):
    return [np.full((8, 6), float(step), np.float32), np.array(step, np.int32)]


def _leaves(step, mesh):
    return [jax.device_put(x, NamedSharding(mesh, s))
            for x, s in zip(_host(step), SPECS, strict=True)]


def _structs():
    return [(x.shape, x.dtype) for x in _host(0)]


def _options(tmp_path, **persistent):
    persistent.setdefault("memory_pressure_fraction", None)
    persistent.setdefault("preemption_signals", ())
    return mnemojax.ResilienceOptions(
        persistent=mnemojax.PersistentOptions(directory=str(tmp_path / "ckpt"), **persistent),
        event_log=str(tmp_path / "events.jsonl"), run_name="durability")


def _events(tmp_path, kind):
    return [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == kind]


class _MemoryLayer(JaxDeviceLayer):
    """Reports scripted host memory use per step; records when it was asked."""

    def __init__(self, by_step):
        super().__init__()
        self.by_step = by_step
        self.sampled: list[int] = []

    def memory_fractions(self, devices, *, step):
        self.sampled.append(step)
        return {"host": self.by_step[step]}


def test_without_a_directory_or_log_everything_is_a_no_op(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    dur = Durability(mnemojax.ResilienceOptions(), keys=KEYS, layer=_MemoryLayer({}))
    assert dur.tier is None and dur.events is None
    assert signal.getsignal(signal.SIGTERM) is before  # no tier: no handler installed
    mesh = h.mesh_of((4, 2))
    dur.emit("step", step=1)
    dur.after_commit(5, _leaves(5, mesh), mesh.devices.flat)
    dur.check_preemption(5, None)
    assert dur.restore_latest(None, _structs()) is None
    assert dur.jit_checkpoints == 0
    dur.close()
    assert not list(tmp_path.iterdir())


def test_periodic_saves_then_restore_latest_onto_another_mesh(tmp_path):
    big, small = h.mesh_of((4, 2)), h.mesh_of((3, 2), devices=jax.devices()[2:8])
    dur = Durability(_options(tmp_path, every_steps=2), keys=KEYS, layer=JaxDeviceLayer())
    for step in range(1, 6):
        dur.after_commit(step, _leaves(step, big), big.devices.flat)
    dur.close()
    saves = _events(tmp_path, "checkpoint_save")
    assert [e["step"] for e in saves] == [2, 4]
    assert all(e["just_in_time"] is False and e["duration_s"] >= 0 for e in saves)
    assert all(e["run"] == "durability" for e in saves)

    again = Durability(_options(tmp_path), keys=KEYS, layer=JaxDeviceLayer())
    step, leaves = again.restore_latest([NamedSharding(small, s) for s in SPECS], _structs())
    again.close()
    assert step == 4
    for got, want in zip(leaves, _host(4), strict=True):
        assert got.sharding.mesh == small
        np.testing.assert_array_equal(np.asarray(got), want)
    [restore] = _events(tmp_path, "checkpoint_restore")
    assert restore["step"] == 4 and restore["duration_s"] > 0


def test_empty_directory_restores_nothing(tmp_path):
    dur = Durability(_options(tmp_path), keys=KEYS, layer=JaxDeviceLayer())
    assert dur.restore_latest(None, _structs()) is None
    dur.close()
    assert _events(tmp_path, "checkpoint_restore") == []


def test_reopened_tier_keeps_saving_into_the_same_directory(tmp_path):
    mesh = h.mesh_of((4, 2))
    dur = Durability(_options(tmp_path, every_steps=1), keys=KEYS, layer=JaxDeviceLayer())
    dur.after_commit(1, _leaves(1, mesh), mesh.devices.flat)
    old = dur.tier
    new_layer = JaxDeviceLayer()
    dur.reopen_tier(new_layer)  # a new multi-process world
    assert dur.tier is not old and dur.layer is new_layer
    dur.after_commit(2, _leaves(2, mesh), mesh.devices.flat)
    step, leaves = dur.restore_latest([NamedSharding(mesh, s) for s in SPECS], _structs())
    dur.close()
    assert step == 2 and int(leaves[1]) == 2


def test_preemption_signal_checkpoints_the_last_step_then_exits(tmp_path):
    """Any configured signal works; SIGUSR1 keeps this test away from pytest's SIGTERM."""
    def previous(signum, frame):
        raise AssertionError("the preemption handler should have taken the signal")

    original = signal.signal(signal.SIGUSR1, previous)
    try:
        mesh = h.mesh_of((4, 2))
        dur = Durability(_options(tmp_path, preemption_signals=(signal.SIGUSR1,)), keys=KEYS,
                         layer=JaxDeviceLayer())
        dur.after_commit(1, _leaves(1, mesh), mesh.devices.flat)  # no notice yet: nothing
        assert _events(tmp_path, "preemption") == []
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(PreemptionExit) as info:
            dur.after_commit(2, _leaves(2, mesh), mesh.devices.flat)
        assert signal.getsignal(signal.SIGUSR1) is previous  # restored on the way out
    finally:
        signal.signal(signal.SIGUSR1, original)
    exit_ = info.value
    assert exit_.code == 0 and exit_.step == 2
    assert exit_.directory == str((tmp_path / "ckpt").resolve())
    assert f"signal {int(signal.SIGUSR1)}" in str(exit_) and dur.tier is None
    [notice] = _events(tmp_path, "preemption")
    assert notice["step"] == 2 and notice["trigger"] == f"signal {int(signal.SIGUSR1)}"
    [save] = _events(tmp_path, "checkpoint_save")
    assert save["step"] == 2 and save["just_in_time"] is True
    # The checkpoint is committed before the exception: a new process finds it.
    again = Durability(_options(tmp_path), keys=KEYS, layer=JaxDeviceLayer())
    step, leaves = again.restore_latest([NamedSharding(mesh, s) for s in SPECS], _structs())
    again.close()
    assert step == 2 and int(leaves[1]) == 2


def test_preemption_before_the_first_step_exits_without_a_checkpoint(tmp_path):
    original = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        dur = Durability(_options(tmp_path, preemption_signals=(signal.SIGUSR2,)), keys=KEYS,
                         layer=JaxDeviceLayer())
        os.kill(os.getpid(), signal.SIGUSR2)
        with pytest.raises(PreemptionExit) as info:
            dur.check_preemption(0, None)
    finally:
        signal.signal(signal.SIGUSR2, original)
    assert info.value.step == 0
    assert _events(tmp_path, "checkpoint_save") == []
    assert not (tmp_path / "ckpt" / "0").exists()


def test_rising_memory_pressure_checkpoints_once_and_keeps_training(tmp_path):
    mesh = h.mesh_of((4, 2))
    layer = _MemoryLayer({1: 0.5, 2: 0.7, 3: 0.95, 4: 0.96, 5: 0.97, 6: 0.98})
    dur = Durability(_options(tmp_path, memory_pressure_fraction=0.9,
                              memory_check_every_steps=1), keys=KEYS, layer=layer)
    for step in range(1, 7):
        dur.after_commit(step, _leaves(step, mesh), mesh.devices.flat)  # never raises
    dur.close()
    assert layer.sampled == [1, 2, 3, 4, 5, 6]
    assert dur.jit_checkpoints == 1  # then a cooldown: no checkpoint on every step
    [trigger] = _events(tmp_path, "preemption")
    assert trigger["step"] == 3 and trigger["trigger"] == "memory pressure (host)"
    [save] = _events(tmp_path, "checkpoint_save")
    assert save["step"] == 3 and save["just_in_time"] is True


def test_memory_is_sampled_at_its_own_cadence_and_high_but_flat_use_does_not_fire(tmp_path):
    mesh = h.mesh_of((4, 2))
    layer = _MemoryLayer({2: 0.95, 4: 0.95, 6: 0.95})
    dur = Durability(_options(tmp_path, memory_pressure_fraction=0.9,
                              memory_check_every_steps=2), keys=KEYS, layer=layer)
    for step in range(1, 7):
        dur.after_commit(step, _leaves(step, mesh), mesh.devices.flat)
    dur.close()
    assert layer.sampled == [2, 4, 6] and dur.jit_checkpoints == 0
    assert _events(tmp_path, "checkpoint_save") == []


def test_close_is_idempotent_and_later_events_are_dropped(tmp_path):
    dur = Durability(_options(tmp_path), keys=KEYS, layer=JaxDeviceLayer())
    dur.emit("step", step=1)
    dur.close()
    dur.close()
    dur.emit("step", step=2)
    assert [e["step"] for e in _events(tmp_path, "step")] == [1]
