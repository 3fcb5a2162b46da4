"""`launcher.arbiter.Arbiter.barrier`: a member's death fails the barrier at once."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.launcher.arbiter import Arbiter
from mnemojax._src.distributed.launcher.roster import AgentRoster
from mnemojax._src.errors import AgreementError


def _arbiter(n=3):
    roster = AgentRoster(secret=b"s" * 32)
    events = []
    arbiter = Arbiter(range(n), agree_timeout_s=30, roster=roster,
                      services=None,  # type: ignore[arg-type]  # barriers start no service
                      record=events.append)
    return arbiter, roster, events


def _barrier(w, *, timeout_s=30.0, generation=0):
    return wire.Barrier(worker_id=w, generation=generation, name="mnemojax-compiled-0",
                        timeout_s=timeout_s)


def test_barrier_passes_for_everyone_once_all_arrive():
    arbiter, _, _ = _arbiter()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda w: arbiter.barrier(_barrier(w)), range(3)))
    assert [r.failed for r in replies] == [(), (), ()]


def test_a_death_fails_the_waiting_members_at_once_and_the_latecomer_too():
    arbiter, roster, events = _arbiter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(arbiter.barrier, _barrier(0))
        time.sleep(0.2)
        assert not waiting.done()
        t0 = time.monotonic()
        with roster.cv:  # what the launcher does when worker 1's agent reports its exit
            arbiter.member_died(1)
            roster.cv.notify_all()
        assert waiting.result(timeout=5).failed == (1,)
        assert time.monotonic() - t0 < 1.0
    assert arbiter.barrier(_barrier(2)).failed == (1,)  # still compiling when 1 died
    assert [e for e in events if e["op"] == "barrier_failed"] == [
        {"op": "barrier_failed", "generation": 0, "name": "mnemojax-compiled-0",
         "failed": [1]}]


def test_a_member_missing_at_the_deadline_is_evicted():
    arbiter, _, events = _arbiter(2)
    assert arbiter.barrier(_barrier(0, timeout_s=0.3)).failed == (1,)
    assert [e["worker_id"] for e in events if e["op"] == "evicted"] == [1]
    with pytest.raises(AgreementError, match="not a live member"):
        arbiter.barrier(_barrier(1))  # evicted: it can never pass a barrier of this world


def test_a_barrier_of_another_world_is_refused():
    arbiter, _, _ = _arbiter()
    with pytest.raises(AgreementError, match="current world is 0"):
        arbiter.barrier(_barrier(0, generation=1))


def test_a_member_gone_to_the_agreement_fails_the_barrier_like_a_death():
    """Worker 1 saw world 0 fail where no death is known and arrived at the agreement: the
    others, waiting at the compile barrier, fail it naming worker 1 (instead of waiting to
    evict it), and recover too."""
    arbiter, roster, _ = _arbiter()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(arbiter.barrier, _barrier(0))
        time.sleep(0.2)
        assert not waiting.done()
        with roster.cv:  # what `Arbiter.agree` does first
            arbiter.book.arrive(1, 0, 4, None)
            roster.cv.notify_all()
        assert waiting.result(timeout=5).failed == (1,)
