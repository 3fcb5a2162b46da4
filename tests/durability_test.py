"""What outlives the process (mnemojax._src.durability.Durability): periodic Orbax saves,
restore onto another mesh, preemption signals, memory-pressure checkpoints, the event log.

Durability is driven directly with state leaves: no step is compiled.
"""

import errno
import os
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.durability import Durability
from mnemojax._src.events import read_events
from mnemojax.errors import CheckpointCorruptError, CheckpointSaveError, PreemptionExit
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


# -- a failed save, a corrupt checkpoint ----------------------------------------------------
class _FailingManager:
    """Wraps the tier's Orbax manager: the saves of `steps` fail with ENOSPC, synchronously
    (from ``save``) or asynchronously (from the wait, leaving Orbax's temporary directory,
    as a disk that fills during the background write does). Each step fails `times` times."""

    def __init__(self, manager, directory, steps, *, when, times=1):
        self._manager, self._directory, self._when = manager, Path(directory), when
        self._left = dict.fromkeys(steps, times)
        self._pending: int | None = None

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def save(self, step, *args, **kwargs):
        if self._left.get(step) and self._when == "sync":
            self._left[step] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        self._manager.save(step, *args, **kwargs)
        self._pending = step

    def wait_until_finished(self):
        self._manager.wait_until_finished()
        step, self._pending = self._pending, None
        if step is not None and self._left.get(step) and self._when == "async":
            self._left[step] -= 1
            (self._directory / str(step)).rename(
                self._directory / f"{step}.orbax-checkpoint-tmp-1234")
            self._manager.reload()
            raise OSError(errno.ENOSPC, "No space left on device")


def _fail(dur, steps, *, when, times=1):
    dur.tier._manager = _FailingManager(dur.tier._manager, dur.tier.directory, steps,
                                        when=when, times=times)


def _on_disk(tmp_path):
    return sorted(p.name for p in (tmp_path / "ckpt").iterdir())


@pytest.mark.parametrize("when", ["sync", "async"])
def test_a_failed_save_is_raised_once_at_the_next_call_and_cleaned(tmp_path, when):
    """Disk full while saving step 2: nothing raises after the commit; the next call's start
    raises CheckpointSaveError(step 2) once, before it does anything; later saves work,
    no temporary directory is left and close() does not raise it again."""
    mesh = h.mesh_of((4, 2))
    dur = Durability(_options(tmp_path, every_steps=2), keys=KEYS, layer=JaxDeviceLayer())
    _fail(dur, [2], when=when)
    dur.after_commit(1, _leaves(1, mesh), mesh.devices.flat)
    dur.after_commit(2, _leaves(2, mesh), mesh.devices.flat)  # never raises
    dur.tier.settle()  # the watcher's wait, made deterministic for the test
    with pytest.raises(CheckpointSaveError, match="step 2") as info:
        dur.check_preemption(2, _leaves(2, mesh))
    err = info.value
    assert err.steps == (2,) and err.step == 2 and err.directory == str(tmp_path / "ckpt")
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
    dur.check_preemption(2, _leaves(2, mesh))  # raised once
    assert _on_disk(tmp_path) == []  # the temporary directory is gone
    for step in (3, 4):
        dur.check_preemption(step - 1, _leaves(step - 1, mesh))
        dur.after_commit(step, _leaves(step, mesh), mesh.devices.flat)
    dur.close()  # no stale error
    assert _on_disk(tmp_path) == ["4"]
    [fault] = _events(tmp_path, "fault")
    assert fault["step"] == 2 and fault["classification"] == "checkpoint_failed"
    again = Durability(_options(tmp_path), keys=KEYS, layer=JaxDeviceLayer())
    step, leaves = again.restore_latest([NamedSharding(mesh, s) for s in SPECS], _structs())
    again.close()
    assert step == 4 and int(leaves[1]) == 4


def test_a_failure_not_yet_raised_is_raised_by_close_once(tmp_path):
    mesh = h.mesh_of((4, 2))
    dur = Durability(_options(tmp_path, every_steps=1), keys=KEYS, layer=JaxDeviceLayer())
    _fail(dur, [2], when="async")
    dur.after_commit(1, _leaves(1, mesh), mesh.devices.flat)
    dur.after_commit(2, _leaves(2, mesh), mesh.devices.flat)  # the last step
    with pytest.raises(CheckpointSaveError) as info:
        dur.close()
    assert info.value.steps == (2,) and dur.tier is None and dur.events is None
    dur.close()  # already raised: not again
    assert _on_disk(tmp_path) == ["1"]


