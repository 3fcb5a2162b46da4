"""Agreement among survivors: who is alive, which step to resume from, the new world.

Protocol (one round per failure; ``generation`` counts worlds, 0 at launch):

1. A survivor that sees a failure (a collective error, ``ProcessFailureError``) detaches
   from world g (client shutdown, backends cleared: clients first) and calls
   ``agree(generation=g, last_step=k)``. **Barrier:** the call returns only when every member
   of world g has either called ``agree`` for g or been declared dead (its agent saw the exit,
   its agent vanished, the hang watchdog fired, or it missed the agreement deadline, after
   which it is killed: an evicted member can never come back into a later world).
2. The coordinator then decides once for everyone (**atomic:** every survivor of world g gets
   the same `Agreement`, or every call raises `AgreementError`): the survivors in old rank
   order become ranks 0..n-1 of world g+1; the resume step is the newest step s whose
   copies on live agents (a worker's own agent or its ring buddy), each verified against its
   CRC32 when the agents are asked, cover every element of every leaf (`choose_resume_step`),
   so a recovery never mixes steps across hosts and never restores a corrupt copy. A worker
   whose shards are all replicated elsewhere need not have a copy. When no step is complete,
   the decision says which workers' state is lost (``resume_step == -1``).
   Every arrival has detached, so the coordinator then stops world g's service (service
   last) and has already started world g+1's.
3. Each survivor joins world g+1 (its ``connect`` is itself a barrier over world g+1),
   restores state of step s from the agents named in ``sources``, and replays from s+1.

A member that dies while waiting at the barrier leaves it (it is not put into world g+1). One
that dies after the decision never joins world g+1: the others' ``connect`` times out and they
agree again, over world g+1 (a second round; `recovery.recover_world`). One that dies after
world g+1 formed is an ordinary failure of world g+1 (the resilient step recovers again).

`Coordinator` is the small interface the worker uses; `LauncherCoordinator` implements it
against the launcher on one machine (a later issue can put the same two calls on etcd).
`AgreementBook` is the pure decision logic the launcher runs (tested without processes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from mnemojax._src.distributed import protocol
from mnemojax._src.distributed.errors import AgreementError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Agreement:
    """What every survivor of world ``generation - 1`` agreed on.

    Attributes:
        generation: the new world's generation.
        worker_id: the caller's stable id (its host slot; survives renumbering).
        process_id: the caller's rank in the new world.
        num_processes: size of the new world.
        coordinator: ``host:port`` of the new world's coordination service.
        resume_step: the step whose state every survivor restores (then replays s+1...);
            -1 when no step's state is complete anywhere (see ``lost``).
        resume_generation: the world that produced those copies (a step replayed in a
            newer world has copies of both; the fetched payloads must all be of this one).
        survivors: worker ids in new rank order.
        previous_members: worker ids of the old world in old rank order.
        sources: ``origin worker id -> agent addresses`` holding a verified copy of that
            worker's snapshot of ``resume_step`` (first = preferred). Only the origins whose
            shards are needed: together they cover every leaf.
        lost: when ``resume_step == -1``, the old members whose shards no live agent holds
            a verified copy of (their agent and ring buddy are gone, or the copies are
            corrupt). The survivors still form the new world, then fall back to the
            persistent tier or raise a typed error.
        why: when ``resume_step == -1``, why no in-memory state can be used.
    """

    generation: int
    worker_id: int
    process_id: int
    num_processes: int
    coordinator: str
    resume_step: int
    survivors: tuple[int, ...]
    previous_members: tuple[int, ...]
    sources: Mapping[int, tuple[str, ...]]
    lost: tuple[int, ...] = ()
    resume_generation: int = 0
    why: str = ""


class Coordinator(Protocol):
    """The agreement service a worker talks to (launcher today, etcd later)."""

    def report_failure(self, *, generation: int, reason: str) -> None:
        """Tells the coordinator this worker saw a failure in world ``generation``."""

    def agree(self, *, generation: int, last_step: int,
              first_replayable: int | None = None) -> Agreement:
        """Barrier over the live members of world ``generation``; returns the decision.

        ``first_replayable``: the oldest step whose batch the caller still keeps (it can
        resume from any step at or after ``first_replayable - 1``).

        Call after detaching from world ``generation``. Atomic: every survivor gets the same
        decision (its own rank in it), or every call raises `AgreementError`.
        """


@dataclasses.dataclass(frozen=True)
class CopyInfo:
    """What one verified snapshot copy covers (from its metadata, `snapshot_codec.read_meta`;
    agents send that metadata with an ``origin`` field, and the launcher reads it back).

    Attributes:
        origin: the worker whose shards these are.
        step / generation: the step, and the world (one mesh) that produced it.
        num_leaves: leaves in the whole state.
        shards: ``(leaf, global shape, index)`` per shard, index ``((start, stop), ...)``.
    """

    origin: int
    step: int
    generation: int
    num_leaves: int
    shards: tuple[tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]], ...]

    @classmethod
    def from_meta(cls, origin: int, meta: Mapping) -> CopyInfo:
        return cls(origin, int(meta["step"]), int(meta.get("generation", 0)),
                   int(meta["num_leaves"]),
                   tuple((int(m["leaf"]), tuple(m["shape"]), tuple(tuple(i) for i in m["index"]))
                         for m in meta["shards"]))


def missing_leaves(copies: Iterable[CopyInfo]) -> list[int]:
    """Leaves not fully covered by the shards of ``copies`` (all of one step and world).

    Shards of one mesh are equal or disjoint, so a leaf is covered when its distinct shards'
    volumes add up to the leaf's size.
    """
    copies = list(copies)
    if not copies:
        return []
    boxes: dict[int, set] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for c in copies:
        for leaf, shape, index in c.shards:
            boxes.setdefault(leaf, set()).add(index)
            shapes[leaf] = shape
    return [leaf for leaf in range(copies[0].num_leaves)
            if leaf not in boxes or sum(math.prod(b - a for a, b in index)
                                        for index in boxes[leaf]) < math.prod(shapes[leaf])]


def choose_resume_step(holdings: Mapping[str, Sequence[CopyInfo]], *,
                       max_step: int | None = None,
                       min_step: int | None = None) -> tuple[int, int] | None:
    """The newest (step, generation) whose verified copies on live agents cover every leaf.

    Copies of the same step from a newer world (a replayed step) are preferred. None: no
    step is complete anywhere.

    Args:
        holdings: agent address -> the verified copies it holds.
        max_step: no newer step than this (the oldest survivor's last completed step: a
            survivor whose step failed after a peer's succeeded must not be skipped ahead).
        min_step: no older step than this (every survivor must still keep the batches to
            replay from it).
    """
    groups: dict[tuple[int, int], list[CopyInfo]] = {}
    for copies in holdings.values():
        for c in copies:
            if (max_step is None or c.step <= max_step) and (
                    min_step is None or c.step >= min_step):
                groups.setdefault((c.step, c.generation), []).append(c)
    complete = [key for key, copies in groups.items() if not missing_leaves(copies)]
    return max(complete) if complete else None


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
               members_of: Mapping[int, Sequence[int]] | None = None) -> dict[int, Agreement]:
        """Decides the new world once (idempotent).

        Args:
            coordinator: the new world's coordination service.
            holdings: the verified copies held by the live agents (address -> copies).
            homes: worker id -> its own agent; a worker's own agent is listed first among
                the sources of its snapshot (a buddy also serves its own worker's).
            members_of: generation -> its members, to name the lost workers when the
                newest copies come from an older world (default: this world's members).
        """
        if self.decision is not None:
            return self.decision
        if not self.complete():
            raise AgreementError(f"barrier incomplete, waiting for {self.missing()}",
                                 generation=self.generation)
        floor = max((self.replayable_from[w] for w in self.arrived
                     if w in self.replayable_from), default=None)
        chosen = choose_resume_step(holdings, max_step=min(self.arrived.values()),
                                    min_step=floor)
        survivors = tuple(m for m in self.members if m in self.arrived)
        step, generation, sources, lost, why = -1, 0, {}, (), ""
        if chosen is not None:
            step, generation = chosen
            for addr, copies in holdings.items():
                for c in copies:  # a copy with no shards adds nothing to fetch
                    if (c.step, c.generation) == chosen and c.shards:
                        sources.setdefault(c.origin, []).append(addr)
        else:
            every = [c for copies in holdings.values() for c in copies]
            newest = max(((c.step, c.generation) for c in every), default=None)
            members = (members_of or {}).get(newest[1], self.members) if newest \
                else self.members
            present = {c.origin for c in every if (c.step, c.generation) == newest}
            # A worker that holds no shards in that world (all its shards are replicas of
            # others') loses nothing; its layout is the same at every step of a world.
            empty = {c.origin for c in every if newest and c.generation == newest[1]
                     and not c.shards}
            lost = tuple(m for m in members if m not in present and m not in empty)
            why = (f"no live agent holds a verified copy of the shards of workers "
                   f"{list(lost)} (their agents and ring buddies are gone, or the copies "
                   "fail CRC32)") if lost else (
                f"the newest complete state in memory is older than step {floor}, the "
                "oldest the survivors still keep the batches to replay from")
        homes = homes or {}
        sources = {o: tuple(sorted(a, key=lambda addr, o=o: addr != homes.get(o)))
                   for o, a in sorted(sources.items())}
        self.decision = {
            w: Agreement(generation=self.generation + 1, worker_id=w, process_id=i,
                         num_processes=len(survivors), coordinator=coordinator,
                         resume_step=step, survivors=survivors, previous_members=self.members,
                         sources=sources, lost=lost, resume_generation=generation, why=why)
            for i, w in enumerate(survivors)}
        return self.decision


def agreement_to_json(a: Agreement) -> dict:
    d = dataclasses.asdict(a)
    d["sources"] = {str(k): list(v) for k, v in a.sources.items()}
    return d


def agreement_from_json(d: Mapping) -> Agreement:
    return Agreement(**{**d, "survivors": tuple(d["survivors"]),
                        "previous_members": tuple(d["previous_members"]),
                        "lost": tuple(d.get("lost", ())),
                        "sources": {int(k): tuple(v) for k, v in d["sources"].items()}})


class LauncherCoordinator:
    """`Coordinator` backed by the launcher's control endpoint (one machine).

    Args:
        control: ``host:port`` of the launcher (``MNEMOJAX_CONTROL``).
        worker_id: this worker's stable id.
        timeout_s: bound on one barrier call (the launcher's own deadline is shorter).
    """

    def __init__(self, control: str, worker_id: int, *, timeout_s: float = 300.0):
        self.control, self.worker_id, self.timeout_s = control, worker_id, timeout_s

    def _call(self, op: str, **fields) -> dict:
        try:
            reply, _ = protocol.request(self.control, {"op": op, "worker_id": self.worker_id,
                                                       **fields}, timeout_s=self.timeout_s)
        except (OSError, ConnectionError, protocol.ProtocolError) as e:
            raise AgreementError(f"{op} failed: {e}",
                                 generation=fields.get("generation", -1)) from e
        return reply

    def report_failure(self, *, generation: int, reason: str) -> None:
        self._call("report_failure", generation=generation, reason=reason)

    def agree(self, *, generation: int, last_step: int,
              first_replayable: int | None = None) -> Agreement:
        reply = self._call("agree", generation=generation, last_step=last_step,
                           first_replayable=first_replayable)
        return agreement_from_json(reply["agreement"])
