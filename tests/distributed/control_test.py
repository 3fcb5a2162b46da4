"""`distributed.launcher.control`: the launcher's port serves only the job's processes."""

from __future__ import annotations

import socket
import threading

import pytest

from mnemojax._src.distributed import transport, wire
from mnemojax._src.distributed.launcher.control import ControlServer
from tests.distributed.fakes import SECRET, closed_without_reply, wait_until


class _Handler:
    """Records what reaches the launcher (nothing, from an outsider)."""

    def __init__(self):
        self.calls: list[object] = []

    def agent_joined(self, hello, link):
        self.calls.append(hello)

    def agent_event(self, worker_id, event):
        self.calls.append(event)

    def agent_lost(self, worker_id):
        self.calls.append(("lost", worker_id))

    def request(self, message):
        self.calls.append(message)
        return wire.Ok()


@pytest.fixture
def control():
    handler, refused = _Handler(), []
    server = ControlServer(handler, secret=SECRET,
                           on_refused=lambda peer, why: refused.append((peer, why)))
    server.start()
    yield server, handler, refused
    server.close()


FORGED = [
    wire.Hello(worker_id=0, address="127.0.0.1:1", pid=1),  # would replace agent 0's link
    wire.Agree(worker_id=0, generation=0, last_step=5),  # would end the job
    wire.ReportFailure(worker_id=1, generation=0, reason="forged"),
]


@pytest.mark.parametrize("forged", FORGED, ids=lambda m: m.OP)
def test_an_unauthenticated_client_is_refused_and_reaches_nothing(control, forged):
    server, handler, refused = control
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        challenge, _ = transport.recv(sock)
        assert isinstance(challenge, wire.AuthChallenge)
        transport.send(sock, forged)
        assert closed_without_reply(sock)
    wait_until(lambda: refused)
    assert handler.calls == [] and "expected a 'auth_response'" in refused[0][1]


def test_a_wrong_secret_is_refused_and_the_right_one_served(control):
    server, handler, refused = control
    with pytest.raises(ConnectionError):
        transport.request(server.address, FORGED[2], wire.Ok, secret=b"w" * 32)
    wait_until(lambda: refused)
    assert handler.calls == []
    assert transport.request(server.address, FORGED[2], wire.Ok, secret=SECRET)[0] == wire.Ok()
    assert handler.calls == [FORGED[2]]


def test_an_authenticated_agent_link_is_kept(control):
    server, handler, _ = control
    before = set(threading.enumerate())
    link = transport.connect(server.address, secret=SECRET)
    try:
        transport.send(link, FORGED[0])
        transport.send(link, wire.Progress(worker_id=0, step=3))
        wait_until(lambda: len(handler.calls) == 2)
        assert handler.calls == [FORGED[0], wire.Progress(worker_id=0, step=3)]
    finally:
        link.close()
    wait_until(lambda: ("lost", 0) in handler.calls)
    wait_until(lambda: set(threading.enumerate()) <= before)  # its handler thread ended


def test_closing_the_server_ends_its_accept_thread():
    """On Linux a listening socket closed from another thread leaves ``accept`` blocked:
    each launcher used to leave its accept thread behind (about 50 after the e2e tests,
    which then failed the thread count above)."""
    before = {t for t in threading.enumerate() if "accept_loop" in t.name}
    server = ControlServer(_Handler(), secret=SECRET)
    server.start()
    wait_until(lambda: len({t for t in threading.enumerate()
                            if "accept_loop" in t.name} - before) == 1)
    [thread] = {t for t in threading.enumerate() if "accept_loop" in t.name} - before
    server.close()
    thread.join(timeout=5)
    assert not thread.is_alive()
