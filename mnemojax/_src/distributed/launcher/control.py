"""The launcher's control endpoint: agents' links and workers' requests, one port.

A connection that opens with `wire.Hello` is an agent's persistent link: its events
(`wire.AgentEvent`) flow in until it breaks, and the launcher's commands flow out on it
(`roster.AgentRoster.command`). Any other connection is one request and its reply (a
worker's `wire.ReportFailure`, `wire.Agree` or `wire.Barrier`). Each connection has its
own thread, and must prove the job secret before its first message
(`transport.accept_loop`); one that does not is closed, logged and reported to
``on_refused``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Protocol

from mnemojax._src.distributed import transport, wire
from mnemojax._src.errors import ProtocolError


class ControlHandler(Protocol):
    """What the launcher does with what arrives (`launcher.Launcher` implements it)."""

    def agent_joined(self, hello: wire.Hello, link: socket.socket) -> None: ...

    def agent_event(self, worker_id: int, event: wire.AgentEvent) -> None: ...

    def agent_lost(self, worker_id: int) -> None:
        """The link broke (the agent died or sent garbage)."""
        ...

    def request(self, message: wire.Message) -> wire.Message:
        """Answers one request (may block: `wire.Agree` and `wire.Barrier` are barriers)."""
        ...


class ControlServer:
    """Listens on a free loopback port (``address``) and dispatches to ``handler``.

    Args:
        handler: what the launcher does with what arrives.
        secret: the job secret every connection must prove (`auth`).
        on_refused: called with (peer, reason) for each connection refused.
    """

    def __init__(self, handler: ControlHandler, *, secret: bytes,
                 on_refused: Callable[[str, str], None] | None = None):
        self._handler, self._secret, self._on_refused = handler, secret, on_refused
        self._server, self.address = transport.listen()

    def start(self) -> None:
        threading.Thread(target=transport.accept_loop, args=(self._server, self._handle),
                         kwargs={"secret": self._secret, "on_refused": self._on_refused},
                         daemon=True).start()

    def close(self) -> None:
        transport.close_server(self._server)

    def _handle(self, conn: socket.socket) -> None:
        try:
            message, _ = transport.recv(conn)
        except (OSError, ConnectionError, ProtocolError):
            conn.close()
            return
        if isinstance(message, wire.Hello):
            self._agent_link(conn, message)
            return
        with conn:
            reply = self._handler.request(message)
            with contextlib.suppress(OSError):
                transport.send(conn, reply)

    def _agent_link(self, link: socket.socket, hello: wire.Hello) -> None:
        self._handler.agent_joined(hello, link)
        try:
            while True:
                event, _ = transport.recv(link)
                if not isinstance(event, wire.AgentEvent):
                    raise ProtocolError(f"agent {hello.worker_id} sent {event.OP!r} on its "
                                        "link", op=event.OP)
                self._handler.agent_event(hello.worker_id, event)
        except (OSError, ConnectionError, ProtocolError):
            self._handler.agent_lost(hello.worker_id)
