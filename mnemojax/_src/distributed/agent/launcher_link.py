"""The agent's persistent link to the launcher: its events out, the launcher's commands in."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from mnemojax._src.distributed import transport, wire
from mnemojax._src.errors import ProtocolError

logger = logging.getLogger("mnemojax")


class LauncherLink:
    """Connects at construction; `start` reads commands into `commands` on a thread.

    Args:
        address: the launcher's control endpoint (``host:port``).
        on_lost: called when an event cannot be sent (the launcher is gone).
        secret: the job secret (`auth`).

    Attributes:
        commands: the launcher's commands in arrival order; a `wire.Shutdown` is queued
            when the link breaks.
    """

    def __init__(self, address: str, *, on_lost: Callable[[], None], secret: bytes):
        self._sock = transport.connect(address, timeout_s=30, secret=secret)
        self._sock.settimeout(None)
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self.commands: queue.Queue[wire.Command] = queue.Queue()

    def report(self, event: wire.AgentEvent) -> None:
        """Sends one event (from any thread)."""
        with self._send_lock:
            try:
                transport.send(self._sock, event)
            except OSError:
                self._on_lost()  # nothing left to serve

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                message, _ = transport.recv(self._sock)
                if isinstance(message, wire.Command):
                    self.commands.put(message)
                else:
                    logger.warning("agent: ignored %r from the launcher", message.OP)
        except (OSError, ConnectionError, ProtocolError):
            self.commands.put(wire.Shutdown())
