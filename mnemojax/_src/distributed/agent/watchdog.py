"""The agent's hang watchdog: pure logic on step times (no JAX, no I/O, no clock)."""

from __future__ import annotations

import collections
import statistics

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

    def reset(self) -> None:
        """Forgets everything (a new worker process starts)."""
        self._intervals.clear()
        self.phase, self.step, self._last, self._fresh = "start", None, None, True

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
