"""`worker.peer_watch`: a death the launcher reports fails the step's pending wait."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import jax
import pytest

from mnemojax._src import proxy
from mnemojax._src.distributed import wire
from mnemojax._src.distributed.worker import peer_watch
from mnemojax._src.distributed.worker.peer_watch import TOLD_BY_LAUNCHER, PeerWatch


class _Launcher:
    """A fake `Coordinator.watch`: answers each poll with the next scripted reply, then
    blocks until stopped."""

    def __init__(self, *replies: tuple[int, ...] | wire.WorldFailed):
        self.replies = list(replies)
        self.polls: list[int] = []
        self.released = threading.Event()

    def watch(self, *, generation: int, timeout_s: float) -> wire.WorldFailed:
        self.polls.append(generation)
        if self.replies:
            reply = self.replies.pop(0)
            return reply if isinstance(reply, wire.WorldFailed) else wire.WorldFailed(
                generation=generation, failed=reply)
        self.released.wait(timeout_s)
        return wire.WorldFailed(generation=generation, failed=())


@pytest.fixture
def world():
    """A watch over a world whose generation the test sets; stopped afterwards."""
    generation = {"g": 0}
    watches, launchers = [], []

    def start(launcher) -> PeerWatch:
        w = PeerWatch(launcher, lambda: generation["g"], poll_s=5.0, retry_s=0.01)
        watches.append(w)
        launchers.append(launcher)
        return w

    yield generation, start
    for w in watches:
        w.stop()
    for launcher in launchers:  # the watch threads end now
        launcher.released.set()
    for w in watches:
        if w._thread is not None:
            w._thread.join(5)


def test_without_a_watch_a_wait_is_left_alone():
    future: concurrent.futures.Future = concurrent.futures.Future()
    with peer_watch.abortable(future) as handle:
        future.set_result(3)
    assert future.result() == 3 and not handle.aborted


def test_a_notice_fails_the_pending_wait_of_its_world(world):
    _, start = world
    watch = start(_Launcher()).start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    with peer_watch.abortable(future) as handle:
        notice = watch.notify(0, (1,))
        with pytest.raises(jax.errors.JaxRuntimeError, match=TOLD_BY_LAUNCHER):
            future.result(timeout=1)
    assert handle.aborted and notice.aborted == 1 and watch.notices == [notice]
    later: concurrent.futures.Future = concurrent.futures.Future()
    with peer_watch.abortable(later):  # the world is known to be broken: at once
        assert isinstance(later.exception(timeout=0), jax.errors.JaxRuntimeError)


def test_the_next_world_is_not_failed_by_the_old_worlds_notice(world):
    generation, start = world
    watch = start(_Launcher()).start()
    watch.notify(0, (1,))
    generation["g"] = 1
    future: concurrent.futures.Future = concurrent.futures.Future()
    with peer_watch.abortable(future) as handle:
        future.set_result("ok")
    assert future.result() == "ok" and not handle.aborted


def test_a_regrow_fails_the_pending_wait_though_no_one_died(world):
    """The world re-forms larger (spares fill it back): the step takes the same path as
    after a death, so every member agrees and joins the larger world."""
    _, start = world
    watch = start(_Launcher(wire.WorldFailed(generation=0, failed=(), regrow=True))).start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    with peer_watch.abortable(future):
        error = future.exception(timeout=5)
        assert "world 0 re-forms larger" in str(error)
        assert error.mnemojax_regrow  # type: ignore[union-attr]  # not charged (api)
    [notice] = watch.notices
    assert notice.regrow and notice.failed == ()
    assert not peer_watch.peer_died_error(0, (1,)).mnemojax_regrow  # type: ignore[attr-defined]


def test_a_member_that_left_for_the_agreement_fails_the_pending_wait(world):
    """No death is known, but a member left for the next agreement (it saw the world
    fail): the step fails its wait as after a death, charged to the budget like one."""
    _, start = world
    watch = start(_Launcher(wire.WorldFailed(generation=0, failed=(), left=(2,)))).start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    with peer_watch.abortable(future):
        error = future.exception(timeout=5)
        assert "workers [2] of world 0 left it for a new agreement" in str(error)
        assert not error.mnemojax_regrow  # type: ignore[union-attr]
    [notice] = watch.notices
    assert notice.left == (2,) and notice.failed == () and not notice.regrow


def test_a_result_that_came_first_is_kept(world):
    _, start = world
    watch = start(_Launcher()).start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    with peer_watch.abortable(future) as handle:
        future.set_result("done")
        assert watch.notify(0, (2,)).aborted == 0
    assert future.result() == "done" and not handle.aborted


def test_the_thread_polls_the_launcher_and_then_waits_for_the_next_world(world):
    generation, start = world
    launcher = _Launcher((), (2,))  # a quiet poll, then worker 2 died
    watch = start(launcher).start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    with peer_watch.abortable(future):
        assert "workers [2] of world 0" in str(future.exception(timeout=5))
    assert [(n.generation, n.failed) for n in watch.notices] == [(0, (2,))]
    generation["g"] = 1  # recovered: the watch polls the new world
    for _ in range(200):
        if 1 in launcher.polls:
            break
        threading.Event().wait(0.01)
    assert launcher.polls[:2] == [0, 0] and 1 in launcher.polls
    launcher.released.set()


def test_the_step_waiter_gives_up_its_stuck_thread(world):
    """`proxy._Waiter`: the wait raises at once; the thread blocked in the old world's
    collective is abandoned, and its late result raises nothing."""
    _, start = world
    watch = start(_Launcher()).start()
    stuck, finished = threading.Event(), threading.Event()

    def block(outputs, *, step, devices):
        del step, devices
        stuck.wait(10)
        finished.set()
        return outputs

    waiter = proxy._Waiter()
    timer = threading.Timer(0.1, watch.notify, args=(0, (1,)))
    timer.start()
    with pytest.raises(jax.errors.JaxRuntimeError, match=TOLD_BY_LAUNCHER):
        waiter.wait(block, "old arrays", 5, (0,), timeout_s=30)
    assert waiter._thread is None
    [(left, what, _)] = peer_watch._pending.left_behind[-1:]
    assert left.is_alive() and what == "a collective of world 0"
    stuck.set()  # the old collective gives up: the thread it held ends
    assert finished.wait(5)
    peer_watch._join_left_behind()  # what runs at exit
    assert not left.is_alive()


def test_a_step_is_not_started_in_a_world_known_to_have_lost_a_peer(world):
    """`DeviceProxy.run` after a notice: it raises the notice's error and executes nothing,
    so no collective of the broken world is started (none to abandon, no stale message of
    the dead peer read), and the next world runs again."""
    generation, start = world
    watch = start(_Launcher()).start()
    executed = []

    class _Layer:
        def execute(self, executable, args, *, step, devices):
            executed.append(step)
            return args

        def block(self, outputs, *, step, devices):
            return outputs

    p = object.__new__(proxy.DeviceProxy)  # only what `run` touches
    p.layer, p._devices, p._waiter = _Layer(), frozenset({0}), proxy._Waiter()
    assert p.run(None, "leaves", "batch", 4, timeout_s=5) == ("leaves", "batch")
    watch.notify(0, (1,))
    raised = []
    for timeout_s in (5, None):
        with pytest.raises(jax.errors.JaxRuntimeError,
                           match=f"{TOLD_BY_LAUNCHER}.*not started") as info:
            p.run(None, "leaves", "batch", 5, timeout_s=timeout_s)
        raised.append(info.value)
    assert executed == [4]
    # An error of its own each time: none keeps another raise's frames (and arrays).
    assert raised[0] is not raised[1] and peer_watch.known_death() is not raised[1]
    generation["g"] = 1
    assert p.run(None, "leaves", "batch", 5, timeout_s=5) == ("leaves", "batch")
    assert executed == [4, 5]
    p.close()


def test_exit_waits_for_a_left_behind_thread_at_most_exit_wait_s_after_it_was_left(world):
    """The bound runs from the abandonment (the collective timeout from then), not from
    the exit: a thread left long before the exit is not waited for again."""
    _, start = world
    start(_Launcher()).start()
    peer_watch._pending.exit_wait_s = 0.3
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(10,), daemon=True)
    thread.start()
    peer_watch.WaitHandle(concurrent.futures.Future(), 0).leave_behind(thread)
    t0 = time.monotonic()
    peer_watch._join_left_behind()  # returns after ~0.3 s, the thread still blocked
    assert thread.is_alive() and 0.2 < time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    peer_watch._join_left_behind()  # its bound has passed: at once
    assert time.monotonic() - t0 < 0.25
    release.set()
    thread.join(5)
    peer_watch._pending.left_behind.clear()


def test_exit_says_what_it_waits_for(caplog):
    """A connect abandoned during a recovery may keep the exit waiting some seconds (a
    user trial: 14 s with only jaxlib's lines to show for it): the wait is announced,
    naming what was abandoned; it ends as soon as the thread does."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(10,), daemon=True)
    thread.start()
    peer_watch.leave_behind(thread, 1, what="a connect to world 1", wait_s=5.0)
    threading.Timer(0.2, release.set).start()
    try:
        with caplog.at_level("WARNING", logger="mnemojax"):
            peer_watch._join_left_behind()
        assert not thread.is_alive()
        assert "waiting at exit, at most 5 s, for a connect to world 1 that was abandoned" \
            in caplog.text and "still blocked" not in caplog.text
    finally:
        release.set()
        peer_watch._pending.left_behind.clear()
