"""The launcher's view of its agents: links, addresses, their workers' pids and exits.

One condition variable (`AgentRoster.cv`) guards all of it, and the agreement book too
(`arbiter`): an agent's event (a worker exit) and a survivor's arrival at the barrier
must be seen in one order by everyone waiting on it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
from collections.abc import Sequence

from mnemojax._src.distributed import transport, wire
from mnemojax._src.errors import ProtocolError


class AgentRoster:
    """Who is connected. Read and change the dicts with `cv` held.

    Args:
        secret: the job secret (`auth`), proved when it asks the agents what they hold.

    Attributes:
        cv: the launcher's one lock (a condition: waiters are woken on every change).
        links: worker id -> the agent's persistent link (events in, commands out).
        addresses: worker id -> the address the agent serves snapshots on.
        worker_pids: worker id -> the pid of the worker its agent started.
        exit_codes: worker id -> how its worker ended (negative: killed by that signal).
    """

    def __init__(self, *, secret: bytes):
        self.secret = secret
        self.cv = threading.Condition()
        self.links: dict[int, socket.socket] = {}
        self.addresses: dict[int, str] = {}
        self.worker_pids: dict[int, int] = {}
        self.exit_codes: dict[int, int] = {}

    def join(self, worker_id: int, link: socket.socket, address: str) -> None:
        self.links[worker_id], self.addresses[worker_id] = link, address

    def leave(self, worker_id: int) -> None:
        self.links.pop(worker_id, None)
        self.addresses.pop(worker_id, None)

    def command(self, worker_id: int, command: wire.Command) -> None:
        """Sends a command to a connected agent (a gone agent is ignored)."""
        link = self.links.get(worker_id)
        if link is not None:
            with contextlib.suppress(OSError):
                transport.send(link, command)

    def command_all(self, command: wire.Command, *, but: int | None = None) -> None:
        for worker_id in list(self.links):
            if worker_id != but:
                self.command(worker_id, command)

    def holdings(self, *, timeout_s: float = 60.0) -> dict[str, wire.Holdings]:
        """Asks every connected agent, at once, for its copies (each CRC-checked by the
        agent). An agent that cannot answer holds nothing usable and is left out."""
        return ask_holdings(list(self.addresses.values()), secret=self.secret,
                            timeout_s=timeout_s)


def ask_holdings(addresses: Sequence[str], *, secret: bytes,
                 timeout_s: float = 60.0) -> dict[str, wire.Holdings]:
    """Asks every agent at ``addresses``, at once, for its CRC-checked copies. An agent that
    cannot answer holds nothing usable and is left out."""
    def ask(address: str) -> wire.Holdings | None:
        try:
            return transport.request(address, wire.HoldingsQuery(), wire.Holdings,
                                     secret=secret, timeout_s=timeout_s)[0]
        except (OSError, ConnectionError, ProtocolError):
            return None

    with concurrent.futures.ThreadPoolExecutor(max(1, len(addresses))) as pool:
        replies = list(pool.map(ask, addresses))
    return {a: r for a, r in zip(addresses, replies, strict=True) if r is not None}