def test_a_failed_preemption_checkpoint_is_raised_then_retried(tmp_path):
    original = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        mesh = h.mesh_of((4, 2))
        dur = Durability(_options(tmp_path, preemption_signals=(signal.SIGUSR1,)), keys=KEYS,
                         layer=JaxDeviceLayer())
        _fail(dur, [2], when="sync", times=2)
        os.kill(os.getpid(), signal.SIGUSR1)
        dur.after_commit(2, _leaves(2, mesh), mesh.devices.flat)  # committed: not raised
        with pytest.raises(CheckpointSaveError, match="preemption checkpoint"):
            dur.check_preemption(2, _leaves(2, mesh))  # the retry fails too: raised
        with pytest.raises(PreemptionExit) as info:
            dur.check_preemption(2, _leaves(2, mesh))  # written at the third try
    finally:
        signal.signal(signal.SIGUSR1, original)
    assert info.value.step == 2 and _on_disk(tmp_path) == ["2"]


def test_temporary_directories_of_a_crashed_run_are_removed_on_open(tmp_path):
    (tmp_path / "ckpt" / "3.orbax-checkpoint-tmp-99" / "state").mkdir(parents=True)
    dur = Durability(_options(tmp_path), keys=KEYS, layer=JaxDeviceLayer())
    assert dur.restore_latest(None, _structs()) is None
    dur.close()
    assert _on_disk(tmp_path) == []


def _truncate_data(step_dir: Path) -> None:
    for f in (step_dir / "state" / "d").iterdir():
        os.truncate(f, f.stat().st_size // 2)


def _garble_data(step_dir: Path) -> None:
    for f in (step_dir / "state" / "d").iterdir():
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))


def _garble_metadata(step_dir: Path) -> None:
    (step_dir / "mnemojax" / "metadata").write_text('{"step": ')


