"""The snapshot copies an agent holds, within its host's snapshot budget.

Its own worker's two slots live in shared memory (`shm.SnapshotBuffer`, created here, so
they outlive the worker); its ring predecessor's replicas live in process memory
(`replica_store.ReplicaStore`). At a peer failure its worker may also hand it a *held*
copy (`accept_held`): the regions of the last good state the worker's devices hold that
its snapshots lack; it is never replicated, and goes at the worker's next publish. The
worker gives the budget (``host_memory_budget_bytes``) when it asks for its slots; a
replica or held copy that would take the slots plus the copies held over it is refused,
and the first refused replica is reported to the launcher. No JAX here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from mnemojax._src import checksum as checksums
from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agent.replica_store import ReplicaStore
from mnemojax._src.distributed.agreement import CopyInfo, held_origin
from mnemojax._src.distributed.shm import SLOT_MARGIN, SlotView, SnapshotBuffer, agent_peak_bytes
from mnemojax._src.distributed.snapshot_codec import read_meta
from mnemojax._src.errors import SnapshotCorruptError

logger = logging.getLogger("mnemojax")


class SnapshotHolder:
    """Every copy one agent holds.

    Args:
        worker_id: its worker's id (the origin of the copies in its slots).
        shm_prefix: the job's shared-memory prefix (the launcher sweeps it).
        report: sends an event to the launcher.
    """

    def __init__(self, worker_id: int, *, shm_prefix: str,
                 report: Callable[[wire.AgentEvent], None]):
        self.worker_id, self.shm_prefix, self._report = worker_id, shm_prefix, report
        self.buffer: SnapshotBuffer | None = None
        # The segment a bigger one replaced: its complete copies are served until the new
        # one holds a complete snapshot (`published`), so no moment holds none.
        self._retired: SnapshotBuffer | None = None
        self.replicas = ReplicaStore()
        self.held: tuple[int, bytearray, int] | None = None  # (step, payload, crc)
        self.budget_bytes: int | None = None  # host memory for snapshots (from the worker)
        self._segments = 0
        self._refused_replicas = False
        # Whether its worker publishes in series (`wire.Published.in_series`): its copies
        # then make room at the buddy before they arrive.
        self.in_series = False
        self._lock = threading.Lock()  # the buffer: replaced on alloc, read by other threads
        # Views lent out of each segment (`lend`), and the segments to close once theirs
        # are back (a mapping with views out cannot be closed).
        self._lent: dict[int, int] = {}
        self._closing: list[SnapshotBuffer] = []

    def allocate(self, nbytes: int, budget_bytes: int | None) -> wire.Allocated:
        """Slots of at least ``nbytes``: a new segment replaces one too small or more than
        twice as large (a world grown back to smaller shares); the old one's copies stay
        readable until the first publish into the new one, so the host briefly holds
        both."""
        with self._lock:
            self.budget_bytes = budget_bytes
            if self.buffer is None or not nbytes <= self.buffer.slot_bytes <= 2 * nbytes:
                if self._retired is not None:
                    self._close(self._retired)
                self._retired = self.buffer
                self._segments += 1
                self.buffer = SnapshotBuffer.create(
                    nbytes, name=f"{self.shm_prefix}w{self.worker_id}_{self._segments}")
            return wire.Allocated(name=self.buffer.name, slot_bytes=self.buffer.slot_bytes)

    def _peak_with(self, nbytes: int) -> int:
        """Host memory for snapshots with a new copy of ``nbytes`` received, before the
        copies it may outdate go (`ReplicaStore.put` drops the outdated one first): the
        peak as the worker counts it (`agent_peak_bytes`), with every other copy held."""
        own = self.buffer.slot_bytes - SLOT_MARGIN if self.buffer is not None else 0
        held = len(self.held[1]) if self.held is not None else 0
        return (agent_peak_bytes(own, 0) if self.buffer is not None else 0) \
            + self.replicas.nbytes() + held + nbytes

    def accept_replica(self, replica: wire.Replica, payload: bytearray) -> wire.Ok | wire.ErrorReply:
        """Keeps a buddy's copy if it passes its CRC32C and fits the budget; over the
        budget, a former predecessor's copies from older worlds make room first
        (`ReplicaStore.evict_for`)."""
        try:  # its world: a new world's copies outrank an old world's later steps
            generation = int(read_meta(payload).get("generation", 0))
        except (ValueError, TypeError) as e:
            return wire.ErrorReply(message=f"the replica of worker {replica.origin} step "
                                           f"{replica.step} is not a snapshot: {e}")
        peak = self._peak_with(len(payload))
        checked = False
        if self.budget_bytes is not None and peak > self.budget_bytes:
            checked = True
            if checksums.checksum(payload) != replica.crc:  # a bad copy takes no room
                return wire.ErrorReply(message=f"replica of worker {replica.origin} step "
                                               f"{replica.step} fails its {checksums.NAME} "
                                               "check")
            freed = self.replicas.evict_for(replica.origin, replica.step, generation,
                                            peak - self.budget_bytes)
            if freed:
                logger.info("mnemojax agent %d: dropped %d bytes of former predecessors' "
                            "copies from worlds before %d to keep worker %d's step %d "
                            "within host_memory_budget_bytes", self.worker_id, freed,
                            generation, replica.origin, replica.step)
                peak = self._peak_with(len(payload))
        if self.budget_bytes is not None and peak > self.budget_bytes:
            if not self._refused_replicas:
                self._refused_replicas = True
                self._report(wire.ReplicaRefused(
                    worker_id=self.worker_id, origin=replica.origin, step=replica.step,
                    budget_bytes=self.budget_bytes))
            return wire.ErrorReply(message=f"a replica of {len(payload)} bytes would exceed "
                                           f"host_memory_budget_bytes={self.budget_bytes}")
        try:
            self.replicas.put(replica.origin, replica.step, payload, replica.crc,
                              generation=generation, checked=checked)
        except SnapshotCorruptError as e:
            return wire.ErrorReply(message=str(e))
        return wire.Ok()

    def accept_held(self, hold: wire.Hold, payload: bytearray) -> wire.Ok | wire.ErrorReply:
        """Keeps its worker's held copy (`wire.Hold`) in place of any earlier one, if it is
        a snapshot payload, passes its CRC32C and fits the budget with every other copy."""
        what = f"the held copy of worker {self.worker_id} step {hold.step}"
        if checksums.checksum(payload) != hold.crc:
            return wire.ErrorReply(message=f"{what} fails its {checksums.NAME} check")
        try:
            read_meta(payload)
        except (ValueError, TypeError) as e:
            return wire.ErrorReply(message=f"{what} is not a snapshot: {e}")
        with self._lock:
            self.held = None  # replaced: an earlier one is of an older failure
            peak = self._peak_with(len(payload))
            if self.budget_bytes is not None and peak > self.budget_bytes:
                return wire.ErrorReply(
                    message=f"{what} ({len(payload)} bytes) would take the host's snapshot "
                            f"memory to {peak} bytes, over host_memory_budget_bytes="
                            f"{self.budget_bytes}")
            self.held = (hold.step, payload, hold.crc)
        return wire.Ok()

    @contextlib.contextmanager
    def lend(self, *, prefer: int | None = None,
             step: int | None = None) -> Iterator[SlotView]:
        """Its own worker's newest complete snapshot (or ``prefer``'s, when held; or only
        ``step``'s) as a view of its slot, unchecked and uncopied, for the duration of the
        ``with``: what the replicator sends (its buddy checks the CRC32C, and the sender
        `SlotView.intact`), and what the server cuts regions from. The segment stays
        mapped meanwhile, even if a bigger one replaces it.

        Raises:
            KeyError: none yet (or none of ``step``).
        """
        with self._lock:
            view = None
            for wanted in (step,) if step is not None else (prefer, None):
                for buffer in self._buffers():
                    try:
                        view = buffer.lend(wanted)
                        break
                    except KeyError:
                        continue
                if view is not None:
                    break
            if view is None:
                raise KeyError("no complete snapshot yet")
            lent = view._buffer  # noqa: SLF001
            self._lent[id(lent)] = self._lent.get(id(lent), 0) + 1
        try:
            yield view
        finally:
            # (Views cut from it are not exports of it: this succeeds even while one of
            # them lives on, e.g. in a failed send's traceback; the unmap waits for them.)
            view.release()
            with self._lock:
                self._lent[id(lent)] -= 1
                if not self._lent[id(lent)]:
                    del self._lent[id(lent)]
                self._close_pending()

    def _close(self, buffer: SnapshotBuffer) -> None:
        """Closes a segment now, or once the views lent out of it are back (call with
        the lock held)."""
        self._closing.append(buffer)
        self._close_pending()

    def _close_pending(self) -> None:
        """Closes the segments waiting for their views (call with the lock held). One
        that still cannot be unmapped (a view cut from a loan outlived it, e.g. in a
        pending traceback) stays queued for the next call; its name is unlinked at once
        (`SnapshotBuffer.close`), so the memory goes with the last view."""
        for buffer in list(self._closing):
            if self._lent.get(id(buffer)):
                continue
            try:
                buffer.close()
            except BufferError:
                continue
            self._closing.remove(buffer)

    def published(self, *, in_series: bool = False) -> None:
        """Its worker published into the current slots (``in_series``: with
        `SnapshotOptions.replicate_in_series`): the retired segment goes, and the held copy
        (its snapshots cover a newer step now)."""
        with self._lock:
            self.held = None
            self.in_series = in_series
            if self._retired is not None:
                self._close(self._retired)
                self._retired = None

    def _buffers(self) -> list[SnapshotBuffer]:
        """The current segment, then the retired one (call with the lock held)."""
        return [b for b in (self.buffer, self._retired) if b is not None]

    def get(self, origin: int, step: int) -> tuple[bytes | bytearray, int]:
        """The copy of worker ``origin``'s snapshot of ``step``: (payload, crc32).

        Raises:
            KeyError: not held. SnapshotCorruptError: it fails its check.
        """
        if origin == held_origin(self.worker_id):
            with self._lock:
                if self.held is None or self.held[0] != step:
                    raise KeyError(step)
                _, data, crc = self.held
            return data, crc
        if origin != self.worker_id:
            return self.replicas.get(origin, step)
        with self._lock:
            for buffer in self._buffers():
                try:
                    _, data, crc = buffer.read(step)
                    return data, crc
                except KeyError:
                    continue
        raise KeyError(step)

    def _check_slot(self, step: int) -> CopyInfo | wire.CorruptCopy | None:
        """Its own worker's copy of ``step``, checked in its slot: what it covers, or why
        it is not counted; None when the slot no longer holds it."""
        try:
            with self.lend(step=step) as view:
                error, info = None, None
                if checksums.checksum(view.data) != view.crc:
                    error = f"snapshot of step {step} fails its {checksums.NAME} check"
                else:
                    try:
                        info = CopyInfo.from_meta(self.worker_id, read_meta(view.data))
                    except (ValueError, KeyError, TypeError) as e:
                        error = f"metadata: {e}"
                if not view.intact():
                    error = f"step {step}'s slot was rewritten while it was checked"
        except KeyError:  # rewritten since it was listed
            return None
        if error is not None or info is None:
            return wire.CorruptCopy(origin=self.worker_id, step=step,
                                    error=error or "no metadata")
        return info

    def verified_copies(self) -> wire.Holdings:
        """Every copy held (own slots, buddies' replicas, the held copy), each checked
        against its CRC32C now, with what it covers; a corrupt copy is listed apart and
        never counted."""
        found: list[tuple[int, bytes | bytearray]] = []
        corrupt: list[wire.CorruptCopy] = []
        copies: list[CopyInfo] = []
        with self._lock:
            steps = sorted({step for buffer in self._buffers() for step in buffer.holdings()})
            held = self.held
        # Checked in place, not copied out (an agreement adds no copy of the slots to the
        # host's memory), and outside the lock (the worker's publishes and the
        # replicator's loans go on meanwhile).
        for step in steps:
            checked = self._check_slot(step)
            if isinstance(checked, CopyInfo):
                copies.append(checked)
            elif checked is not None:
                corrupt.append(checked)
        if held is not None:
            step, payload, crc = held
            if checksums.checksum(payload) == crc:
                found.append((held_origin(self.worker_id), payload))
            else:
                corrupt.append(wire.CorruptCopy(origin=held_origin(self.worker_id), step=step,
                                                error="held copy fails its CRC32C check"))
                with self._lock:
                    if self.held is held:
                        self.held = None
        good, bad = self.replicas.verify()
        found += [(origin, payload) for origin, _, payload in good]
        corrupt += [wire.CorruptCopy(origin=o, step=s, error="replica fails its CRC32C check")
                    for o, s in bad]
        for origin, payload in found:
            try:
                copies.append(CopyInfo.from_meta(origin, read_meta(payload)))
            except (ValueError, KeyError, TypeError) as e:  # not a snapshot payload
                corrupt.append(wire.CorruptCopy(origin=origin, step=None,
                                                error=f"metadata: {e}"))
        for c in corrupt:
            logger.warning("agent %d: corrupt copy of worker %s step %s: %s", self.worker_id,
                           c.origin, c.step, c.error)
        return wire.Holdings(copies=tuple(copies), corrupt=tuple(corrupt))

    def close(self) -> None:
        """Unmaps and removes its own slots."""
        with self._lock:
            for buffer in self._buffers():
                buffer.unlink()  # at once, even while a view of it is out
                self._close(buffer)
            self.buffer = self._retired = None
