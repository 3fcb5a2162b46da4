"""Tells a survivor blocked in a collective that a peer died, within milliseconds.

On CPU a gloo collective cannot be cancelled. A survivor that was exchanging with the dead
process fails at once ("Connection closed by peer"); the others wait on live peers that are
themselves stuck, until ``--xla_cpu_collective_timeout_seconds`` (20 s under ``mnemojax
launch``). Dropping the failed survivor's backend does not free them: its gloo pairs live
on as long as its own blocked execution does. The launcher, though, learns of a death from
the dead worker's agent in ~20 ms.

So each worker runs a `PeerWatch`: a daemon thread that long-polls the launcher
(`Coordinator.watch`) for a death in its current world. When one comes, it fails the
step's pending wait (registered with `abortable`) with the same ``JaxRuntimeError`` a
failed collective raises, and the resilient step takes the one existing path: a failed
collective, then the agreement. The blocked execution is abandoned: it keeps its thread
and the old world's CPU client until gloo gives up at the collective timeout, harmlessly,
while this process agrees and joins the next world (every new world has its own
coordination service, hence its own gloo rendezvous and sockets). At exit the process
waits for such a collective to end (at most the collective timeout), so that the thread
blocked in it never returns into a finalising interpreter.

No false alarm can come from load: the watch reports only deaths the launcher knows of
(a worker's exit by a signal, a lost agent, an eviction), and members that left the world
for the next agreement (they saw it fail where the launcher saw no death, e.g. the agreed
state's holders died before they could fetch it), never a slow peer. The
collective timeout stays as the bound for what the launcher cannot see.

Nothing happens on import; JAX is imported only to build the error.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

from mnemojax._src.distributed.worker.coordinator_client import Coordinator

log = logging.getLogger("mnemojax")

# The text of the error a watched wait fails with (tests and logs look for it).
TOLD_BY_LAUNCHER = "told by the launcher"


@dataclasses.dataclass(frozen=True)
class Notice:
    """One death the watch heard of: world ``generation`` lost ``failed`` (none when it
    re-forms larger: ``regrow``, or when members ``left`` it for the next agreement, having
    seen it fail); ``aborted`` waits were failed because of it (0: the step was not waiting
    then)."""

    generation: int
    failed: tuple[int, ...]
    time: float  # time.time() when it arrived
    aborted: int
    regrow: bool = False
    left: tuple[int, ...] = ()


class _Pending:
    """The waits that a notice may fail: future -> the generation it was registered in."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waits: dict[concurrent.futures.Future, int] = {}
        self.generation: Callable[[], int] | None = None  # the active watch's world
        # generation -> what was heard of it: (failed workers, regrow). Each wait or step
        # it fails gets an error of its own (`_Heard.error`): one raised instance would
        # keep, in its traceback, the frames (and the old world's arrays) of every raise.
        self.failed: dict[int, _Heard] = {}
        # Blocked in jaxlib, abandoned: (thread, what it is blocked in, joined until when
        # (monotonic)).
        self.left_behind: list[tuple[threading.Thread, str, float]] = []
        self.exit_wait_s = 30.0
        self.exit_join = False  # `_join_left_behind` is registered with atexit

    def abort(self, generation: int, heard: _Heard) -> int:
        with self.lock:
            for g in [g for g in self.failed if g < generation]:  # older worlds: over
                del self.failed[g]
            self.failed[generation] = heard
            doomed = [f for f, g in self.waits.items() if g == generation]
        return sum(_fail(f, heard.error(generation)) for f in doomed)


@dataclasses.dataclass(frozen=True)
class _Heard:
    """A death (or a regrow, or members that left) heard of in one world."""

    failed: tuple[int, ...]
    regrow: bool = False
    left: tuple[int, ...] = ()

    def error(self, generation: int, *, started: bool = True) -> BaseException:
        return peer_died_error(generation, self.failed, regrow=self.regrow, started=started,
                               left=self.left)


_pending = _Pending()


def _fail(future: concurrent.futures.Future, error: BaseException) -> bool:
    try:
        future.set_exception(error)
        return True
    except concurrent.futures.InvalidStateError:  # its result came first
        return False