@pytest.mark.parametrize("corrupt", [_truncate_data, _garble_data, _garble_metadata])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, corrupt):
    mesh = h.mesh_of((4, 2))
    dur = Durability(_options(tmp_path, every_steps=1, max_to_keep=3), keys=KEYS,
                     layer=JaxDeviceLayer())
    for step in (1, 2, 3):
        dur.after_commit(step, _leaves(step, mesh), mesh.devices.flat)
    dur.close()
    corrupt(tmp_path / "ckpt" / "3")
    again = Durability(_options(tmp_path), keys=KEYS, layer=JaxDeviceLayer())
    step, leaves = again.restore_latest([NamedSharding(mesh, s) for s in SPECS], _structs())
    again.close()
    assert step == 2
    for got, want in zip(leaves, _host(2), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    [fault] = _events(tmp_path, "fault")
    assert fault["step"] == 3 and fault["classification"] == "checkpoint_corrupt"


def test_every_checkpoint_corrupt_is_a_typed_error(tmp_path):
    mesh = h.mesh_of((4, 2))
    dur = Durability(_options(tmp_path, every_steps=1, max_to_keep=3), keys=KEYS,
                     layer=JaxDeviceLayer())
    for step in (1, 2, 3):
        dur.after_commit(step, _leaves(step, mesh), mesh.devices.flat)
    dur.close()
    for step, corrupt in zip((1, 2, 3), (_truncate_data, _garble_metadata, _garble_data),
                             strict=True):
        corrupt(tmp_path / "ckpt" / str(step))
    again = Durability(_options(tmp_path), keys=KEYS, layer=JaxDeviceLayer())
    with pytest.raises(CheckpointCorruptError, match="no checkpoint") as info:
        again.restore_latest([NamedSharding(mesh, s) for s in SPECS], _structs())
    again.close()
    assert info.value.steps == (3, 2, 1) and len(info.value.errors) == 3
    assert isinstance(info.value, ValueError)


def test_a_notice_reaches_every_step_and_the_first_to_exit_checkpoints_the_others(tmp_path):
    """Two resilient steps in one process: one handler serves both watches, the step that
    exits first checkpoints the other's last complete step, whose next call exits without
    saving again; the handler before them comes back when the last one closes."""
    original = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        mesh = h.mesh_of((4, 2))
        first, second = (Durability(_options(tmp_path / name,
                                             preemption_signals=(signal.SIGUSR1,)),
                                    keys=KEYS, layer=JaxDeviceLayer())
                         for name in ("first", "second"))
        second.committed = lambda: (5, _leaves(5, mesh))
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(PreemptionExit) as info:
            first.check_preemption(2, _leaves(2, mesh))
        assert info.value.step == 2
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_IGN  # second still watches
        with pytest.raises(PreemptionExit) as info:
            second.check_preemption(5, _leaves(5, mesh))
        assert info.value.step == 5
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN  # restored after the last
    finally:
        signal.signal(signal.SIGUSR1, original)
    for name, step in (("first", 2), ("second", 5)):
        assert [e["step"] for e in _events(tmp_path / name, "checkpoint_save")] == [step]
        again = Durability(_options(tmp_path / name), keys=KEYS, layer=JaxDeviceLayer())
        restored, leaves = again.restore_latest([NamedSharding(mesh, s) for s in SPECS],
                                                _structs())
        again.close()
        assert restored == step and int(leaves[1]) == step


def test_processes_agree_on_the_step_to_stop_after(tmp_path):
    """Several processes: the notice's first proposer fixes the step (here a peer's 7);
    this process trains on to it, then checkpoints it and exits."""
    proposals = []

    def agree(proposal):
        proposals.append(proposal)
        return 7

    original = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        mesh = h.mesh_of((4, 2))
        dur = Durability(_options(tmp_path, preemption_signals=(signal.SIGUSR2,)), keys=KEYS,
                         layer=JaxDeviceLayer(), agree_stop=agree)
        os.kill(os.getpid(), signal.SIGUSR2)
        dur.check_preemption(5, _leaves(5, mesh))  # trains on
        dur.after_commit(6, _leaves(6, mesh), mesh.devices.flat)
        dur.check_preemption(6, _leaves(6, mesh))
        with pytest.raises(PreemptionExit) as info:
            dur.after_commit(7, _leaves(7, mesh), mesh.devices.flat)
    finally:
        signal.signal(signal.SIGUSR2, original)
    assert proposals == [6] and info.value.step == 7
    assert [e["step"] for e in _events(tmp_path, "checkpoint_save")] == [7]


def test_a_step_called_again_after_its_preemption_exit_exits_again(tmp_path):
    original = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        mesh = h.mesh_of((4, 2))
        dur = Durability(_options(tmp_path, preemption_signals=(signal.SIGUSR1,)), keys=KEYS,
                         layer=JaxDeviceLayer())
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(PreemptionExit):
            dur.check_preemption(3, _leaves(3, mesh))
        with pytest.raises(PreemptionExit) as again:  # the exit was caught: never trains on
            dur.check_preemption(3, _leaves(3, mesh))
    finally:
        signal.signal(signal.SIGUSR1, original)
    assert again.value.step == 3
    assert [e["step"] for e in _events(tmp_path, "checkpoint_save")] == [3]


def test_the_agreed_stop_step_is_proposed_again_in_a_new_world(tmp_path):
    proposals = []

    def agree(proposal):
        proposals.append(proposal)
        return proposal

    original = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        mesh = h.mesh_of((4, 2))
        dur = Durability(_options(tmp_path, preemption_signals=(signal.SIGUSR2,)), keys=KEYS,
                         layer=JaxDeviceLayer(), agree_stop=agree)
        os.kill(os.getpid(), signal.SIGUSR2)
        dur.check_preemption(5, _leaves(5, mesh))  # agrees on 6, trains on
        dur.reopen_tier(JaxDeviceLayer())  # a new world: its service starts empty
        dur.close()
    finally:
        signal.signal(signal.SIGUSR2, original)
    assert proposals == [6, 6]


def test_a_watch_closed_off_the_main_thread_keeps_the_handler_before_it():
    import threading

    from mnemojax._src.triggers import PreemptionWatch

    got = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    try:
        watch = PreemptionWatch((signal.SIGUSR1,))
        closer = threading.Thread(target=watch.close)
        closer.start()
        closer.join()  # off the main thread: the handler cannot be restored there
        again = PreemptionWatch((signal.SIGUSR1,))
        again.close()
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGUSR1)  # no watch left: the handler before them
        assert got == [signal.SIGUSR1] and not watch.notice.is_set()
    finally:
        signal.signal(signal.SIGUSR1, original)

