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
from mnemojax._src.errors import ProtocolError, SnapshotCorruptError

logger = logging.getLogger("mnemojax")


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

    def published(self, step: int) -> None:
        """The worker published ``step``: send it (or a newer one) next."""
        with self._cv:
            self._any_published = True
            self._version += 1
            self._cv.notify()

    def set_buddy(self, buddy: str | None) -> None:
        """Replicate to ``buddy`` from now on (None: nobody); a new buddy gets the newest
        copy held, without waiting for the next publish."""
        with self._cv:
            if buddy != self._buddy:
                self._buddy = buddy
                self._version += 1
                self._cv.notify()

    def run(self) -> None:
        sock: socket.socket | None = None
        sent = 0  # the version last sent (or with nothing to send)
        target: str | None = None
        while not self._stop.is_set():
            with self._cv:
                self._cv.wait_for(lambda last=sent: self._version != last
                                  or self._stop.is_set(), timeout=0.5)
                version, buddy, any_published = self._version, self._buddy, self._any_published
            if version == sent:
                continue
            if buddy is None or not any_published:
                sent = version
                continue
            try:
                # Not checked here: the buddy checks every replica it receives.
                step, data, crc = self._holder.newest(verify=False)
                if sock is None or target != buddy:
                    if sock is not None:
                        sock.close()
                    sock, target = transport.connect(buddy, secret=self._secret), buddy
                transport.send(sock, wire.Replica(origin=self.worker_id, step=step, crc=crc),
                               data)
                del data  # the copy read out of the slot: not kept while waiting for the next
                transport.recv(sock)  # a refusal (budget) is the buddy's to report
                sent = version
            except (OSError, ConnectionError, ProtocolError, KeyError,
                    SnapshotCorruptError) as e:
                logger.warning("agent %d: replication to %s failed: %s", self.worker_id,
                               buddy, e)
                if sock is not None:
                    sock.close()
                sock = None
                time.sleep(0.2)
        if sock is not None:
            sock.close()
