"""Pure logic of the agent's hang watchdog and buddy replica store (no JAX, no I/O)."""

from __future__ import annotations

import collections
import statistics
import threading
import zlib

from mnemojax._src.distributed.errors import ChecksumError

TRAIN = "train"  # the only phase the watchdog judges; startup, compile, recovery are exempt


class HangWatchdog:
    """Declares a hang when no step completes for ``factor`` x the median step time.

    Only the ``train`` phase is watched: compiling and recovering can take far longer than a
    step. The first interval after entering ``train`` is not a step time (it includes the
    first execution), so the median starts from the second.

    Args:
        factor: multiple of the median step time that counts as a hang.
        min_s: floor of the hang threshold (a tiny median on a noisy VM is not a hang).
        window: number of recent step times the median is taken over.
    """

    def __init__(self, *, factor: float = 10.0, min_s: float = 5.0, window: int = 50):
        self.factor, self.min_s = factor, min_s
        self._intervals: collections.deque[float] = collections.deque(maxlen=window)
        self.phase = "start"
        self.step: int | None = None
        self._last: float | None = None
        self._fresh = True

    def set_phase(self, phase: str, now: float) -> None:
        """Enters a phase (``start``, ``compile``, ``recover``, ``train``)."""
        self.phase, self._last, self._fresh = phase, now, True

    def progress(self, step: int, now: float) -> None:
        """Records a completed step."""
        if self.phase == TRAIN and self._last is not None and not self._fresh:
            self._intervals.append(now - self._last)
        self._fresh = self.phase != TRAIN
        self.step, self._last = step, now

    def median_s(self) -> float | None:
        return statistics.median(self._intervals) if self._intervals else None

    def threshold_s(self) -> float | None:
        med = self.median_s()
        return None if med is None else max(self.factor * med, self.min_s)

    def hung(self, now: float) -> float | None:
        """Seconds without progress if that is a hang now, else None."""
        limit = self.threshold_s()
        if self.phase != TRAIN or limit is None or self._last is None:
            return None
        idle = now - self._last
        return idle if idle > limit else None


class ReplicaStore:
    """Snapshots received from ring neighbours: ``origin -> {step: (payload, crc)}``.

    Keeps the ``keep`` newest steps per origin, so the previous step stays available while a
    newer copy is in flight or when the survivors resume one step back.
    """

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._by_origin: dict[int, dict[int, tuple[bytes, int]]] = {}
        self._lock = threading.Lock()  # replication puts while a survivor asks or fetches

    def put(self, origin: int, step: int, payload: bytes, crc: int) -> None:
        """Stores a copy after checking its CRC32 (raises `ChecksumError` if it fails)."""
        if zlib.crc32(payload) != crc:
            raise ChecksumError(f"replica of worker {origin} step {step} fails its CRC32 check")
        with self._lock:
            held = self._by_origin.setdefault(origin, {})
            held[step] = (bytes(payload), crc)
            for old in sorted(held)[:-self.keep]:
                del held[old]

    def nbytes(self) -> int:
        """Bytes of the copies held."""
        with self._lock:
            return sum(len(p) for held in self._by_origin.values() for p, _ in held.values())

    def get(self, origin: int, step: int) -> tuple[bytes, int]:
        """The copy of ``origin``'s snapshot at ``step`` (KeyError if not held)."""
        with self._lock:
            return self._by_origin[origin][step]

    def verify(self) -> tuple[list[tuple[int, int, bytes]], list[tuple[int, int]]]:
        """Checks every copy against its CRC32 again (memory can flip after the put).

        Returns:
            ``(origin, step, payload)`` of the good copies, and ``(origin, step)`` of the
            corrupt ones, which are dropped (never served).
        """
        with self._lock:
            copies = [(o, s, p, c) for o, held in self._by_origin.items()
                      for s, (p, c) in held.items()]
        good, bad = [], []
        for origin, step, payload, crc in copies:  # the CRCs outside the lock
            if zlib.crc32(payload) == crc:
                good.append((origin, step, payload))
            else:
                bad.append((origin, step))
                with self._lock:
                    held = self._by_origin.get(origin, {})
                    if held.get(step, (None,))[0] is payload:
                        del held[step]
        return good, bad
