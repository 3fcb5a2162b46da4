"""The launcher's barriers over a world's members, each decided once (pure).

Workers meet at a barrier after every compile (`worker.session.DistributedSession.compiled`)
so that no peer enters a collective while another still compiles. JAX's own barrier
(``wait_at_barrier``) only fails at its timeout when a member dies, and the coordination
service learns of a SIGKILLed member from missed heartbeats only; the launcher learns of
it from the member's agent within milliseconds. So the barrier is kept here, next to the
agreement: `arbiter.Arbiter.barrier` runs this book under the launcher's lock.

Atomic: the first outcome decided for a barrier is every member's outcome. It passes when
every member has arrived while none is dead; it fails, naming the dead, as soon as a member
is dead before that (also one that arrived, then died: it cannot run the next collective).
"Dead" here also covers a member gone to the next agreement (the arbiters pass those in):
it will not run the next collective either.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

BarrierKey = tuple[int, str]  # (generation, name)


class BarrierBook:
    """Arrivals and outcomes of the barriers of every world (pure; no clock, no lock)."""

    def __init__(self) -> None:
        self._arrived: dict[BarrierKey, set[int]] = {}
        self._outcome: dict[BarrierKey, tuple[int, ...]] = {}

    def arrive(self, key: BarrierKey, worker_id: int) -> None:
        self._arrived.setdefault(key, set()).add(worker_id)

    def decided(self, key: BarrierKey) -> tuple[int, ...] | None:
        """The barrier's outcome if decided (``()`` passed), else None."""
        return self._outcome.get(key)

    def missing(self, key: BarrierKey, members: Sequence[int]) -> list[int]:
        """Members that have not arrived."""
        arrived = self._arrived.get(key, set())
        return [m for m in members if m not in arrived]

    def outcome(self, key: BarrierKey, members: Sequence[int],
                dead: Collection[int]) -> tuple[int, ...] | None:
        """The barrier's outcome, decided now if it can be: ``()`` passed, the dead members
        (non-empty) failed, ``None`` still open. ``dead``: the members that cannot run the
        next collective (dead, or gone to the next agreement)."""
        if key in self._outcome:
            return self._outcome[key]
        gone = tuple(m for m in members if m in dead)
        if gone:
            self._outcome[key] = gone
        elif not self.missing(key, members):
            self._outcome[key] = ()
        return self._outcome.get(key)
