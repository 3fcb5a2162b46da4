"""The worker's side of its agent: snapshot publishing, progress, phase, held copies,
fetching copies.

The worker writes each snapshot straight into the agent's shared memory (no socket copy),
then sends a small ``published`` message, which is also the watchdog's progress signal and
triggers buddy replication. No JAX here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from mnemojax._src import checksum as checksums
from mnemojax._src.distributed import transport, wire
from mnemojax._src.distributed.shm import SLOT_MARGIN, SnapshotBuffer, nbytes_of
from mnemojax._src.distributed.snapshot_codec import Box
from mnemojax._src.errors import ProtocolError, SnapshotCorruptError, StateUnavailableError

# Between calls of the step, the worker tells its agent it is alive this often (the hang
# watchdog's floor is 5 s at least: `HangWatchdog.hung`).
PING_S = 1.0


class AgentClient:
    """One worker's connection to its agent.

    Args:
        address: the agent's ``host:port`` (``MNEMOJAX_AGENT``).
        headroom: slot capacity as a multiple of the first snapshot's size (plus 4 KiB for
            the metadata's step and world numbers). A world's snapshots keep one size, and a
            larger one (a smaller world's larger shares) gets a new segment, so 1.0: each
            slot costs the host one copy, not more.
        secret: the job secret (`auth`); the agent must prove it too.
    """

    def __init__(self, address: str, *, secret: bytes, headroom: float = 1.0):
        self.address, self.headroom = address, headroom
        self._secret = secret
        self._sock = transport.connect(address, secret=secret)
        self._lock = threading.Lock()
        self.buffer: SnapshotBuffer | None = None
        self._inside, self._last_said = True, time.monotonic()  # (`in_step`)
        self._told_outside = False  # the agent was told the worker is between calls
        self._pinger: threading.Thread | None = None
        self._closed = threading.Event()

    def _ensure_capacity(self, nbytes: int, budget_bytes: int | None) -> SnapshotBuffer:
        """Slots for a snapshot of ``nbytes``: new ones when these are too small, or more
        than twice the size needed (a world grown back to smaller shares), so the host
        never keeps slots sized for a world that is gone (`SnapshotHolder.allocate`)."""
        want = int(nbytes * self.headroom) + SLOT_MARGIN
        if self.buffer is None or not nbytes <= self.buffer.slot_bytes <= 2 * want:
            with self._lock:
                transport.send(self._sock, wire.Alloc(nbytes=want, budget_bytes=budget_bytes))
                reply = transport.expect(transport.recv(self._sock)[0], wire.Allocated)
            if self.buffer is not None:
                self.buffer.close()
            self.buffer = SnapshotBuffer.attach(reply.name)
        return self.buffer

    def publish(self, step: int, parts: Sequence[bytes | memoryview], *,
                budget_bytes: int | None = None, in_series: bool = False) -> int:
        """Writes the snapshot of ``step`` into shared memory and tells the agent.

        Args:
            budget_bytes: host memory the agent may use for snapshots (its slots and the
                replicas it keeps for its ring neighbour); passed on when it allocates.
            in_series: the worker waits for this copy to reach the buddy before its next
                step (`SnapshotOptions.replicate_in_series`), so the buddy may make room
                for it (`wire.Replica.make_room`).

        Returns:
            The payload's checksum (CRC32C, `checksum.checksum`).
        """
        nbytes = nbytes_of(parts)
        crc = self._ensure_capacity(nbytes, budget_bytes).publish(step, parts)
        with self._lock:
            transport.send(self._sock, wire.Published(step=step, in_series=in_series))
        return crc

    def await_replicated(self, timeout_s: float) -> str | None:
        """Waits until the agent's ring buddy holds its newest snapshot
        (`wire.AwaitReplicated`; the agent bounds the wait by its hang watchdog).

        Returns:
            None once it has (or there is nothing to send), else why not.
        """
        with self._lock:
            # The answer may take up to ``timeout_s``: past the connection's own timeout.
            previous = self._sock.gettimeout()
            self._sock.settimeout(timeout_s + 10.0)
            try:
                transport.send(self._sock, wire.AwaitReplicated(timeout_s=timeout_s))
                reply = transport.expect(transport.recv(self._sock)[0], wire.Replicated)
            finally:
                self._sock.settimeout(previous)
        return None if reply.caught_up else reply.detail

    def hold(self, step: int, parts: Sequence[bytes | memoryview], *,
             timeout_s: float) -> str | None:
        """Hands the agent a held copy of ``step`` (the concatenation of ``parts``), kept
        until the next publish (`wire.Hold`), on a connection of its own: a copy too slow
        for ``timeout_s`` leaves the worker's link to its agent as it was.

        Returns:
            None once the agent holds it, else why not (over the budget, a timeout).
        """
        crc = 0
        for part in parts:
            crc = checksums.checksum(memoryview(part).cast("B"), crc)
        try:
            transport.request(self.address, wire.Hold(step=step, crc=crc), wire.Ok, parts,
                              secret=self._secret, timeout_s=timeout_s)
        except (OSError, ConnectionError, ProtocolError) as e:
            return str(e)
        return None

    def phase(self, phase: str) -> None:
        """Tells the watchdog the phase (``compile``, ``recover``, ``train``)."""
        with self._lock:
            transport.send(self._sock, wire.Phase(phase=phase))

    def in_step(self, inside: bool) -> None:
        """Says whether the worker is inside a call of its step (`wire.InStep`), lazily:
        nothing is sent per step. A thread tells the agent that the worker is between
        calls once it has been there `PING_S`, and again every `PING_S` (the watchdog takes
        a worker that stops saying it, a frozen process, for hung); entering a call is
        sent only after that. A fast loop sends nothing: its short time between calls
        counts as the step's, as it did before the watchdog knew of calls."""
        with self._lock:
            self._inside, self._last_said = inside, time.monotonic()
            if inside and self._told_outside:
                self._told_outside = False
                transport.send(self._sock, wire.InStep(inside=True))
        if not inside and self._pinger is None:
            self._pinger = threading.Thread(target=self._ping, daemon=True,
                                            name="mnemojax-agent-ping")
            self._pinger.start()

    def _ping(self) -> None:
        while not self._closed.wait(PING_S / 2):
            with self._lock:
                if self._inside or time.monotonic() - self._last_said < PING_S:
                    continue
                try:
                    transport.send(self._sock, wire.InStep(inside=False))
                except OSError:  # the connection is gone: the worker's own paths see it
                    return
                self._last_said, self._told_outside = time.monotonic(), True

    def close(self) -> None:
        self._closed.set()
        if self.buffer is not None:
            self.buffer.close()
        self._sock.close()


def fetch_snapshot(addresses: Sequence[str], origin: int, step: int, *, secret: bytes,
                   timeout_s: float = 30.0, header_only: bool = False,
                   boxes: Sequence[Box] | None = None) -> tuple[bytearray, str]:
    """Fetches worker ``origin``'s snapshot of ``step`` from the first agent that has it
    (and proves the job secret ``secret``: an agent that cannot is skipped).

    Args:
        header_only: fetch only its metadata (`snapshot_codec.header`).
        boxes: fetch only its parts inside these ``(leaf, index)`` regions
            (`snapshot_codec.select`), as a payload of their own.

    Returns:
        (payload, address of the agent it came from).

    Raises:
        StateUnavailableError: no agent returned a copy whose checksum (CRC32C) checks.
    """
    errors = []
    for addr in addresses:
        try:
            get = wire.Get(origin=origin, step=step, header_only=header_only,
                           boxes=None if boxes is None else tuple(boxes))
            reply, data = transport.request(addr, get,
                                            wire.Snapshot, secret=secret, timeout_s=timeout_s)
            if checksums.checksum(data) != reply.crc:
                raise SnapshotCorruptError(f"copy from {addr} fails its {checksums.NAME} check")
            return data, addr
        except (OSError, ConnectionError, ProtocolError, SnapshotCorruptError) as e:
            errors.append(f"{addr}: {e}")
    raise StateUnavailableError(f"no copy of worker {origin} step {step}: {errors}")
