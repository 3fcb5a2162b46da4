"""`distributed.shm`: the double-buffered snapshot slots in shared memory."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory

import pytest

from mnemojax._src.checksum import checksum
from mnemojax._src.distributed import shm
from mnemojax._src.distributed.shm import DATA_AT, SnapshotBuffer
from mnemojax._src.errors import DistributedError, SnapshotCorruptError


@pytest.fixture
def buffer():
    buf = SnapshotBuffer.create(1024)
    yield buf
    buf.close()


def test_publish_flips_and_keeps_previous_step(buffer):
    writer = SnapshotBuffer.attach(buffer.name)  # the worker's side
    try:
        assert buffer.holdings() == {}
        with pytest.raises(KeyError):
            buffer.lend()
        crc = None
        for step in (1, 2, 3):
            crc = writer.publish(step, [b"step-", str(step).encode()])
        assert sorted(buffer.holdings()) == [2, 3]  # newest + the one before it
        step, data, got_crc = buffer.read()
        assert (step, data, got_crc) == (3, b"step-3", crc)
        assert crc == checksum(b"step-3")  # the CRC32C every other reader checks
        assert buffer.read(2)[1] == b"step-2"
        with pytest.raises(KeyError):
            buffer.read(1)
    finally:
        writer.close()
    assert buffer.read()[0] == 3  # the worker detaching does not remove the agent's segment


def test_a_lent_view_is_the_slot_itself_and_knows_when_it_was_rewritten(buffer):
    """`SnapshotBuffer.lend`: no copy (the bytes are the slot's), and `SlotView.intact`
    turns false once the slot is rewritten (by a publish that reuses it)."""
    writer = SnapshotBuffer.attach(buffer.name)
    try:
        for step in (1, 2):
            writer.publish(step, [b"step-", str(step).encode()])
        view = buffer.lend(1)
        assert (view.step, bytes(view.data), view.crc) == (1, b"step-1", checksum(b"step-1"))
        assert view.intact()
        writer.publish(3, [b"step-3"])  # reuses step 1's slot
        assert not view.intact() and bytes(view.data[:6]) == b"step-3"
        view.release()
    finally:
        writer.close()


def test_a_replayed_step_overwrites_the_abandoned_copy_not_the_resumed_one(buffer):
    """A worker ahead at a failure holds steps 5 and 6; the new world resumes from 5 and
    replays 6: its copy of 6 replaces the old world's 6 (an abandoned future), and 5, the
    step the world resumed from, stays (overwriting the older slot would have left only
    two copies of step 6)."""
    writer = SnapshotBuffer.attach(buffer.name)
    try:
        for step in (5, 6):
            writer.publish(step, [b"world-0 step-", str(step).encode()])
        writer.publish(6, [b"world-1 step-6"])
        assert sorted(buffer.holdings()) == [5, 6]
        assert buffer.read()[:2] == (6, b"world-1 step-6")
        assert buffer.read(5)[1] == b"world-0 step-5"
        writer.publish(4, [b"world-2 step-4"])  # resumed from 3 (from a buddy), replays 4
        assert buffer.read()[:2] == (4, b"world-2 step-4")
        newest = buffer.lend()  # the newest written, not the highest step
        assert newest.step == 4 and bytes(newest.data) == b"world-2 step-4"
        newest.release()
        assert sorted(buffer.holdings()) == [4, 6]  # the later of the two ahead goes next
        writer.publish(5, [b"world-2 step-5"])
        assert sorted(buffer.holdings()) == [4, 5]
    finally:
        writer.close()


def test_a_step_published_again_beside_an_empty_slot_keeps_its_first_copy():
    """A fresh process restores step 0 and publishes it again: the empty slot takes it,
    so the agent's one copy of step 0 (which survivors may be reading) stays whole."""
    buffer = SnapshotBuffer.create(1024)
    writer = SnapshotBuffer.attach(buffer.name)
    try:
        writer.publish(0, [b"first step-0"])
        writer.publish(0, [b"again step-0"])
        assert sorted({buffer._header(i)[1] for i in range(2)}) == [0]
        assert buffer.read(0)[1] in (b"first step-0", b"again step-0")
        assert sum(buffer._header(i)[4] for i in range(2)) == 2  # both complete
    finally:
        writer.close()
        buffer.close()


def test_torn_or_corrupt_slot_fails_crc(buffer):
    buffer.publish(7, [b"x" * 100])
    raw = shared_memory.SharedMemory(name=buffer.name)
    resource_tracker.unregister(raw._name, "shared_memory")  # pyright: ignore[reportAttributeAccessIssue]
    try:
        slot = buffer.holdings()[7]
        raw.buf[DATA_AT + slot * buffer.slot_bytes] ^= 0xFF
    finally:
        raw.close()
    with pytest.raises(SnapshotCorruptError, match="CRC32C"):
        buffer.read(7)


@pytest.mark.parametrize("byte", [0, 50, 99])
def test_a_single_flipped_bit_fails_the_read(buffer, byte):
    payload = bytes(range(100))
    buffer.publish(7, [payload[:30], memoryview(payload)[30:]])
    at = DATA_AT + buffer.holdings()[7] * buffer.slot_bytes + byte
    buffer._buf[at] ^= 0x01  # noqa: SLF001 - a memory error, in place
    with pytest.raises(SnapshotCorruptError, match="CRC32C"):
        buffer.read(7)
    buffer._buf[at] ^= 0x01  # noqa: SLF001
    assert buffer.read(7)[1:] == (payload, checksum(payload))


def test_publish_over_capacity_is_typed(buffer):
    with pytest.raises(DistributedError, match="exceeds the slot"):
        buffer.publish(1, [b"x" * 2000])


def test_attach_rejects_foreign_segment():
    raw = shared_memory.SharedMemory(create=True, size=8192)
    try:
        with pytest.raises(DistributedError, match="not a mnemojax"):
            SnapshotBuffer.attach(raw.name)
    finally:
        raw.close()
        raw.unlink()


def test_segments_are_private_to_the_owner(buffer):
    """Mode 0600: another user can neither read a snapshot nor plant one."""
    mode = os.stat(os.path.join("/dev/shm", buffer.name.lstrip("/"))).st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_a_starting_launcher_sweeps_the_segments_of_jobs_whose_lock_nobody_holds():
    """A node killed whole (launcher, agents, workers: ``kill -9``) leaves its segments in
    /dev/shm (a user trial: 3 of 3 such kills); a launcher starting on that host removes
    them: those of a job whose `JobLock` nobody holds (its launcher died, however). A job
    whose lock is held keeps them, whatever its pid; names that are no job's, or a job's
    without a lock file, are left alone."""
    dead, live = shm.job_prefix(), shm.job_prefix()
    subprocess.run([sys.executable, "-c", "import os; from mnemojax._src.distributed import "
                    f"shm; shm.JobLock({dead!r}); os._exit(0)"], check=True, timeout=60)
    live_lock = shm.JobLock(live)
    names = [f"{dead}w1_1", f"{dead}w2_1", f"{live}w1_1", "mnjx99999999999999999999_abcdef_w1",
             f"mnjx{os.getpid()}_0a0b0c_w1_1"]  # no lock file: left alone
    for name in names:  # (a segment is a file there)
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(b"x")
    try:
        removed = shm.sweep_orphans()
        assert sorted(removed) == sorted([f"{dead}w1_1", f"{dead}w2_1", f"{dead}lock"])
        left = [n for n in names if os.path.exists(f"/dev/shm/{n}")]
        assert left == names[2:] and os.path.exists(live_lock.path)
    finally:
        live_lock.release()
        for name in [*names, f"{dead}lock", f"{live}lock"]:
            with contextlib.suppress(FileNotFoundError):
                shm.shm_unlink(name)


def test_a_lock_file_swept_before_it_was_locked_is_made_again(monkeypatch):
    """Another launcher's sweep may take a fresh lock file's lock before its job does, and
    remove it (nobody held it yet): the job's `JobLock` then makes the file again and
    holds that one, so later sweeps see a live job (a lock on a removed file would leave
    the job's segments to leak at its death)."""
    import fcntl

    prefix = shm.job_prefix()
    real_flock, swept = fcntl.flock, []

    def flock(fd, op):
        if not swept:  # the sweep wins the race once: it removes the file
            swept.append(None)
            swept[0] = shm.sweep_if_orphaned(prefix)
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = shm.JobLock(prefix)
    monkeypatch.undo()
    try:
        assert swept == [[f"{prefix}lock"]]
        assert os.path.exists(lock.path)
        assert shm.sweep_if_orphaned(prefix) == [] and os.path.exists(lock.path)  # held
    finally:
        lock.release()
    assert not os.path.exists(lock.path)


def test_a_launcher_sweeps_its_segments_before_it_lets_go_of_its_lock():
    """The launcher's own sweep at its end keeps the lock file (`with_lock=False`) for
    `JobLock.release` after it: killed in between, it leaves a lock file the next
    launcher's orphan sweep finds, never segments without one."""
    prefix = shm.job_prefix()
    lock = shm.JobLock(prefix)
    with open(f"/dev/shm/{prefix}w0_1", "wb") as f:
        f.write(b"x")
    try:
        assert shm.sweep(prefix, with_lock=False) == [f"{prefix}w0_1"]
        assert os.path.exists(lock.path)
    finally:
        lock.release()
        with contextlib.suppress(FileNotFoundError):
            shm.shm_unlink(f"{prefix}w0_1")
    assert not os.path.exists(lock.path)


def test_an_agent_whose_launcher_died_waits_briefly_for_the_lock_then_sweeps():
    """The kernel may signal a launcher's death to its agents (PDEATHSIG) before the dying
    launcher's last thread lets go of the job's lock: every agent then found it held and
    left the lock file behind (`lifecycle_test.py`, once in a suite). An agent whose
    launcher is gone tries again for a while."""
    import threading

    prefix = shm.job_prefix()
    lock = shm.JobLock(prefix)
    assert shm.sweep_if_orphaned(prefix) == [] and os.path.exists(lock.path)  # held
    let_go = threading.Timer(0.3, os.close, args=(lock._fd,))  # (not removing the file)
    let_go.start()
    try:
        assert shm.sweep_if_orphaned(prefix, wait_s=5.0) == [f"{prefix}lock"]
    finally:
        let_go.join()
        lock._fd = -1
    assert not os.path.exists(lock.path)
