"""The launcher's book of one world's agreement: arrivals, deaths and the decision (pure).

The barrier and the decision rule of the agreement protocol (`distributed.agreement`),
without processes, sockets or clocks: `arbiter.Arbiter` runs it under the launcher's lock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from mnemojax._src.distributed.agreement import (
    Agreement,
    CopyInfo,
    choose_resume_step,
    snapshots_first,
)
from mnemojax._src.errors import AgreementError


class AgreementBook:
    """The coordinator's state for one world: arrivals, deaths and the decision (pure)."""

    def __init__(self, generation: int, members: Sequence[int]):
        self.generation = generation
        self.members = tuple(members)
        self.dead: set[int] = set()
        self.arrived: dict[int, int] = {}
        self.replayable_from: dict[int, int] = {}  # worker -> oldest resume step it can use
        self.decision: dict[int, Agreement] | None = None

    def mark_dead(self, worker_id: int) -> None:
        """A member died. Before the decision it leaves the barrier even if it had arrived
        (a survivor that dies while waiting is not put into the new world)."""
        if worker_id in self.members and self.decision is None:
            self.arrived.pop(worker_id, None)
            self.dead.add(worker_id)

    def arrive(self, worker_id: int, generation: int, last_step: int,
               first_replayable: int | None = None) -> None:
        if generation != self.generation or worker_id not in self.members:
            raise AgreementError(f"worker {worker_id} asked to agree on world {generation}, "
                                 f"the current world is {self.generation}",
                                 generation=generation)
        if worker_id in self.dead:
            raise AgreementError(f"worker {worker_id} was declared dead (evicted)",
                                 generation=generation)
        self.arrived[worker_id] = last_step
        if first_replayable is not None:
            self.replayable_from[worker_id] = first_replayable - 1

    def missing(self) -> list[int]:
        """Members neither arrived nor dead (the barrier waits for them)."""
        return [m for m in self.members if m not in self.arrived and m not in self.dead]

    def complete(self) -> bool:
        return bool(self.arrived) and not self.missing()

    def decide(self, *, coordinator: str, holdings: Mapping[str, Sequence[CopyInfo]],
               homes: Mapping[int, str] | None = None,
               members_of: Mapping[int, Sequence[int]] | None = None,
               joiners: Sequence[int] = (), slots: Mapping[int, int] | None = None,
               full_size: int | None = None) -> dict[int, Agreement]:
        """Decides the new world once (idempotent).

        Without joiners the survivors, in old rank order, are ranks 0..n-1. With one
        joiner per dead member (spares; fewer are not used), each joiner takes a dead
        member's rank, so the world keeps its size and its ranks (``replaces``: joiner ->
        that member).

        A world smaller than ``full_size`` (world 0's) grows back when there are joiners
        for every free slot: ``slots`` gives each member the rank it holds in world 0's
        layout; the joiners take the free ones, and every member's new rank is its slot,
        so the mesh is world 0's again (``replaces``: joiner -> the world-0 worker whose
        slot it takes). Fewer joiners than free slots: none joins (a fresh process
        builds its mesh from the user's code, which fits world 0's size only).

        Args:
            coordinator: the new world's coordination service.
            holdings: the verified copies held by the live agents (address -> copies).
            homes: worker id -> its own agent; a worker's own agent is listed first among
                the sources of its snapshot (a buddy also serves its own worker's).
            members_of: generation -> its members, to name the lost workers when the
                newest copies come from an older world (default: this world's members).
            joiners: fresh processes (spares) that may replace the dead members.
            slots: member -> its slot (its rank in world 0's layout).
            full_size: world 0's size (``None``: never grow).
        """
        if self.decision is not None:
            return self.decision
        if not self.complete():
            raise AgreementError(f"barrier incomplete, waiting for {self.missing()}",
                                 generation=self.generation)
        floor = max((self.replayable_from[w] for w in self.arrived
                     if w in self.replayable_from), default=None)
        max_step = min(self.arrived.values())
        chosen = choose_resume_step(holdings, max_step=max_step, min_step=floor)
        survivors = tuple(m for m in self.members if m in self.arrived)
        dead = [m for m in self.members if m not in self.arrived]
        replaces: dict[int, int] = {}
        if full_size is not None and slots is not None and len(self.members) < full_size:
            holder = {slots[m]: m for m in survivors}
            free = [s for s in range(full_size) if s not in holder]
            if len(joiners) >= len(free):
                replaces = dict(zip(joiners, free, strict=False))
                holder.update({s: j for j, s in replaces.items()})
                survivors = tuple(holder[s] for s in range(full_size))
        elif dead and len(joiners) >= len(dead):
            replaces = dict(zip(joiners, dead, strict=False))
            by_dead = {d: j for j, d in replaces.items()}
            survivors = tuple(by_dead.get(m, m) for m in self.members)
        step, generation, lost, why = -1, 0, (), ""
        sources: dict[int, list[str]] = {}
        if chosen is not None:
            step, generation = chosen
            sources = _needed_copies(holdings, chosen)
        else:
            # (held copies name no worker: their regions are others' shards)
            every = [c for copies in holdings.values() for c in copies if c.origin >= 0]
            newest = max(((c.step, c.generation) for c in every), default=None)
            members = (members_of or {}).get(newest[1], self.members) if newest \
                else self.members
            # A worker that holds no shards in that world (all its shards are replicas of
            # others') loses nothing; its layout is the same at every step of a world.
            empty = {c.origin for c in every if newest and c.generation == newest[1]
                     and not c.shards}
            # Named: the members with no copy of any step of that world; when each has
            # some, those missing the newest step (then no step has them all).
            anywhere = {c.origin for c in every if newest and c.generation == newest[1]}
            lost = tuple(m for m in members if m not in anywhere and m not in empty)
            why = (f"no live agent holds a verified copy of the shards of workers "
                   f"{list(lost)} (their agents and ring buddies are gone, or the copies "
                   "fail CRC32C, and no survivor held a replica of them)")
            if not lost and choose_resume_step(holdings, max_step=max_step) is not None:
                # Some step is whole, but older than the survivors can replay from.
                why = (f"the newest complete state in memory is older than step {floor}, "
                       "the oldest the survivors still keep the batches to replay from")
            elif not lost:
                present = {c.origin for c in every if (c.step, c.generation) == newest}
                lost = tuple(m for m in members if m not in present and m not in empty)
                why = (f"no step is held whole: each worker has copies, but none of step "
                       f"{newest[0] if newest else None} of workers {list(lost)} survives, "
                       "and no older step has every worker's")
        home_of = dict(homes or {})
        ordered = {o: tuple(sorted(a, key=lambda addr, o=o: addr != home_of.get(o)))
                   for o, a in sorted(sources.items())}
        self.decision = {
            w: Agreement(generation=self.generation + 1, worker_id=w, process_id=i,
                         num_processes=len(survivors), coordinator=coordinator,
                         resume_step=step, survivors=survivors, previous_members=self.members,
                         sources=ordered, lost=lost, resume_generation=generation, why=why,
                         replaces=replaces)
            for i, w in enumerate(survivors)}
        return self.decision


