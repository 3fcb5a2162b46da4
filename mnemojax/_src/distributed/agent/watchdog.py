"""The agent's hang watchdog: pure logic on step times (no JAX, no I/O, no clock)."""

from __future__ import annotations

import collections
import statistics

TRAIN = "train"  # the only phase the watchdog judges; startup, compile, recovery are exempt


class HangWatchdog:
    """Declares a hang when no step completes for ``factor`` x the median step time.

    Only the ``train`` phase is watched: compiling and recovering can take far longer than a
    step. The first interval after entering ``train`` is not a step time (it includes the
    first execution), so the median starts from the second. Time the worker says it spent
    between calls of the step (`step_bounds`; it says so after a second there) does not
    count: the user's own code (an eval, a save) is no hang however long it takes; there
    the worker says it is alive every second or so, and one that stops saying it for
    ``min_s`` (a frozen process) is hung.

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
        self._inside = True  # in a call of the step (a worker that never says: always)
        self._seen = 0.0  # its last word between calls (`step_bounds`)

    def reset(self) -> None:
        """Forgets everything (a new worker process starts)."""
        self._intervals.clear()
        self.phase, self.step, self._last, self._fresh = "start", None, None, True
        self._inside, self._seen = True, 0.0

    def step_bounds(self, inside: bool, now: float) -> None:
        """The worker entered (``inside``) or left a call of its step, or says again that
        it is between calls (alive). The time between calls is not part of the next
        step's interval."""
        if inside and not self._inside and self._last is not None:
            self._last = now
        self._inside, self._seen = inside, now

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
        """Seconds without progress (in a call of the step) or without a word (between
        calls) if that is a hang now, else None."""
        if self.phase != TRAIN:
            return None
        if not self._inside:  # the user's code: judged by the worker's signs of life only
            silent = now - self._seen
            return silent if silent > self.min_s else None
        limit = self.threshold_s()
        if limit is None or self._last is None:
            return None
        idle = now - self._last
        return idle if idle > limit else None