class WaitHandle:
    """What `abortable` yields."""

    def __init__(self, future: concurrent.futures.Future, generation: int | None):
        self._future = future
        self._generation = generation

    def leave_behind(self, thread: threading.Thread | None) -> None:
        """The thread that was to complete the aborted wait stays blocked in the old
        world's collective until gloo gives up: joined at exit (see `_join_left_behind`).
        It must end once that collective returns."""
        if thread is not None:
            leave_behind(thread, self._generation)

    @property
    def aborted(self) -> bool:
        """The watch failed the wait: the thread that was to complete it is still blocked
        in the old world's collective (abandon it)."""
        f = self._future
        return (f.done() and not f.cancelled()
                and getattr(f.exception(), "mnemojax_peer_watch", False))


@contextlib.contextmanager
def abortable(future: concurrent.futures.Future) -> Iterator[WaitHandle]:
    """While in the block, a death in the current world fails ``future`` (see module doc);
    a death already heard of fails it at once. Without a running `PeerWatch`, nothing."""
    with _pending.lock:
        generation = _pending.generation() if _pending.generation is not None else None
        if generation is not None:
            _pending.waits[future] = generation
        heard = _pending.failed.get(generation) if generation is not None else None
    if heard is not None and generation is not None:
        _fail(future, heard.error(generation))
    try:
        yield WaitHandle(future, generation)
    finally:
        with _pending.lock:
            _pending.waits.pop(future, None)


def known_death() -> BaseException | None:
    """The error of a death already heard of in the current world (None without one, or
    without a running `PeerWatch`). A step must not start in such a world: its collectives
    could only be abandoned, and a peer that died mid-step may have left messages on the
    gloo pairs that a fresh collective would read (see `proxy.DeviceProxy.run`)."""
    with _pending.lock:
        if _pending.generation is None:
            return None
        generation = _pending.generation()
        heard = _pending.failed.get(generation)
    return None if heard is None else heard.error(generation, started=False)


def leave_behind(thread: threading.Thread, generation: int | None, *, what: str | None = None,
                 wait_s: float | None = None) -> None:
    """``thread`` stays blocked in jaxlib (``what``: by default an abandoned collective of
    world ``generation``; an abandoned connect) until that call gives
    up: it is joined at exit, at most ``wait_s`` from now (default ``exit_wait_s``: the
    collective timeout and a margin), see `_join_left_behind`. It must end once that call
    returns."""
    what = what or f"a collective of world {generation}"
    wait_s = _pending.exit_wait_s if wait_s is None else wait_s
    with _pending.lock:
        _pending.left_behind = [t for t in _pending.left_behind if t[0].is_alive()]
        _pending.left_behind.append((thread, what, time.monotonic() + wait_s))
    _ensure_exit_join()


def _ensure_exit_join() -> None:
    with _pending.lock:
        if _pending.exit_join:
            return
        _pending.exit_join = True
    atexit.register(_join_left_behind)


def _join_left_behind() -> None:
    """At exit (an ``atexit`` hook, run before the interpreter finalises): waits for the
    threads left blocked in jaxlib, each until its bound (`leave_behind`). Such a thread
    that returned from C++ while the interpreter finalises would be ended by a forced
    unwind that jaxlib's frames do not let through: the process aborts (measured: exit
    status 134 instead of the job's own)."""
    with _pending.lock:
        threads = list(_pending.left_behind)
    for thread, what, until in threads:
        if thread.is_alive() and (wait_s := until - time.monotonic()) > 1.0:
            log.warning("mnemojax: waiting at exit, at most %.0f s, for %s that was "
                        "abandoned (jaxlib cannot cancel it, and its thread must not return "
                        "into a finalising interpreter)", wait_s, what)
        thread.join(max(0.0, until - time.monotonic()))
        if thread.is_alive():
            log.warning("mnemojax: %s, abandoned earlier, is still blocked at exit", what)


