"""A double-buffered snapshot slot pair in POSIX shared memory (no JAX).

The agent creates the segment and outlives the worker; the worker attaches and publishes.
Layout: page 0 holds the headers, then two data slots of ``slot_bytes`` each. A slot header is
``seq, step, nbytes, crc, complete``; ``crc`` is the payload's CRC32C (`checksum`). Publishing
step k writes an incomplete slot if there is one, else a slot holding step k or a later one
(an abandoned future: a new world resumed earlier and replays k), else the older slot: clear
``complete``, write the data, write step/size/CRC, then set ``complete`` and a new ``seq``
(the flip). So the newest complete snapshot of an earlier step is never overwritten, and the
step before stays readable in the other slot until the next publish. Readers copy, re-read
the header (seqlock) and check the CRC, so a torn read is detected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import secrets
import struct
import time
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from mnemojax._src import checksum as checksums
from mnemojax._src.errors import DistributedError, SnapshotCorruptError

log = logging.getLogger("mnemojax")

# Version 2: CRC32C payload checksums (version 1 had zlib's CRC32). A segment of the other
# version is refused by `attach` instead of failing every read as corrupt.
MAGIC = b"MNJXSNP2"
_GLOBAL = struct.Struct("<8sQ")  # magic, slot_bytes
_SLOT = struct.Struct("<QqQII")  # seq, step, nbytes, crc (CRC32C), complete
_SLOT_HEADER_AT = 64
DATA_AT = 4096
NUM_SLOTS = 2
SLOT_MARGIN = 4096  # a slot's bytes beyond one copy: the metadata's step and world numbers


def agent_peak_bytes(own: int, replica: int, *, in_series: bool = False) -> int:
    """An agent's snapshot memory at its peak, for its worker's copies of ``own`` bytes and
    its ring predecessor's of ``replica``: two slots (each one copy plus `SLOT_MARGIN`; the
    newest is sent to the buddy straight from its slot, `SnapshotBuffer.lend`), the two
    replicas kept and the one being received; ``in_series`` (the predecessor publishes
    with `SnapshotOptions.replicate_in_series`), two replicas: the agent drops the older
    when a newer one starts to arrive (`ReplicaStore.make_room`). The worker refuses to
    publish over its budget by this figure, and the agent refuses a replica by the
    copies it actually holds."""
    return NUM_SLOTS * (own + SLOT_MARGIN) + (2 if in_series else 3) * replica


def shm_unlink(name: str) -> None:
    """Removes a segment by name without involving the resource tracker."""
    os.unlink(os.path.join("/dev/shm", name.lstrip("/")))


_LOCK = "lock"  # a job's lock file: "/dev/shm/<prefix>lock" (`JobLock`)


def sweep(prefix: str, names: Sequence[str] | None = None, *,
          with_lock: bool = True) -> list[str]:
    """Removes every segment whose name starts with ``prefix`` (of ``names``, default: what
    /dev/shm holds), the job's lock file last (a sweep cut short is done again; not with
    ``with_lock=False``: its holder removes it, `JobLock.release`); returns their names.
    Never raises: a name it cannot remove is logged."""
    if names is None:
        try:
            names = os.listdir("/dev/shm")
        except OSError:
            return []
    lock = f"{prefix}{_LOCK}"
    ours = sorted((n for n in names if n.startswith(prefix) and (with_lock or n != lock)),
                  key=lambda n: n == lock)
    return [n for n in ours if _unlink_quietly(n)]


_LOCK_NAME = re.compile(r"^(mnjx\d+_[0-9a-f]{6}_)lock$")


class JobLock:
    """The segments of a job (every name starting with ``prefix``, `job_prefix`) are alive
    while its launcher holds this lock: an exclusive ``flock`` on ``/dev/shm/<prefix>lock``,
    held from the job's start to its end; the kernel lets go of it when the launcher dies,
    however it dies. `sweep_orphans` removes the segments of jobs whose lock nobody holds.
    A lock, not the launcher's pid: pids are reused, and containers that share /dev/shm
    may not share a pid namespace."""

    def __init__(self, prefix: str):
        self.path = os.path.join("/dev/shm", f"{prefix}{_LOCK}")
        while True:
            self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            # A sweep in another launcher may have taken the fresh file's lock before this
            # one did, and removed the file: the lock would then hold nothing that sweeps
            # can see. Held only once the path still names the file locked.
            try:
                if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                    return
            except FileNotFoundError:
                pass
            os.close(self._fd)

    def release(self) -> None:
        """Removes the lock file and lets go of the lock (the job has ended). Idempotent."""
        if self._fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = -1


def job_prefix() -> str:
    """A new prefix for the segments of the job this process launches."""
    return f"mnjx{os.getpid()}_{secrets.token_hex(3)}_"


def sweep_orphans() -> list[str]:
    """Removes the segments of jobs whose launcher is gone (nobody holds their `JobLock`);
    returns their names. A launcher sweeps its own job's at its end, and its agents theirs
    (`sweep_if_orphaned` for the lock file when the launcher died first); a node killed
    whole (its launcher, agents and workers at once, ``kill -9``) leaves them behind, and
    a node started again on that host would pile them up: a launcher calls this when it
    starts. Only this user's jobs, and only those with a lock file (a job without one is
    left alone). Never raises: a name it cannot remove is logged."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    removed: list[str] = []
    for name in names:
        if (match := _LOCK_NAME.match(name)) is not None:
            removed += sweep_if_orphaned(match.group(1), names)
    return removed