def takes_joiners(members: Sequence[int], slots: Mapping[int, int], full_size: int) -> bool:
    """Whether the world after one of ``members`` may take spares in. A fresh process
    builds its mesh from the user's code, which fits world 0's size and layout only: in
    place of dead members of a world whose every member holds its world-0 rank (``slots``:
    member -> that rank), or to grow a smaller world back to world 0's size
    (`AgreementBook.decide` takes them only then: one for every open slot, or none)."""
    return len(members) < full_size or all(slots.get(m) == r for r, m in enumerate(members))


def open_slots(members: Sequence[int], arrived: Collection[int], slots: Mapping[int, int],
               full_size: int) -> list[int]:
    """The slots joiners may fill in the world after one of ``members`` when ``arrived``
    are its survivors: the free ranks of world 0's layout when that world is smaller than
    world 0 (it grows back), else the ranks of its dead members (-1 for a member without
    one). The one count of open slots that deciding a world, placing joiners and asking
    for a regrow use, on one machine (`arbiter`) and across nodes (`plane`)."""
    if len(members) < full_size:
        held = {slots.get(m) for m in arrived}
        return [s for s in range(full_size) if s not in held]
    return [slots.get(m, -1) for m in members if m not in arrived]


def _needed_copies(holdings: Mapping[str, Sequence[CopyInfo]],
                   chosen: tuple[int, int]) -> dict[int, list[str]]:
    """Origin -> the agents holding its copy of ``chosen`` (step, generation), for the
    copies the restore needs: every worker's snapshot that has shards, and a survivor's
    held copy (`agreement.held_origin`, negative) only where it holds a region no copy
    before it does (shards of one world are equal or disjoint, so a region is one box)."""
    copies: dict[int, tuple[CopyInfo, list[str]]] = {}
    for addr, held in holdings.items():
        for c in held:  # a copy with no shards adds nothing to fetch
            if (c.step, c.generation) == chosen and c.shards:
                copies.setdefault(c.origin, (c, []))[1].append(addr)
    covered: set[tuple[int, tuple[tuple[int, int], ...]]] = set()
    needed: dict[int, list[str]] = {}
    for origin in snapshots_first(copies):
        copy, addrs = copies[origin]
        boxes = {(leaf, index) for leaf, _, index in copy.shards}
        if origin >= 0 or not boxes <= covered:
            needed[origin] = addrs
            covered |= boxes
    return needed