def peer_died_error(generation: int, failed: tuple[int, ...], *, regrow: bool = False,
                    started: bool = True, left: tuple[int, ...] = ()) -> BaseException:
    """The error a watched wait fails with: a non-retryable ``JaxRuntimeError``, which the
    resilient step under a session takes for a peer failure (``regrow``: no one died,
    the world re-forms larger; the same path recovers it, and does not charge it to the
    recovery budget: ``error.mnemojax_regrow``; ``left``: no death known, but these members
    left for the next agreement). ``started``: the step was running (its collectives are
    abandoned), or it was not started at all."""
    import jax
    if regrow:
        what = f"world {generation} re-forms larger (spares fill it back to its first size)"
    elif failed or not left:
        what = f"workers {list(failed)} of world {generation} died (or left the job)"
    else:
        what = (f"workers {list(left)} of world {generation} left it for a new agreement "
                "(they saw it fail)")
    fate = ("this step's collectives are abandoned" if started
            else "this step is not started in that world")
    error = jax.errors.JaxRuntimeError(f"UNKNOWN: mnemojax: {what} ({TOLD_BY_LAUNCHER}); {fate}")
    error.mnemojax_peer_watch = True  # type: ignore[attr-defined]
    error.mnemojax_regrow = regrow  # type: ignore[attr-defined]  # not charged to the budget
    return error


class PeerWatch:
    """The watcher thread of one worker (see module doc). One per process.

    Args:
        coordinator: the launcher (`Coordinator.watch`).
        generation: returns this worker's current world (it changes after a recovery).
        poll_s: how long one long poll may wait before it is asked again.
        retry_s: pause after the launcher could not be reached.
        exit_wait_s: at exit, how long to wait for collectives abandoned after a death to
            fail (the collective timeout and a margin; `_join_left_behind`).

    Attributes:
        notices: every death heard of, in order.
    """

    def __init__(self, coordinator: Coordinator, generation: Callable[[], int], *,
                 poll_s: float = 60.0, retry_s: float = 1.0, exit_wait_s: float = 30.0):
        self._coordinator, self._generation = coordinator, generation
        self._poll_s, self._retry_s, self._exit_wait_s = poll_s, retry_s, exit_wait_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.notices: list[Notice] = []

    def start(self) -> PeerWatch:
        with _pending.lock:
            _pending.generation = self._generation
            _pending.failed.clear()
            _pending.exit_wait_s = self._exit_wait_s
        _ensure_exit_join()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="mnemojax-peer-watch")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching (the thread ends after its current poll; it is a daemon)."""
        self._stop.set()
        with _pending.lock:
            if _pending.generation is self._generation:
                _pending.generation = None
            if _pending.exit_join and not any(t.is_alive() for t, _, _ in _pending.left_behind):
                _pending.exit_join = False  # nothing left to join at exit
                atexit.unregister(_join_left_behind)

    def _run(self) -> None:
        while not self._stop.is_set():
            generation = self._generation()
            if generation in _pending.failed:  # heard of: wait for the next world
                self._stop.wait(0.05)
                continue
            try:
                reply = self._coordinator.watch(generation=generation, timeout_s=self._poll_s)
            except Exception as e:  # noqa: BLE001 - the launcher is gone or restarting
                log.debug("peer watch: %s", e)
                self._stop.wait(self._retry_s)
                continue
            if (reply.failed or reply.regrow or reply.left) and not self._stop.is_set():
                self.notify(generation, reply.failed, regrow=reply.regrow, left=reply.left)

    def notify(self, generation: int, failed: tuple[int, ...], *,
               regrow: bool = False, left: tuple[int, ...] = ()) -> Notice:
        """Fails the waits of world ``generation`` (and any later wait in it)."""
        aborted = _pending.abort(generation, _Heard(tuple(failed), regrow, tuple(left)))
        notice = Notice(generation, tuple(failed), time.time(), aborted, regrow, tuple(left))
        self.notices.append(notice)
        if regrow:
            log.warning("mnemojax: world %d re-forms larger (%s); %d step(s) waiting on "
                        "it stopped", generation, TOLD_BY_LAUNCHER, aborted)
        elif left and not failed:
            log.warning("mnemojax: workers %s left world %d for a new agreement (%s); %d "
                        "step(s) waiting on them stopped", list(left), generation,
                        TOLD_BY_LAUNCHER, aborted)
        else:
            # (A process the new mesh left idle leaves the job: it is told as a death.)
            log.warning("mnemojax: workers %s of world %d died or left the job (%s); %d "
                        "step(s) waiting on them stopped", list(failed), generation,
                        TOLD_BY_LAUNCHER, aborted)
        return notice