def sweep_if_orphaned(prefix: str, names: Sequence[str] | None = None, *,
                      wait_s: float = 0.0) -> list[str]:
    """Removes every segment of the job ``prefix`` and its lock file if nobody holds its
    `JobLock` (its launcher is gone) and it is this user's; returns their names. An agent
    calls it as it ends: when the launcher was killed first, the last agent out removes
    the lock file. A lock still held is tried again for up to `wait_s` (an agent whose
    launcher died: the kernel may signal the death before the dying launcher's other
    threads have let go of the lock). Never raises."""
    path = os.path.join("/dev/shm", f"{prefix}{_LOCK}")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # none, gone meanwhile, or another user's
        return []
    deadline = time.monotonic() + wait_s
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return []
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # its launcher runs (or another agent sweeps)
                if time.monotonic() >= deadline:
                    return []
                time.sleep(0.05)
        if os.fstat(fd).st_nlink == 0:  # (another agent swept it meanwhile)
            return []
        return sweep(prefix, names)
    finally:
        os.close(fd)


def _unlink_quietly(name: str) -> bool:
    try:
        shm_unlink(name)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("mnemojax: could not remove /dev/shm/%s: %s", name, e)
        return False


def _untrack(shm: shared_memory.SharedMemory) -> memoryview:
    """Takes the segment away from this process's resource tracker; returns its memory.

    Python 3.11 registers every segment, created or attached, with the tracker, which
    unlinks it when the process ends: a worker's death would remove its agent's segment.
    Segments are unlinked explicitly instead (`SnapshotBuffer.close`, `sweep`).
    """
    # ``_name`` is the name the tracker registered (with its leading slash); CPython has
    # no public accessor for it (3.13 adds ``track=False`` instead).
    resource_tracker.unregister(shm._name, "shared_memory")  # pyright: ignore[reportAttributeAccessIssue]  # noqa: SLF001
    if shm.buf is None:  # only after close()
        raise DistributedError(f"shared memory {shm.name!r} is closed")
    return shm.buf



def nbytes_of(parts: Sequence[bytes | memoryview]) -> int:
    """Bytes of a payload given as parts to concatenate (`snapshot_codec.pack`)."""
    return sum(len(memoryview(p).cast("B")) for p in parts)


