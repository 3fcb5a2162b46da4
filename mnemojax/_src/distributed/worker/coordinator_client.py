"""The worker's side of the agreement: the `Coordinator` it calls after a peer failure.

`LauncherCoordinator` implements it against the launcher's control endpoint on one machine
(`launcher.arbiter` answers); a later issue can put the same calls on etcd. No JAX here.
"""

from __future__ import annotations

from typing import Protocol

from mnemojax._src.distributed import transport, wire
from mnemojax._src.distributed.agreement import Agreement
from mnemojax._src.errors import AgreementError, ProtocolError


class Coordinator(Protocol):
    """The agreement service a worker talks to (launcher today, etcd later)."""

    def report_failure(self, *, generation: int, reason: str) -> None:
        """Tells the coordinator this worker saw a failure in world ``generation``."""
        ...

    def leave(self, *, generation: int, reason: str) -> None:
        """This worker leaves the job from world ``generation`` (`wire.Leave`): the others'
        next agreement goes on without it, as without a dead member, and its later exit,
        whatever its status, is no failure."""
        ...

    def agree(self, *, generation: int, last_step: int,
              first_replayable: int | None = None) -> Agreement:
        """Barrier over the live members of world ``generation``; returns the decision.

        ``first_replayable``: the oldest step whose batch the caller still keeps (it can
        resume from any step at or after ``first_replayable - 1``).

        Call after detaching from world ``generation``. Atomic: every survivor gets the same
        decision (its own rank in it), or every call raises `AgreementError`.
        """
        ...

    def barrier(self, *, generation: int, name: str, timeout_s: float) -> tuple[int, ...]:
        """Barrier over the members of world ``generation``: returns ``()`` once every
        member has arrived, or the members that died first (at once, not at a timeout).

        Atomic: every member gets the same outcome. A member missing ``timeout_s`` after
        this call is evicted (killed), which fails the barrier.
        """
        ...

    def watch(self, *, generation: int, timeout_s: float) -> wire.WorldFailed:
        """Returns the members of world ``generation`` known dead as soon as there is one,
        or that the world is to re-form larger (``regrow``), or the members that left it
        for the next agreement (``left``), or none of these after ``timeout_s`` (a long
        poll; `peer_watch`)."""
        ...


class LauncherCoordinator:
    """`Coordinator` backed by the launcher's control endpoint (one machine).

    Args:
        control: ``host:port`` of the launcher (``MNEMOJAX_CONTROL``).
        worker_id: this worker's stable id.
        timeout_s: bound on one barrier call (the launcher's own deadline is shorter).
        secret: the job secret (`auth`); the launcher must prove it too.
    """

    def __init__(self, control: str, worker_id: int, *, secret: bytes,
                 timeout_s: float = 300.0):
        self.control, self.worker_id, self.timeout_s = control, worker_id, timeout_s
        self._secret = secret

    def _call(self, message: wire.ReportFailure | wire.Leave | wire.Agree | wire.Barrier
                    | wire.WatchWorld,
              reply: type[transport.M], *, timeout_s: float | None = None) -> transport.M:
        try:
            answer, _ = transport.request(
                self.control, message, reply, secret=self._secret,
                timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        except (OSError, ConnectionError, ProtocolError) as e:
            raise AgreementError(f"{message.OP} failed: {e}",
                                 generation=message.generation) from e
        return answer

    def report_failure(self, *, generation: int, reason: str) -> None:
        self._call(wire.ReportFailure(worker_id=self.worker_id, generation=generation,
                                      reason=reason), wire.Ok)

    def leave(self, *, generation: int, reason: str) -> None:
        self._call(wire.Leave(worker_id=self.worker_id, generation=generation,
                              reason=reason), wire.Ok)

    def agree(self, *, generation: int, last_step: int,
              first_replayable: int | None = None) -> Agreement:
        return self._call(wire.Agree(worker_id=self.worker_id, generation=generation,
                                     last_step=last_step, first_replayable=first_replayable),
                          wire.AgreementReply).agreement

    def barrier(self, *, generation: int, name: str, timeout_s: float) -> tuple[int, ...]:
        # The launcher evicts a missing member at timeout_s; the reply follows at once.
        return self._call(wire.Barrier(worker_id=self.worker_id, generation=generation,
                                       name=name, timeout_s=timeout_s),
                          wire.BarrierReply, timeout_s=timeout_s + 30.0).failed

    def await_join(self, *, timeout_s: float) -> Agreement | None:
        """A spare waits up to ``timeout_s`` for a world to take it in: its agreement, or
        None (ask again).

        Raises:
            AgreementError: the job is ending, or the launcher cannot be reached.
        """
        try:
            reply, _ = transport.request(
                self.control, wire.AwaitJoin(worker_id=self.worker_id, timeout_s=timeout_s),
                wire.Joined, secret=self._secret, timeout_s=timeout_s + 30.0)
        except (OSError, ConnectionError, ProtocolError) as e:
            raise AgreementError(f"await_join failed: {e}", generation=-1) from e
        return reply.agreement

    def watch(self, *, generation: int, timeout_s: float) -> wire.WorldFailed:
        return self._call(wire.WatchWorld(worker_id=self.worker_id, generation=generation,
                                          timeout_s=timeout_s),
                          wire.WorldFailed, timeout_s=timeout_s + 30.0)
