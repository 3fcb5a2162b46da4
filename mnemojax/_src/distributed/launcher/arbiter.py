"""The launcher's half of the agreement: the barrier, the decision and the new ring.

Each survivor's `wire.Agree` request blocks in `Arbiter.agree` until every member of its
world has arrived or been declared dead (protocol in `distributed.agreement`). A member
not there within ``agree_timeout_s`` is evicted: its agent kills its worker, and a later
``agree`` from it fails. The first caller past the barrier decides, under the launcher's
lock, for everyone: it asks every live agent what it holds, starts the new world's
coordination service, lets `book.AgreementBook` decide, stops the old world's service
(every survivor has detached by then: clients first) and re-forms the buddy ring over
the survivors' agents.

The same lock serves the barriers after each compile (`Arbiter.barrier`, `barriers`): a
member's death, which the launcher hears of from its agent, fails them at once, and so
does a member's arrival at the next agreement (it saw the world fail; `Arbiter.watch`
tells the others the same way).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agreement import Agreement, compiled_barrier
from mnemojax._src.distributed.launcher.barriers import BarrierBook
from mnemojax._src.distributed.launcher.book import AgreementBook, open_slots, takes_joiners
from mnemojax._src.distributed.launcher.roster import AgentRoster
from mnemojax._src.distributed.launcher.services import ServiceHost
from mnemojax._src.errors import AgreementError

logger = logging.getLogger("mnemojax")


class WorldArbiter(Protocol):
    """What the launcher asks of the job's agreement: `Arbiter` in memory (one launcher),
    `plane.EtcdArbiter` in etcd (one launcher per node)."""

    def agree(self, request: wire.Agree) -> Agreement: ...

    def barrier(self, request: wire.Barrier) -> wire.BarrierReply: ...

    def watch(self, request: wire.WatchWorld) -> wire.WorldFailed: ...

    def member_died(self, worker_id: int, why: str = "") -> None: ...

    def member_left(self, worker_id: int) -> None: ...

    def live_members(self) -> list[int]: ...

    def ending(self) -> str | None: ...

    def end(self, why: str, *, code: int | None = None, worker_id: int | None = None,
            signal: int | None = None) -> None: ...

    def stopping(self, why: str, *, signal: int) -> None: ...

    def regrow_pending(self) -> int | None: ...

    def close(self) -> None: ...


class Arbiter:
    """The current world's agreement. Call `member_died` with ``roster.cv`` held.

    Args:
        members: the workers of world 0.
        agree_timeout_s: the barrier's deadline, from each arrival.
        roster: the agents (and the launcher's lock, ``roster.cv``).
        services: the coordination services (one per live world).
        record: logs a launcher event (``op`` and fields).
        spares: the warm spares waiting for a world, in the order they join (``roster.cv``
            held); none by default.
        on_join: called with ``roster.cv`` held for each spare a world took in, with its
            agreement.
        on_drop: called with ``roster.cv`` held for each joiner of a world that grew back
            and never formed, before it is killed (its exit is no failure).
    """

    def __init__(self, members: Sequence[int], *, agree_timeout_s: float,
                 roster: AgentRoster, services: ServiceHost,
                 record: Callable[[dict[str, Any]], None],
                 spares: Callable[[], Sequence[int]] = tuple,
                 on_join: Callable[[int, Agreement], None] | None = None,
                 on_drop: Callable[[int], None] | None = None):
        self.book = AgreementBook(0, members)
        self.worlds: dict[int, tuple[int, ...]] = {0: self.book.members}  # gen -> members
        # Member -> its rank in world 0's layout (a spare takes the one of whom it replaces).
        self._slots = {w: i for i, w in enumerate(self.book.members)}
        self._spares, self._on_join, self._on_drop = spares, on_join, on_drop
        self._fresh: dict[int, tuple[int, ...]] = {}  # gen -> the spares that joined it
        self._regrow: set[int] = set()  # worlds asked to re-form, larger (`request_regrow`)
        self._done: set[int] = set()  # members that exited 0 (`member_finished`)
        self._timeout_s = agree_timeout_s
        self._roster, self._services, self._record = roster, services, record
        self._barriers = BarrierBook()
        self._failed_logged: set[tuple[int, str]] = set()
        self._ending: str | None = None  # why no new world may be decided any more
        self._closed = False  # the launcher is shutting down: long polls return

    def end(self, why: str, *, code: int | None = None, worker_id: int | None = None,
            signal: int | None = None) -> None:
        """No new world from now on: every agreement waiting or to come fails with ``why``
        (the job is ending). Call with ``roster.cv`` held. ``code``, ``worker_id`` and
        ``signal`` say why, for the other nodes of a job that spans several (unused here)."""
        del code, worker_id, signal
        if self._ending is None:
            self._ending = why
        self._roster.cv.notify_all()

    def stopping(self, why: str, *, signal: int) -> None:
        """The job stops (a ``signal`` to the launcher, forwarded to the workers): worlds
        may still be decided until `end` (a recovery under way completes, so that its
        survivors stop at an agreed step and checkpoint it). One launcher: nothing to
        tell."""
        del why, signal

    def close(self) -> None:
        """The launcher is shutting down: `end`, and every `watch` returns at once. Call
        with ``roster.cv`` held."""
        self._closed = True
        self.end("the launcher is shutting down")

    def member_died(self, worker_id: int, why: str = "") -> None:
        del why  # (the launcher's log and record say it on one machine)
        self.book.mark_dead(worker_id)

    def member_left(self, worker_id: int) -> None:
        """It left the job (`wire.Leave`): out of the agreement as a dead member is."""
        self.book.mark_dead(worker_id)

    def member_finished(self, worker_id: int) -> None:
        """It exited 0 (its loop is done). An agreement it will never come to (under way,
        asked for by a regrow, or later) leaves it out, as one that left: the others
        replay the step it finished without it. Call with ``roster.cv`` held."""
        self._done.add(worker_id)
        if self.book.arrived or self.book.generation in self._regrow:
            self._drop_finished()

    def _drop_finished(self) -> None:
        book = self.book
        for m in sorted(self._done & set(book.members)):
            if m not in book.arrived and m not in book.dead:
                self._record({"op": "finished_during_agreement", "worker_id": m,
                              "generation": book.generation})
                book.mark_dead(m)
                self._roster.cv.notify_all()

    def live_members(self) -> list[int]:
        """The current world's members not (yet) known dead."""
        return [m for m in self.book.members if m not in self.book.dead]

    def ending(self) -> str | None:
        """Why no new world may be decided any more (None: worlds may still form)."""
        return self._ending

    def _joiners(self, book: AgreementBook) -> list[int]:
        """The spares the world after ``book``'s may take in (`book.takes_joiners`)."""
        full = len(self.worlds[0])
        return list(self._spares()) if takes_joiners(book.members, self._slots, full) else []

    def _open_slots(self, book: AgreementBook, arrived: Collection[int]) -> int:
        """How many joiners the world after ``book``'s needs to take any, when ``arrived``
        are its survivors (`book.open_slots`)."""
        return len(open_slots(book.members, arrived, self._slots, len(self.worlds[0])))

    def regrow_due(self, warm: int) -> int | None:
        """The current world, when it is smaller than world 0, has formed (its members
        passed the barrier after their compile), none of its members is dead or at the
        next agreement, it was not yet asked to re-form, and ``warm`` spares can fill
        every free rank: the job should grow back now (call with ``roster.cv`` held)."""
        book, g = self.book, self.book.generation
        if (self._ending is not None or len(book.members) >= len(self.worlds[0])
                or book.dead or book.arrived or g in self._regrow
                or self._barriers.decided((g, compiled_barrier(g))) != ()):
            return None  # (a world still forming: its recovery's compile would be wasted)
        return g if warm >= self._open_slots(book, book.members) else None  # (all come)

    def regrow_pending(self) -> int | None:
        """The current world, if it was asked to re-form larger and has not yet."""
        g = self.book.generation
        return g if g in self._regrow else None

    def request_regrow(self, generation: int) -> None:
        """Asks world ``generation``'s members to re-form it, larger: their watch says so
        (`wire.WorldFailed.regrow`), they fail their pending step and agree, and the
        spares take the free ranks (call with ``roster.cv`` held)."""
        self._regrow.add(generation)
        self._roster.cv.notify_all()

    def agree(self, request: wire.Agree) -> Agreement:
        """Barrier, then the decision (`distributed.agreement`); the caller's part of it.

        Raises:
            AgreementError: the caller is not a member of the current world, was evicted,
                or died while waiting; or no decision could be made.
        """
        w, cv = request.worker_id, self._roster.cv
        with cv:
            book = self.book
            book.arrive(w, request.generation, request.last_step, request.first_replayable)
            self._drop_finished()  # (members whose loop is done never come)
            cv.notify_all()
            deadline = time.monotonic() + self._timeout_s
            while book.decision is None and not book.complete():
                if self._ending is not None:
                    break
                left = deadline - time.monotonic()
                if (left <= 0 and book.generation in self._regrow
                        and not set(book.dead) - self._done):
                    # Nobody died: a member not here is alive between steps (its agent's
                    # watchdog says so), in its own code; it comes at its next step, or
                    # it is done and its exit takes it out (`member_finished`).
                    deadline = time.monotonic() + self._timeout_s
                elif left <= 0:
                    for m in book.missing():  # evict: it can never join a later world
                        self._record({"op": "evicted", "worker_id": m,
                                      "why": "not at the agreement in time"})
                        book.mark_dead(m)
                        self._roster.command(m, wire.KillWorker())
                    break
                cv.wait(timeout=min(max(left, 0.01), 0.5))
            if book.decision is None and self._ending is not None:
                raise AgreementError(self._ending, generation=book.generation)
            decision = book.decision if book.decision is not None else self._decide(book)
            if w not in decision:  # it died while waiting: it is not in the new world
                raise AgreementError(f"worker {w} died during the agreement",
                                     generation=book.generation)
            return decision[w]

    def barrier(self, request: wire.Barrier) -> wire.BarrierReply:
        """Waits until every member of world ``request.generation`` has arrived at barrier
        ``request.name`` (passed), or one of them is dead or gone to the next agreement
        (failed, naming them: the caller recovers as from a failed collective). Atomic (`barriers`). A member not
        there within ``request.timeout_s`` of this arrival is evicted, as at the agreement:
        killed, so the barrier fails for the others.

        Raises:
            AgreementError: the caller is not a live member of the current world.
        """
        w, g, cv = request.worker_id, request.generation, self._roster.cv
        key = (g, request.name)
        with cv:
            book = self.book
            if g != book.generation or w not in book.members or w in book.dead:
                raise AgreementError(f"worker {w} is not a live member of world {g} (the "
                                     f"current world is {book.generation})", generation=g)
            self._barriers.arrive(key, w)
            cv.notify_all()
            deadline = time.monotonic() + request.timeout_s
            # A member gone to the agreement (it saw the world fail) fails it like a death.
            while (failed := self._barriers.outcome(
                    key, book.members, set(book.dead) | set(book.arrived))) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    for m in self._barriers.missing(key, book.members):
                        self._record({"op": "evicted", "worker_id": m, "barrier": request.name,
                                      "why": "not at the barrier in time"})
                        book.mark_dead(m)
                        self._roster.command(m, wire.KillWorker())
                    continue
                cv.wait(timeout=min(left, 0.5))
            if failed and key not in self._failed_logged:
                self._failed_logged.add(key)
                self._record({"op": "barrier_failed", "generation": g, "name": request.name,
                              "failed": list(failed)})
            return wire.BarrierReply(failed=failed)

    def watch(self, request: wire.WatchWorld) -> wire.WorldFailed:
        """Waits until a member of world ``request.generation`` is known dead (its agent saw
        its worker exit with a crash, its agent was lost, or it was evicted), or one has
        left it for the next agreement (``left``: it saw the world fail where the launcher
        saw no death), at most ``request.timeout_s``; returns those members (empty when
        none died or left meanwhile).

        This is how a survivor blocked in a collective that a dead member can no longer
        complete learns of the death within milliseconds (`worker.peer_watch`), instead of
        at the collective timeout. A world already superseded reports its members that are
        not in the next one.
        """
        g, cv = request.generation, self._roster.cv
        deadline = time.monotonic() + request.timeout_s
        with cv:
            while True:
                failed, gone = self._failed_members(g), self._left(g)
                regrow = g in self._regrow and g == self.book.generation
                remaining = deadline - time.monotonic()
                if failed or gone or regrow or remaining <= 0 or self._closed:
                    break
                cv.wait(timeout=min(remaining, 0.5))
            if regrow and not failed:  # no one died: re-form, larger (also once some
                # members went to the agreement: it is theirs, not a failure)
                return wire.WorldFailed(generation=g, failed=(), regrow=True)
            return wire.WorldFailed(generation=g, failed=failed, left=() if failed else gone)

    def _left(self, generation: int) -> tuple[int, ...]:
        """Members of the current world ``generation`` that arrived at its agreement: they
        saw it fail (call with ``roster.cv`` held)."""
        return tuple(sorted(self.book.arrived)) if generation == self.book.generation else ()

    def _failed_members(self, generation: int) -> tuple[int, ...]:
        """Members of world ``generation`` known dead (call with ``roster.cv`` held)."""
        members = self.worlds.get(generation, ())
        if generation == self.book.generation:
            return tuple(m for m in members if m in self.book.dead)
        after = self.worlds.get(generation + 1)
        if after is None:  # not formed yet, or unknown
            return ()
        return tuple(m for m in members if m not in after)

    def _decide(self, book: AgreementBook) -> dict[int, Agreement]:
        replies = self._roster.holdings()
        for address, reply in replies.items():
            for bad in reply.corrupt:
                self._record({"op": "corrupt_copy", "agent": address, **dataclasses.asdict(bad)})
        holdings = {address: list(reply.copies) for address, reply in replies.items()}
        g = book.generation
        if (g > 0 and len(self.worlds[g]) > len(self.worlds[g - 1])
                and self._barriers.decided((g, compiled_barrier(g))) != ()):
            # A world that grew back and never formed (a member died before its first
            # compile's barrier): its joiners leave with it. They hold nothing, and the
            # survivors are still on the smaller world's layout; they may grow again.
            for joiner in self._fresh.get(g, ()):
                if joiner in book.arrived:
                    book.mark_dead(joiner)
                    self._record({"op": "evicted", "worker_id": joiner,
                                  "why": f"world {g} never formed"})
                    if self._on_drop is not None:
                        self._on_drop(joiner)
                    self._roster.command(joiner, wire.KillWorker())
        arrived = [m for m in book.members if m in book.arrived]
        generation = g + 1
        joiners = self._joiners(book)
        # A spare for every dead member or free rank (`AgreementBook.decide`), or none.
        need = self._open_slots(book, book.arrived)
        size = len(arrived) + need if need and len(joiners) >= need else len(arrived)
        service = self._services.start(generation, size)
        try:
            decision = book.decide(coordinator=service.address, holdings=holdings,
                                   homes=self._roster.addresses, members_of=self.worlds,
                                   joiners=joiners, slots=self._slots,
                                   full_size=len(self.worlds[0]))
        except AgreementError:
            self._services.stop(generation)
            raise
        first = next(iter(decision.values()))
        survivors = list(first.survivors)  # the new world's members, in rank order
        self._record({"op": "decided", "generation": generation, "survivors": survivors,
                      "resume_step": first.resume_step, "lost": list(first.lost),
                      "replaces": {str(j): d for j, d in first.replaces.items()}})
        logger.info("mnemojax launch: world %d: workers %s, %s, coordination service on %s",
                    generation, survivors, first.resume_said, service.address)
        self._fresh[generation] = tuple(first.replaces)
        for joiner, dead_member in first.replaces.items():
            self._slots[joiner] = self._slots[dead_member]
            if self._on_join is not None:
                self._on_join(joiner, decision[joiner])
        self.book = AgreementBook(generation, survivors)
        self.worlds[generation] = tuple(survivors)
        if self._services.stop(book.generation):  # service last: every survivor detached
            self._record({"op": "old_service_stopped", "generation": book.generation})
        live = [m for m in survivors if m in self._roster.links]
        for i, m in enumerate(live):  # the new ring over the survivors' agents
            buddy = self._roster.addresses[live[(i + 1) % len(live)]] if len(live) > 1 else None
            self._roster.command(m, wire.SetBuddy.for_world(buddy, first))
        self._roster.cv.notify_all()
        return decision