@dataclasses.dataclass
class SlotView:
    """A complete snapshot lent out of its slot without a copy (`SnapshotBuffer.lend`):
    ``data`` is a view of the shared memory, valid until `release`."""

    step: int
    data: memoryview
    crc: int
    _buffer: SnapshotBuffer
    _slot: int
    _header: tuple[int, int, int, int, int]

    def intact(self) -> bool:
        """Whether the slot still holds this snapshot (not rewritten since it was lent:
        the seqlock check of `SnapshotBuffer.read`)."""
        return self._buffer._header(self._slot) == self._header  # noqa: SLF001

    def release(self) -> None:
        self.data.release()


class SnapshotBuffer:
    """Two snapshot slots in one shared-memory segment.

    Attributes:
        name: the segment's name (pass it to `attach`).
        slot_bytes: capacity of one slot.
    """

    def __init__(self, shm: shared_memory.SharedMemory, buf: memoryview, slot_bytes: int,
                 owner: bool):
        self._shm, self._buf = shm, buf
        self.name = shm.name
        self.slot_bytes = slot_bytes
        self._owner = owner

    @classmethod
    def create(cls, slot_bytes: int, name: str | None = None) -> SnapshotBuffer:
        """Creates a zeroed segment with two slots (the agent does this).

        Args:
            slot_bytes: capacity of one slot.
            name: segment name; the launcher gives agents a job prefix so that it can remove
                the segments of agents that were killed (SIGKILL runs no cleanup).
        """
        if slot_bytes < 1:
            raise DistributedError(f"slot_bytes={slot_bytes} is invalid: expected >= 1")
        # Mode 0600 (CPython's default, only narrowed by the umask): other users can
        # neither read a worker's snapshot nor plant one (shm_test checks it).
        shm = shared_memory.SharedMemory(name=name, create=True,
                                         size=DATA_AT + NUM_SLOTS * slot_bytes)
        buf = _untrack(shm)
        _GLOBAL.pack_into(buf, 0, MAGIC, slot_bytes)
        for i in range(NUM_SLOTS):
            _SLOT.pack_into(buf, _SLOT_HEADER_AT + i * _SLOT.size, 0, -1, 0, 0, 0)
        return cls(shm, buf, slot_bytes, owner=True)

    @classmethod
    def attach(cls, name: str) -> SnapshotBuffer:
        """Attaches to an agent's segment (the worker does this)."""
        shm = shared_memory.SharedMemory(name=name)
        buf = _untrack(shm)  # the agent owns it: the worker's death must not remove it
        magic, slot_bytes = _GLOBAL.unpack_from(buf, 0)
        if magic != MAGIC:
            shm.close()
            raise DistributedError(f"shared memory {name!r} is not a mnemojax snapshot buffer")
        return cls(shm, buf, slot_bytes, owner=False)

    def _header(self, i: int) -> tuple[int, int, int, int, int]:
        return _SLOT.unpack_from(self._buf, _SLOT_HEADER_AT + i * _SLOT.size)

    def _set_header(self, i: int, seq: int, step: int, nbytes: int, crc: int, complete: int):
        _SLOT.pack_into(self._buf, _SLOT_HEADER_AT + i * _SLOT.size,
                        seq, step, nbytes, crc, complete)

    def publish(self, step: int, parts: Sequence[bytes | memoryview]) -> int:
        """Writes one snapshot (the concatenation of ``parts``) and flips it to newest.

        Returns:
            The payload's checksum (CRC32C, `checksum.checksum`).
        """
        nbytes = nbytes_of(parts)
        if nbytes > self.slot_bytes:
            raise DistributedError(f"snapshot of {nbytes} bytes exceeds the slot "
                                   f"({self.slot_bytes} bytes)")
        headers = [self._header(i) for i in range(NUM_SLOTS)]
        # An incomplete slot first (never written, or torn); then a complete copy of this
        # step or a later one: an abandoned future (a new world resumed from an earlier
        # step and replays this one) or this step again, so the step the world resumed
        # from stays; then the older copy.
        incomplete = [i for i in range(NUM_SLOTS) if not headers[i][4]]
        ahead = [i for i in range(NUM_SLOTS) if headers[i][4] and headers[i][1] >= step]
        target = min(incomplete or ahead or range(NUM_SLOTS), key=lambda i: headers[i][0])
        seq = max(h[0] for h in headers) + 1
        self._set_header(target, seq, -1, 0, 0, 0)  # invalidate before touching the data
        at, crc = DATA_AT + target * self.slot_bytes, 0
        for part in parts:
            view = memoryview(part).cast("B")
            # numpy's copy lets go of the GIL (a slice assignment would hold it), so a
            # publish on a thread does not hold up the training thread's dispatch.
            np.copyto(np.frombuffer(self._buf, np.uint8, len(view), at),
                      np.frombuffer(view, np.uint8))
            crc = checksums.checksum(view, crc)
            at += len(view)
        self._set_header(target, seq, step, nbytes, crc, 1)  # the flip
        return crc

    def holdings(self) -> dict[int, int]:
        """Complete snapshots held: ``{step: slot}``."""
        out = {}
        for i in range(NUM_SLOTS):
            _, step, _, _, complete = self._header(i)
            if complete:
                out[step] = i
        return out

    def read(self, step: int | None = None, *,
             verify: bool = True) -> tuple[int, bytes, int]:
        """Copies out the newest complete snapshot, or the one of ``step``.

        Args:
            verify: check the copy against its CRC32C (off: the receiver checks it, as a
                buddy does every replica).

        Returns:
            (step, payload, its CRC32C).

        Raises:
            SnapshotCorruptError: the copy does not match its CRC, or the slot changed while copying.
            KeyError: no complete snapshot (of that step).
        """
        headers = [(i, *self._header(i)) for i in range(NUM_SLOTS)]
        done = [h for h in headers if h[5] and (step is None or h[2] == step)]
        if not done:
            raise KeyError(step)
        i, seq, s, nbytes, crc, _ = max(done, key=lambda h: h[1])
        at = DATA_AT + i * self.slot_bytes
        data = bytes(self._buf[at:at + nbytes])
        if self._header(i) != (seq, s, nbytes, crc, 1):
            raise SnapshotCorruptError(f"slot {i} was rewritten while step {s} was being read")
        if verify and checksums.checksum(data) != crc:
            raise SnapshotCorruptError(f"snapshot of step {s} fails its {checksums.NAME} check")
        return s, data, crc

    def lend(self, step: int | None = None) -> SlotView:
        """The newest complete snapshot, or the one of ``step``, as a view of its slot (no
        copy, no check): for a reader that checks `SlotView.intact` after using it, or
        whose receiver checks the CRC32C (the replicator: its buddy checks every copy).
        The caller must `SlotView.release` it before this buffer is closed.

        Raises:
            KeyError: no complete snapshot (of that step).
        """
        headers = [(i, self._header(i)) for i in range(NUM_SLOTS)]
        done = [(i, h) for i, h in headers if h[4] and (step is None or h[1] == step)]
        if not done:
            raise KeyError(step)
        i, header = max(done, key=lambda ih: ih[1][0])
        at = DATA_AT + i * self.slot_bytes
        return SlotView(header[1], self._buf[at:at + header[2]], header[3], self, i, header)

    def flip_bit(self, step: int | None = None) -> list[int]:
        """Flips one bit in the middle of every complete snapshot (or only ``step``'s),
        leaving the headers alone: what a memory error does. For fault injection.

        Returns:
            The steps whose copies are now corrupt.
        """
        hit = []
        for i in range(NUM_SLOTS):
            _, s, nbytes, _, complete = self._header(i)
            if complete and nbytes and (step is None or s == step):
                self._buf[DATA_AT + i * self.slot_bytes + nbytes // 2] ^= 0x10
                hit.append(s)
        return sorted(hit)

    def close(self) -> None:
        """Unmaps the segment; the owner also unlinks it (also when unmapping fails: a
        `BufferError` while a view of it is still out)."""
        try:
            self._shm.close()
        finally:
            self.unlink()

    def unlink(self) -> None:
        """The owner removes the segment's name (its memory goes with the last mapping)."""
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                shm_unlink(self._shm.name)
