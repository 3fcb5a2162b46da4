"""The agent's endpoint: requests from its worker, from peer agents and from the launcher.

Its worker (one persistent connection, `worker.agent_client.AgentClient`) asks for slots
(`wire.Alloc`), says it published a step (`wire.Published`: the watchdog's progress signal,
and what triggers replication), waits before the next publish until the buddy has the
last one (`wire.AwaitReplicated`), which phase it is in (`wire.Phase`, passed on to the
launcher as `wire.WorkerPhase`) and, at a peer failure, what it holds that its snapshots
lack (`wire.Hold`). The predecessor's
agent pushes replicas (`wire.Replica`); survivors fetch copies (`wire.Get`); the launcher
asks what is held (`wire.HoldingsQuery`) when survivors agree. Every connection must prove
the job secret first (`transport.accept_loop`); a refused one is reported to the launcher
(`wire.RefusedConnection`). No JAX here.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from mnemojax._src.checksum import checksum
from mnemojax._src.distributed import snapshot_codec, transport, wire
from mnemojax._src.distributed.agent.replication import Replicator
from mnemojax._src.distributed.agent.snapshots import SnapshotHolder
from mnemojax._src.distributed.agent.watchdog import HangWatchdog
from mnemojax._src.errors import ProtocolError, SnapshotCorruptError


class AgentServer:
    """Listens on a free loopback port (``address``); one thread per connection.

    Args:
        worker_id: the agent's worker.
        holder, replicator, watchdog: what the requests act on.
        report: sends an event to the launcher.
        stop: ends the accept loop.
        secret: the job secret every connection must prove (`auth`).
        host: the address to listen on.
    """

    def __init__(self, worker_id: int, *, holder: SnapshotHolder, replicator: Replicator,
                 watchdog: HangWatchdog, report: Callable[[wire.AgentEvent], None],
                 stop: threading.Event, secret: bytes, host: str = "127.0.0.1"):
        self.worker_id = worker_id
        self._holder, self._replicator, self._watchdog = holder, replicator, watchdog
        self._report, self._stop, self._secret = report, stop, secret
        self._server, self.address = transport.listen(host)

    def start(self) -> None:
        threading.Thread(target=transport.accept_loop, args=(self._server, self._handle),
                         kwargs={"stop": self._stop, "secret": self._secret,
                                 "on_refused": self._refused}, daemon=True).start()

    def _refused(self, peer: str, reason: str) -> None:
        self._report(wire.RefusedConnection(worker_id=self.worker_id, peer=peer,
                                            reason=reason[:200]))

    def close(self) -> None:
        transport.close_server(self._server)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    try:
                        message, payload = transport.recv(
                            conn, before_payload=self._before_payload)
                    except ProtocolError as e:  # answer, then drop the connection
                        transport.send(conn, wire.ErrorReply(message=str(e)))
                        return
                    reply = self._dispatch(message, payload)
                    if reply is not None:
                        transport.send(conn, *reply)
            except (OSError, ConnectionError):
                return

    def _before_payload(self, message: wire.Message) -> None:
        if isinstance(message, wire.Replica) and message.make_room:
            self._holder.replicas.make_room(message.origin, message.step,
                                            generation=message.generation)

    def _dispatch(self, message: wire.Message,
                  payload: bytearray) -> tuple[wire.Message, bytes | bytearray] | None:
        now = time.monotonic()
        if isinstance(message, wire.Alloc):
            return self._holder.allocate(message.nbytes, message.budget_bytes), b""
        if isinstance(message, wire.Published):
            self._watchdog.progress(message.step, now)
            # The slots a bigger segment replaced may go now.
            self._holder.published(in_series=message.in_series)
            self._replicator.published(message.step)
            # Last: once the launcher hears of it, the replicator knows of it too.
            self._report(wire.Progress(worker_id=self.worker_id, step=message.step))
            return None
        if isinstance(message, wire.AwaitReplicated):
            # At most half the hang floor: the wait sits between two progress signals.
            caught_up, detail = self._replicator.wait_caught_up(
                min(message.timeout_s, self._watchdog.min_s / 2))
            return wire.Replicated(caught_up=caught_up, detail=detail), b""
        if isinstance(message, wire.Hold):
            return self._holder.accept_held(message, payload), b""
        if isinstance(message, wire.InStep):  # (not passed on to the launcher)
            self._watchdog.step_bounds(message.inside, now)
            return None
        if isinstance(message, wire.Phase):
            self._watchdog.set_phase(message.phase, now)
            self._report(wire.WorkerPhase(worker_id=self.worker_id, phase=message.phase))
            return None
        if isinstance(message, wire.Replica):
            return self._holder.accept_replica(message, payload), b""
        if isinstance(message, wire.Get):
            return self._serve(message)
        if isinstance(message, wire.HoldingsQuery):
            return self._holder.verified_copies(), b""
        return wire.ErrorReply(message=f"unknown op {message.OP!r}"), b""

    def _serve(self, get: wire.Get) -> tuple[wire.Message, bytes | bytearray]:
        """A copy (`wire.Get`): whole, as its holder checked it; or its header or the parts
        inside the asked boxes, cut from the copy once it checks, with their own checksum
        (its own worker's cut in its slot, not copied out first: a recovery's fetches add
        only what they send)."""
        what = f"worker {get.origin} step {get.step}"
        cut = get.header_only or get.boxes is not None
        try:
            if cut and get.origin == self.worker_id:
                with self._holder.lend(step=get.step) as view:
                    reply = self._cut(get, what, view.data, view.crc)
                    if not view.intact():
                        reply = wire.ErrorReply(
                            message=f"the copy of {what} was rewritten while it was read"), b""
                return reply
            data, crc = self._holder.get(get.origin, get.step)
        except (KeyError, SnapshotCorruptError) as e:
            return wire.ErrorReply(message=f"no copy of {what}: {e}"), b""
        if cut:
            return self._cut(get, what, data, crc)
        return wire.Snapshot(origin=get.origin, step=get.step, crc=crc), data

    @staticmethod
    def _cut(get: wire.Get, what: str, data: bytes | bytearray | memoryview,
             crc: int) -> tuple[wire.Message, bytes | bytearray]:
        """The header or the boxes ``get`` asks for, cut from ``data`` once it checks
        against ``crc`` (never a fresh checksum over a bad copy)."""
        if checksum(data) != crc:
            return wire.ErrorReply(message=f"the copy of {what} fails its check"), b""
        try:
            out = (snapshot_codec.header(data) if get.header_only else
                   b"".join(snapshot_codec.select(data, get.boxes or ())))
        except ValueError as e:
            return wire.ErrorReply(message=f"the copy of {what}: {e}"), b""
        return wire.Snapshot(origin=get.origin, step=get.step, crc=checksum(out)), out
