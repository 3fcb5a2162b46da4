"""Test doubles and helpers for the multi-process layer's unit tests (no JAX world)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from mnemojax._src.distributed import transport, wire
from mnemojax._src.distributed.agent.agent import Agent
from mnemojax._src.distributed.snapshot_codec import read_meta, select
from mnemojax._src.distributed.worker.recovery import AgreedCopies

SECRET = bytes(range(32))  # the job secret of the unit tests' agents


class FakeLauncher:
    """Accepts (authenticated) agent links, records their events, and lets a test send
    them commands."""

    def __init__(self):
        self.server, self.address = transport.listen()
        self.links: dict[int, socket.socket] = {}
        self.addresses: dict[int, str] = {}
        self.events: list[wire.Message] = []
        self.refused: list[tuple[str, str]] = []
        threading.Thread(target=transport.accept_loop, args=(self.server, self._read),
                         kwargs={"secret": SECRET,
                                 "on_refused": lambda *r: self.refused.append(r)},
                         daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            while True:
                message, _ = transport.recv(conn)
                if isinstance(message, wire.Hello):
                    self.links[message.worker_id] = conn
                    self.addresses[message.worker_id] = message.address
                self.events.append(message)
        except (OSError, ConnectionError):
            return

    def command(self, worker_id: int, command: wire.Command) -> None:
        transport.send(self.links[worker_id], command)

    def close(self) -> None:
        for c in self.links.values():
            # A plain close from this thread wakes neither this side's reader nor the
            # agent's link reader, both blocked in recv: shut the connection down first.
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        transport.close_server(self.server)


@contextlib.contextmanager
def running_agents(n: int = 2) -> Iterator[tuple[FakeLauncher, list[Agent]]]:
    """``n`` agents (threads of this process, no workers) linked to a fake launcher; shut
    down and joined on exit."""
    fake = FakeLauncher()
    # Segment names of their own: two test runs at once must not take each other's.
    prefix = f"mnjxtest{os.getpid()}_{secrets.token_hex(3)}_"
    agents = [Agent(worker_id=i, launcher=fake.address, command=[], secret=SECRET,
                    shm_prefix=prefix) for i in range(n)]
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(fake.addresses) == n)
        yield fake, agents
    finally:
        for i in list(fake.links):
            fake.command(i, wire.Shutdown())
        for t in threads:
            t.join(timeout=30)
        fake.close()
    assert not any(t.is_alive() for t in threads)


def closed_without_reply(sock: socket.socket) -> bool:
    """The peer closed the connection (unread bytes make that a reset) without a word."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_until(cond: Callable[[], object], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def held(agent_address: str) -> tuple[dict[str, list[int]], list[wire.CorruptCopy]]:
    """What an agent holds: ``{origin: [steps]}`` and its corrupt copies."""
    reply, _ = transport.request(agent_address, wire.HoldingsQuery(), wire.Holdings,
                                 secret=SECRET)
    steps: dict[str, list[int]] = {}
    for c in reply.copies:
        steps.setdefault(str(c.origin), []).append(c.step)
    return steps, list(reply.corrupt)


def local_copies(payloads: Mapping[int, bytes], step: int, *, generation: int = 0,
                 requests: list | None = None) -> AgreedCopies:
    """The agreed copies of ``payloads`` (old worker id -> payload) as an agent would serve
    them (`snapshot_codec.select`), without sockets; each request is appended to
    ``requests`` as ``(origin, boxes)``."""

    def fetch(addrs, origin, step_asked, *, secret, boxes):
        del secret
        assert step_asked == step
        if requests is not None:
            requests.append((origin, list(boxes)))
        return bytearray(b"".join(select(payloads[origin], boxes))), addrs[0]

    return AgreedCopies(step, generation, {o: read_meta(p) for o, p in payloads.items()},
                        {o: (f"agent-{o}",) for o in payloads}, b"", fetch=fetch)
