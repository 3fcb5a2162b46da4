"""`launcher.arbiter.Arbiter` with warm spares (one launcher, ``--spares``): a world formed
after a loss takes one in place of each dead member while every member holds its world-0
rank; a shrunk world takes none."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agreement import Agreement, compiled_barrier
from mnemojax._src.distributed.launcher.arbiter import Arbiter
from mnemojax._src.distributed.launcher.roster import AgentRoster


class _Service:
    def __init__(self, generation: int):
        self.address = f"127.0.0.1:{9000 + generation}"


class _Services:
    """Records the size of each world's coordination service (no process)."""

    def __init__(self):
        self.sizes: dict[int, int] = {}

    def start(self, generation: int, num_processes: int) -> _Service:
        self.sizes[generation] = num_processes
        return _Service(generation)

    def stop(self, generation: int) -> bool:
        return generation in self.sizes


def _arbiter(n: int, spares: list[int], *, timeout_s: float = 30, dropped=None):
    roster = AgentRoster(secret=b"s" * 32)  # no agents: nothing held, nothing to command
    services, joined = _Services(), []

    def on_join(worker_id: int, agreement: Agreement) -> None:
        spares.remove(worker_id)
        joined.append((worker_id, agreement))

    arbiter = Arbiter(range(n), agree_timeout_s=timeout_s, roster=roster,
                      services=services,  # type: ignore[arg-type]
                      record=lambda event: None, spares=lambda: list(spares),
                      on_join=on_join, on_drop=None if dropped is None else dropped.append)
    return arbiter, roster, services, joined


def _form(arbiter: Arbiter) -> None:
    """Every member of the current world passes the barrier after its compile."""
    g = arbiter.book.generation
    members = arbiter.book.members
    with concurrent.futures.ThreadPoolExecutor(len(members)) as pool:
        list(pool.map(lambda w: arbiter.barrier(wire.Barrier(
            worker_id=w, generation=g, name=compiled_barrier(g), timeout_s=10)), members))


def _lose(arbiter: Arbiter, roster: AgentRoster, dead: Sequence[int]) -> list[Agreement]:
    """``dead`` die; the other members of the current world agree."""
    generation = arbiter.book.generation
    with roster.cv:
        for w in dead:
            arbiter.member_died(w)
    survivors = [m for m in arbiter.book.members if m not in dead]
    with concurrent.futures.ThreadPoolExecutor(len(survivors)) as pool:
        return list(pool.map(lambda w: arbiter.agree(wire.Agree(
            worker_id=w, generation=generation, last_step=5)), survivors))


def test_a_spare_takes_the_dead_members_rank_and_the_world_keeps_its_size():
    spares = [3, 4]
    arbiter, roster, services, joined = _arbiter(3, spares)
    mine = _lose(arbiter, roster, [0])
    assert [a.survivors for a in mine] == [(3, 1, 2)] * 2
    assert [a.process_id for a in mine] == [1, 2]
    assert services.sizes == {1: 3}
    [(w, agreement)] = joined  # the lowest spare, told its rank and whom it replaces
    assert w == 3 and agreement.process_id == 0 and agreement.replaces == {3: 0}
    assert agreement.num_processes == 3 and spares == [4]
    # The spare is a member like any: its loss takes the next spare, at the same rank.
    mine = _lose(arbiter, roster, [3])
    assert mine[0].survivors == (4, 1, 2) and joined[-1][1].replaces == {4: 3}
    assert services.sizes == {1: 3, 2: 3} and spares == []


def test_fewer_spares_than_dead_members_join_none_and_a_shrunk_world_takes_none():
    spares = [3]
    arbiter, roster, services, joined = _arbiter(3, spares)
    mine = _lose(arbiter, roster, [0, 1])  # two dead, one spare: none joins
    assert mine[0].survivors == (2,) and services.sizes == {1: 1}
    assert joined == [] and spares == [3]
    later: list[int] = []
    arbiter, roster, services, joined = _arbiter(3, later)
    _lose(arbiter, roster, [0])
    later.append(4)  # a spare only once the world shrank: a fresh process would build
    mine = _lose(arbiter, roster, [1])  # world 0's mesh, not the survivors'
    assert mine[0].survivors == (2,) and joined == [] and services.sizes == {1: 2, 2: 1}


