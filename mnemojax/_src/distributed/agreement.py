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
   order become ranks 0..n-1 of world g+1; the resume step is the newest step s for which a
   complete, checksummed copy of *every* old member's snapshot is held by a live agent (its
   own agent or its ring buddy), so a recovery never mixes steps across hosts.
   Every arrival has detached, so the coordinator then stops world g's service (service
   last) and has already started world g+1's.
3. Each survivor joins world g+1 (its ``connect`` is itself a barrier over world g+1),
   restores state of step s from the agents named in ``sources``, and replays from s+1.

`Coordinator` is the small interface the worker uses; `LauncherCoordinator` implements it
against the launcher on one machine (a later issue can put the same two calls on etcd).
`AgreementBook` is the pure decision logic the launcher runs (tested without processes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
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
        resume_step: the step whose state every survivor restores (then replays s+1...).
        survivors: worker ids in new rank order.
        previous_members: worker ids of the old world in old rank order.
        sources: ``worker_id -> agent addresses`` holding that worker's snapshot of
            ``resume_step`` (first = preferred).
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


class Coordinator(Protocol):
    """The agreement service a worker talks to (launcher today, etcd later)."""

    def report_failure(self, *, generation: int, reason: str) -> None:
        """Tells the coordinator this worker saw a failure in world ``generation``."""

    def agree(self, *, generation: int, last_step: int) -> Agreement:
        """Barrier over the live members of world ``generation``; returns the decision.

        Call after detaching from world ``generation``. Atomic: every survivor gets the same
        decision (its own rank in it), or every call raises `AgreementError`.
        """


def choose_resume_step(members: Sequence[int],
                       holdings: Mapping[str, Mapping[int, Sequence[int]]]) -> int:
    """The newest step with a copy of every member's snapshot somewhere live.

    Args:
        members: worker ids of the old world.
        holdings: ``agent address -> {origin worker id -> steps held}`` of the live agents.

    Raises:
        AgreementError: some step is not covered for every member (generation -1 here).
    """
    per_member = []
    for m in members:
        steps = set()
        for held in holdings.values():
            steps.update(held.get(m, ()))
        per_member.append(steps)
    common = set.intersection(*per_member) if per_member else set()
    if not common:
        raise AgreementError(f"no step is held for every member {list(members)}: "
                             f"{dict(holdings)}", generation=-1)
    return max(common)


class AgreementBook:
    """The coordinator's state for one world: arrivals, deaths and the decision (pure)."""

    def __init__(self, generation: int, members: Sequence[int]):
        self.generation = generation
        self.members = tuple(members)
        self.dead: set[int] = set()
        self.arrived: dict[int, int] = {}
        self.decision: dict[int, Agreement] | None = None

    def mark_dead(self, worker_id: int) -> None:
        if worker_id in self.members and worker_id not in self.arrived:
            self.dead.add(worker_id)

    def arrive(self, worker_id: int, generation: int, last_step: int) -> None:
        if generation != self.generation or worker_id not in self.members:
            raise AgreementError(f"worker {worker_id} asked to agree on world {generation}, "
                                 f"the current world is {self.generation}",
                                 generation=generation)
        if worker_id in self.dead:
            raise AgreementError(f"worker {worker_id} was declared dead (evicted)",
                                 generation=generation)
        self.arrived[worker_id] = last_step

    def missing(self) -> list[int]:
        """Members neither arrived nor dead (the barrier waits for them)."""
        return [m for m in self.members if m not in self.arrived and m not in self.dead]

    def complete(self) -> bool:
        return bool(self.arrived) and not self.missing()

    def decide(self, *, coordinator: str,
               holdings: Mapping[str, Mapping[int, Sequence[int]]]) -> dict[int, Agreement]:
        """Decides the new world once (idempotent); ``holdings`` come from live agents."""
        if self.decision is not None:
            return self.decision
        if not self.complete():
            raise AgreementError(f"barrier incomplete, waiting for {self.missing()}",
                                 generation=self.generation)
        step = choose_resume_step(self.members, holdings)
        survivors = tuple(m for m in self.members if m in self.arrived)
        sources = {m: tuple(a for a, held in holdings.items() if step in held.get(m, ()))
                   for m in self.members}
        self.decision = {
            w: Agreement(generation=self.generation + 1, worker_id=w, process_id=i,
                         num_processes=len(survivors), coordinator=coordinator,
                         resume_step=step, survivors=survivors, previous_members=self.members,
                         sources=sources)
            for i, w in enumerate(survivors)}
        return self.decision


def agreement_to_json(a: Agreement) -> dict:
    d = dataclasses.asdict(a)
    d["sources"] = {str(k): list(v) for k, v in a.sources.items()}
    return d


def agreement_from_json(d: Mapping) -> Agreement:
    return Agreement(**{**d, "survivors": tuple(d["survivors"]),
                        "previous_members": tuple(d["previous_members"]),
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

    def agree(self, *, generation: int, last_step: int) -> Agreement:
        reply = self._call("agree", generation=generation, last_step=last_step)
        return agreement_from_json(reply["agreement"])
