"""Buddy replication: each newly published snapshot goes to the ring successor's agent.

So losing a whole host (worker and agent) loses no state: its successor holds a copy.
Transport: plain TCP on loopback (`transport`), one persistent connection to the current
buddy. TCP works unchanged across hosts, has flow control and needs nothing from JAX, whose
collectives belong to the very world that is failing. The buddy checks the CRC32C on receipt.
No JAX here.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from mnemojax._src.distributed import transport, wire
from mnemojax._src.distributed.agent.snapshots import SnapshotHolder
from mnemojax._src.distributed.snapshot_codec import read_meta
from mnemojax._src.errors import ProtocolError, SnapshotCorruptError

logger = logging.getLogger("mnemojax")

SEND_TIMEOUT_S = 10.0  # a replica's send: this, plus its size at the floor rate below
SEND_FLOOR_BYTES_PER_S = 50e6


class Replicator:
    """Pushes the newest snapshot to the buddy; `run` is its thread.

    Args:
        worker_id: the origin of the copies sent.
        holder: where the snapshots are.
        stop: ends `run`.
        secret: the job secret (`auth`): the buddy must prove it before it gets a copy.
    """

    def __init__(self, worker_id: int, holder: SnapshotHolder, stop: threading.Event, *,
                 secret: bytes):
        self.worker_id, self._holder, self._stop = worker_id, holder, stop
        self._secret = secret
        self._cv = threading.Condition()
        self._any_published = False
        self._buddy: str | None = None
        # Bumped at every publish and every new buddy: what `run` has sent is a version,
        # not a step number, so a step published again (a new world replays it under the
        # same number) is sent again, and a new buddy gets the newest copy at once.
        self._version = 0
        self._sent = 0  # the version `run` last sent (or found nothing to send at)
        self._failing: str | None = None  # why the last send failed, until one succeeds
        self._refused: str | None = None  # why the buddy refused the last copy sent
        # The step a new world resumed from, until the worker publishes in it: the copy a
        # new buddy needs (the newest may be the old world's abandoned next step).
        self._resume: int | None = None

    def published(self, step: int) -> None:
        """The worker published ``step``: send it (or a newer one) next."""
        with self._cv:
            self._any_published = True
            self._resume = None
            self._version += 1
            self._cv.notify()

    def set_buddy(self, buddy: str | None, *, resume_step: int | None = None) -> None:
        """Replicate to ``buddy`` from now on (None: nobody); a new buddy gets copies at
        once, without waiting for the next publish: of ``resume_step`` (the step a new
        world resumed from) when held, then the newest if it is another step (a publish
        of the new world may have come first; the buddy keeps two)."""
        with self._cv:
            # (-1: resumed from the persistent tier, of which the agent holds no copy)
            self._resume = resume_step if resume_step is not None and resume_step >= 0 else None
            if buddy != self._buddy:
                self._buddy, self._failing = buddy, None
                self._version += 1
                self._cv.notify()

    def wait_caught_up(self, timeout_s: float) -> tuple[bool, str]:
        """Waits until the newest copy has been sent after every publish so far and the
        buddy kept it (or there is nothing to send), at most ``timeout_s``; returns at once
        while sending fails or when the buddy refused the last copy.

        Returns:
            (caught up, why not).
        """
        with self._cv:
            target = self._version
            self._cv.wait_for(lambda: self._sent >= target or self._failing is not None
                              or self._stop.is_set(), timeout=timeout_s)
            if self._sent >= target and self._refused is None:
                return True, ""
            if self._refused is not None:
                return False, f"{self._buddy} refused the last copy: {self._refused}"
            if self._failing is not None:
                return False, f"replication to {self._buddy} fails: {self._failing}"
            return False, (f"the copy to {self._buddy} is still being sent after "
                           f"{timeout_s:g} s")

    def _done(self, version: int, *, failing: str | None = None,
              refused: str | None = None) -> None:
        with self._cv:
            if failing is None:
                self._sent, self._refused = version, refused
            self._failing = failing
            self._cv.notify_all()

    def _send(self, sock: socket.socket, want: int | None, *, skip: int | None,
              resuming: bool) -> tuple[str | None, int] | None:
        """Sends its worker's copy of step ``want`` (None, or not held: the newest) unless
        it is of step ``skip`` (just sent); returns (the buddy's refusal or None, the step
        sent), or None when nothing was sent. ``resuming``: a new world's resumed step is
        still to reach the buddy (no publish in it yet)."""
        # Sent straight from its slot, unchecked: the buddy checks every replica it
        # receives, so a slot rewritten meanwhile (a worker that did not wait for this
        # copy) is refused there, not kept.
        with self._holder.lend(prefer=want) as lent:
            if lent.step == skip:
                return None
            # In series (and its last wait for the buddy did not give up: the worker
            # says so with each publish), the newest copy of a worker that published it
            # means the step before is held by every buddy and every worker finished it
            # (lockstep): its buddy may drop what this copy outdates before it arrives
            # (`ReplicaStore.make_room`). Not for the copies a new buddy gets of the step
            # a world resumed from (`resuming`, until the worker publishes in it).
            make_room = self._holder.in_series and want is None and not resuming
            try:
                generation = int(read_meta(lent.data).get("generation", 0))
            except (ValueError, TypeError):  # the buddy refuses it (not a snapshot)
                generation, make_room = 0, False
            # The timeout covers the whole send: at least 10 s, more for a large copy.
            sock.settimeout(SEND_TIMEOUT_S + len(lent.data) / SEND_FLOOR_BYTES_PER_S)
            transport.send(sock, wire.Replica(origin=self.worker_id, step=lent.step,
                                              crc=lent.crc, make_room=make_room,
                                              generation=generation), lent.data)
            step, intact = lent.step, lent.intact()
        if not intact:
            logger.warning("agent %d: worker %d's snapshot of step %d was rewritten while it "
                           "was sent; its buddy refuses that copy", self.worker_id,
                           self.worker_id, step)
        reply, _ = transport.recv(sock)
        return (reply.message if isinstance(reply, wire.ErrorReply) else None), step

    def run(self) -> None:
        sock: socket.socket | None = None
        target: str | None = None
        said: tuple | None = None  # (buddy, error type) of the failure told last
        repeats = 0  # failures since, told at DEBUG (a lost buddy fails every 0.2 s)
        while not self._stop.is_set():
            with self._cv:
                self._cv.wait_for(lambda: self._version != self._sent or self._stop.is_set(),
                                  timeout=0.5)
                version, buddy, any_published = self._version, self._buddy, self._any_published
                resume = self._resume
            if version == self._sent:
                continue
            if buddy is None or not any_published:
                self._done(version)
                continue
            try:
                if sock is None or target != buddy:
                    if sock is not None:
                        sock.close()
                    sock, target = transport.connect(buddy, secret=self._secret), buddy
                refused, sent = None, None
                for want in (resume, None):
                    result = self._send(sock, want, skip=sent, resuming=resume is not None)
                    if result is not None:
                        refused, sent = refused or result[0], result[1]
                # A refusal (budget, check) of either copy is the buddy's to report to the
                # launcher; the worker's wait hears of it.
                self._done(version, refused=refused)
                if said is not None:
                    logger.warning("agent %d: replication to %s works again (%d more "
                                   "failures since the one told)", self.worker_id, buddy,
                                   repeats)
                    said, repeats = None, 0
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one send
                expected = isinstance(e, (OSError, ConnectionError, ProtocolError, KeyError,
                                          SnapshotCorruptError))
                again = expected and said == (buddy, type(e))
                repeats += again
                said = (buddy, type(e))
                logger.log(logging.DEBUG if again else
                           logging.WARNING if expected else logging.ERROR,
                           "agent %d: replication to %s failed: %s%s", self.worker_id, buddy,
                           e, " (told once until it works again)" if not again else "",
                           exc_info=not expected)
                self._done(version, failing=f"{type(e).__name__}: {e}")
                if sock is not None:
                    sock.close()
                sock = None
                time.sleep(0.2)
        if sock is not None:
            sock.close()
        with self._cv:
            self._cv.notify_all()  # a waiter returns: stopping