def test_a_formed_shrunk_world_regrows_once_spares_fill_it_and_its_watch_says_so():
    """World 1 (1, 2) of world 0's three: no regrow while it forms, none with too few
    spares; once it formed and a spare is warm, its members' watch says ``regrow`` (also
    to a member polling after another went to the agreement: it is no failure), they
    agree, and the world is world 0's layout again: the survivors at their first ranks,
    the spare in the free one, a service for three."""
    spares: list[int] = []
    arbiter, roster, services, joined = _arbiter(3, spares)
    _lose(arbiter, roster, [0])
    with roster.cv:
        assert arbiter.regrow_due(1) is None  # still forming (no compile barrier passed)
    _form(arbiter)
    with roster.cv:
        assert arbiter.regrow_due(0) is None  # a free rank, no spare
        assert arbiter.regrow_due(1) == 1 and arbiter.regrow_pending() is None
        arbiter.request_regrow(1)
        assert arbiter.regrow_due(1) is None  # asked once
        assert arbiter.regrow_pending() == 1  # (said if the job ends before it re-forms)
    watch = wire.WatchWorld(worker_id=1, generation=1, timeout_s=5)
    assert arbiter.watch(watch).regrow
    spares.append(3)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(arbiter.agree, wire.Agree(worker_id=1, generation=1, last_step=5))
        time.sleep(0.2)  # worker 1 waits at the agreement; worker 2 polls only now
        late = arbiter.watch(wire.WatchWorld(worker_id=2, generation=1, timeout_s=5))
        assert late.regrow and late.failed == (), late
        second = pool.submit(arbiter.agree, wire.Agree(worker_id=2, generation=1, last_step=5))
        mine = [first.result(timeout=10), second.result(timeout=10)]
    assert [a.survivors for a in mine] == [(3, 1, 2)] * 2
    assert [a.process_id for a in mine] == [1, 2] and joined[0][1].replaces == {3: 0}
    assert services.sizes[2] == 3
    with roster.cv:
        assert arbiter.regrow_pending() is None  # re-formed


def test_a_regrow_agreement_waits_for_a_member_between_steps_and_drops_one_that_finished():
    """Nobody died: a member missing at a regrow's agreement deadline is alive in its own
    code between steps, so it is not evicted; one that exits 0 (its loop done) is left out
    and the others go on without it."""
    spares: list[int] = []
    arbiter, roster, _, joined = _arbiter(3, spares, timeout_s=0.3)
    _lose(arbiter, roster, [0])
    _form(arbiter)
    spares.append(3)
    with roster.cv:
        arbiter.request_regrow(1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(arbiter.agree, wire.Agree(worker_id=1, generation=1,
                                                        last_step=5))
        time.sleep(1.0)  # past the deadline: still waiting for worker 2, not evicted
        assert not waiting.done() and 2 not in arbiter.book.dead
        with roster.cv:
            arbiter.member_finished(2)
        agreement = waiting.result(timeout=10)
    assert agreement.survivors == (1,) and joined == []  # two free ranks, one spare


def test_the_joiners_of_a_grown_world_that_never_formed_are_dropped():
    """World 2 grew back with spare 3 and a member died before its compile barrier: at
    the next agreement the spare (it holds nothing, and the survivors are on world 1's
    layout) is dropped, told to the launcher first (its kill is no failure)."""
    spares: list[int] = []
    dropped: list[int] = []
    arbiter, roster, _, _ = _arbiter(3, spares, dropped=dropped)
    _lose(arbiter, roster, [0])
    _form(arbiter)
    spares.append(3)
    with roster.cv:
        arbiter.request_regrow(1)
    mine = _lose(arbiter, roster, [])
    assert mine[0].survivors == (3, 1, 2)
    with roster.cv:  # worker 2 dies before world 2 formed; 3 and 1 agree
        arbiter.member_died(2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda w: _try_agree(arbiter, w, 2), [3, 1]))
    assert dropped == [3]
    assert got[1].survivors == (1,) and isinstance(got[0], Exception)


def _try_agree(arbiter: Arbiter, w: int, generation: int):
    try:
        return arbiter.agree(wire.Agree(worker_id=w, generation=generation, last_step=5))
    except Exception as e:  # (the dropped joiner's answer)
        return e
