"""`launcher.arbiter.Arbiter.watch`: a long poll that returns as soon as a member dies;
`Arbiter.end` / `close`: no new world once the job is ending."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.launcher.arbiter import Arbiter
from mnemojax._src.distributed.launcher.book import AgreementBook
from mnemojax._src.distributed.launcher.roster import AgentRoster
from mnemojax._src.errors import AgreementError


def _arbiter(n=3):
    roster = AgentRoster(secret=b"s" * 32)
    arbiter = Arbiter(range(n), agree_timeout_s=30, roster=roster,
                      services=None,  # type: ignore[arg-type]  # watching starts no service
                      record=lambda event: None)
    return arbiter, roster


def _watch(generation=0, timeout_s=30.0):
    return wire.WatchWorld(worker_id=0, generation=generation, timeout_s=timeout_s)


def test_a_death_ends_the_poll_naming_the_dead():
    arbiter, roster = _arbiter()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        polling = pool.submit(arbiter.watch, _watch())
        time.sleep(0.2)
        assert not polling.done()
        with roster.cv:  # what the launcher does when worker 2's agent reports its exit
            arbiter.member_died(2)
            roster.cv.notify_all()
        assert polling.result(timeout=5) == wire.WorldFailed(generation=0, failed=(2,))
    assert arbiter.watch(_watch()).failed == (2,)  # a later poll gets it at once


def test_a_quiet_world_answers_empty_at_the_poll_timeout():
    arbiter, _ = _arbiter()
    assert arbiter.watch(_watch(timeout_s=0.2)).failed == ()


def test_a_world_not_formed_yet_has_no_dead():
    arbiter, _ = _arbiter()
    assert arbiter.watch(_watch(generation=1, timeout_s=0.1)).failed == ()


def test_a_superseded_world_reports_the_members_left_out_of_the_next():
    arbiter, _ = _arbiter()
    arbiter.book = AgreementBook(1, (0, 2))  # what a decision leaves (`Arbiter._decide`)
    arbiter.worlds[1] = (0, 2)
    assert arbiter.watch(_watch(generation=0, timeout_s=0.1)).failed == (1,)


def test_closing_the_launcher_ends_every_poll_at_once():
    arbiter, roster = _arbiter()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        polling = pool.submit(arbiter.watch, _watch(timeout_s=30))
        time.sleep(0.2)
        with roster.cv:
            arbiter.close()
        assert polling.result(timeout=5).failed == ()


def test_an_ending_job_fails_an_agreement_already_waiting():
    """A survivor whose collective failed on a peer's exit may reach the agreement before
    the launcher hears that the peer ended the job with its own error: no new world."""
    arbiter, roster = _arbiter(2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(arbiter.agree, wire.Agree(worker_id=0, generation=0,
                                                        last_step=3))
        time.sleep(0.2)
        assert not waiting.done()
        with roster.cv:
            arbiter.end("the job is ending: worker 1 exited with status 1")
        with pytest.raises(AgreementError, match="worker 1 exited with status 1"):
            waiting.result(timeout=5)
    with pytest.raises(AgreementError, match="job is ending"):
        arbiter.agree(wire.Agree(worker_id=1, generation=0, last_step=3))


def test_a_member_gone_to_the_agreement_ends_the_others_poll():
    """No death is known, but worker 1 arrived at the agreement (it saw world 0 fail,
    e.g. the holders of a copy it had to fetch died): the poll returns it as ``left``, and
    a death outranks it."""
    arbiter, roster = _arbiter()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        polling = pool.submit(arbiter.watch, _watch())
        time.sleep(0.2)
        assert not polling.done()
        with roster.cv:  # what `Arbiter.agree` does first
            arbiter.book.arrive(1, 0, 4, None)
            roster.cv.notify_all()
        assert polling.result(timeout=5) == wire.WorldFailed(generation=0, failed=(),
                                                            left=(1,))
    with roster.cv:
        arbiter.member_died(2)
    assert arbiter.watch(_watch()) == wire.WorldFailed(generation=0, failed=(2,))
