"""`launcher.arbiter.Arbiter` with warm spares (one launcher, ``--spares``): a world formed
after a loss takes one in place of each dead member while every member holds its world-0
rank; a shrunk world takes none."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agreement import Agreement
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


def _arbiter(n: int, spares: list[int]):
    roster = AgentRoster(secret=b"s" * 32)  # no agents: nothing held, nothing to command
    services, joined = _Services(), []

    def on_join(worker_id: int, agreement: Agreement) -> None:
        spares.remove(worker_id)
        joined.append((worker_id, agreement))

    arbiter = Arbiter(range(n), agree_timeout_s=30, roster=roster,
                      services=services,  # type: ignore[arg-type]
                      record=lambda event: None, spares=lambda: list(spares),
                      on_join=on_join)
    return arbiter, roster, services, joined


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
