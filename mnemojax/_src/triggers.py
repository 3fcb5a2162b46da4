"""Warnings that come before a failure: preemption notices and rising memory pressure.

Both trigger a just-in-time persistent checkpoint. A preemption notice (SIGTERM by default
on spot and preemptible machines) then ends the job cleanly; memory pressure keeps it
training.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

log = logging.getLogger("mnemojax")

# What `signal.signal` accepts and returns (typeshed's alias for it is private).
_SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class PreemptionWatch:
    """Turns the preemption signals into a flag the training thread checks between steps.

    The handler only sets the flag (signal handlers must not do real work); the step that
    is running finishes, then the runtime checkpoints and exits. One handler per signal
    serves every live watch of the process (each resilient step has one), so a notice
    reaches all of them. It is installed only from the main thread (Python's rule), and
    the handler it replaced is restored when the last watch closes.
    """

    def __init__(self, signals: Sequence[int]):
        self.notice = threading.Event()
        self.signal_received: int | None = None
        self._signals: tuple[int, ...] = ()
        if threading.current_thread() is not threading.main_thread():
            log.warning("mnemojax: not on the main thread; preemption signals not watched")
            return
        self._signals = tuple(signals)
        for sig in self._signals:
            _FANOUT.add(sig, self)

    def set(self, signum: int) -> None:
        self.signal_received = signum
        self.notice.set()

    def close(self) -> None:
        for sig in self._signals:
            _FANOUT.remove(sig, self)
        self._signals = ()


class _SignalFanout:
    """The process's one handler per watched signal, forwarding to every live watch."""

    def __init__(self):
        self._watches: dict[int, list[PreemptionWatch]] = {}
        self._previous: dict[int, _SignalHandler] = {}

    def add(self, sig: int, watch: PreemptionWatch) -> None:
        watches = self._watches.setdefault(sig, [])
        if not watches:
            previous = signal.signal(sig, self._handle)
            # Still ours when the last watch closed off the main thread: keep the first.
            self._previous.setdefault(sig, previous)
        watches.append(watch)

    def remove(self, sig: int, watch: PreemptionWatch) -> None:
        watches = self._watches.get(sig, [])
        if watch in watches:
            watches.remove(watch)
            if not watches and threading.current_thread() is threading.main_thread():
                signal.signal(sig, self._previous.pop(sig))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        watches = list(self._watches.get(signum, ()))
        for watch in watches:
            watch.set(signum)
        if watches:
            return
        # No watch left (the last closed off the main thread): what was there before.
        previous = self._previous.pop(signum, signal.SIG_DFL)
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)


_FANOUT = _SignalFanout()


def host_memory_fraction() -> float | None:
    """This process's resident memory over the limit it runs under (cgroup, else RAM)."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None
    limit = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
            if text.isdigit() and int(text) < 1 << 60:
                limit = int(text)
                break
        except OSError:
            continue
    if limit is None:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return rss / limit


class MemoryWatch:
    """Fires when memory use is above `fraction` of its limit and rose over the window.

    Samples come from the device layer (`memory_fractions()`: host and, where the runtime
    reports them, device memory). After firing it waits `cooldown` samples, so a job that
    stays under pressure is not checkpointed on every step.
    """

    def __init__(self, fraction: float, *, window: int = 3, cooldown: int = 10):
        self.fraction = fraction
        self._history: dict[str, collections.deque[float]] = {}
        self._window = window
        self._cooldown = cooldown
        self._quiet = 0

    def observe(self, fractions: dict[str, float]) -> str | None:
        """Records one sample per source; returns the source under pressure, or None."""
        if self._quiet:
            self._quiet -= 1
        fired = None
        for source, value in fractions.items():
            hist = self._history.setdefault(source, collections.deque(maxlen=self._window))
            hist.append(value)
            rising = len(hist) == self._window and all(
                b >= a for a, b in zip(hist, list(hist)[1:], strict=False)) and hist[-1] > hist[0]
            if fired is None and not self._quiet and value >= self.fraction and rising:
                fired = source
        if fired is not None:
            self._quiet = self._cooldown
        return fired
