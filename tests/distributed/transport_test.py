"""`distributed.transport`: frames and request/reply on loopback."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

import pytest

from mnemojax._src.distributed import transport, wire
from mnemojax._src.errors import ProtocolError
from tests.distributed.fakes import closed_without_reply, wait_until

SECRET = b"s" * 32


def _serve_once(reply_frame: bytes | None = None, reply: wire.Message | None = None):
    """A one-shot server: reads one message, answers with ``reply`` (or raw bytes)."""
    server, address = transport.listen()
    got: list[tuple[wire.Message, bytearray]] = []

    def run():
        conn, _ = server.accept()
        with conn:
            transport.server_handshake(conn, SECRET)
            got.append(transport.recv(conn))
            if reply is not None:
                transport.send(conn, reply, b"payload")
            elif reply_frame is not None:
                conn.sendall(reply_frame)
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return address, got, thread


def test_request_sends_a_message_and_types_the_reply():
    address, got, thread = _serve_once(reply=wire.Snapshot(origin=0, step=3, crc=7))
    reply, data = transport.request(address, wire.Get(origin=0, step=3), wire.Snapshot,
                                    secret=SECRET)
    thread.join(timeout=10)
    assert reply == wire.Snapshot(origin=0, step=3, crc=7) and data == b"payload"
    assert got[0] == (wire.Get(origin=0, step=3), bytearray())


def test_error_reply_and_unexpected_reply_are_protocol_errors():
    address, _, thread = _serve_once(reply=wire.ErrorReply(message="no copy"))
    with pytest.raises(ProtocolError, match="get to .* failed: no copy"):
        transport.request(address, wire.Get(origin=0, step=3), wire.Snapshot,
                          secret=SECRET)
    thread.join(timeout=10)
    address, _, thread = _serve_once(reply=wire.Ok())
    with pytest.raises(ProtocolError, match="expected a 'snapshot' message, got 'ok'"):
        transport.request(address, wire.Get(origin=0, step=3), wire.Snapshot,
                          secret=SECRET)
    thread.join(timeout=10)


@pytest.mark.parametrize("frame, match", [
    (struct.pack("!II", transport.MAX_HEADER + 1, 0), "too large"),
    (struct.pack("!II", 3, 0) + b"{x}", "not JSON"),
])
def test_malformed_frames_are_protocol_errors(frame, match):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        with pytest.raises(ProtocolError, match=match):
            transport.recv(b)


def test_a_closed_peer_is_a_connection_error():
    a, b = socket.socketpair()
    with b:
        a.sendall(struct.pack("!II", 10, 0) + b"{}")
        a.close()
        with pytest.raises(ConnectionError):
            transport.recv(b)


class _Server:
    """`transport.accept_loop` on a thread: what it handed over, and what it refused."""

    def __init__(self, secret: bytes = SECRET):
        self.server, self.address = transport.listen()
        self.handled: list[wire.Message] = []
        self.refused: list[tuple[str, str]] = []
        self.done = threading.Event()
        threading.Thread(target=transport.accept_loop, args=(self.server, self._handle),
                         kwargs={"secret": secret, "on_refused": self._refused},
                         daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            message, _ = transport.recv(conn)
            self.handled.append(message)
            transport.send(conn, wire.Ok())

    def _refused(self, peer: str, reason: str) -> None:
        self.refused.append((peer, reason))
        self.done.set()

    def close(self) -> None:
        transport.close_server(self.server)  # (a plain close leaves accept blocked)


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_an_authenticated_request_is_served(server):
    assert transport.request(server.address, wire.HoldingsQuery(), wire.Ok,
                             secret=SECRET)[0] == wire.Ok()
    assert server.handled == [wire.HoldingsQuery()] and server.refused == []


def test_a_wrong_secret_is_refused_before_its_first_message(server):
    with pytest.raises(ConnectionError):
        transport.request(server.address, wire.HoldingsQuery(), wire.Ok, secret=b"x" * 32)
    assert server.done.wait(10)
    assert server.handled == [] and "wrong proof" in server.refused[0][1]


@pytest.mark.parametrize("forged", [
    {"op": "hello", "worker_id": 0, "address": "127.0.0.1:1", "pid": 1},  # no handshake
    {"op": "auth_response", "nonce": "00", "mac": "00" * 32},  # a guessed proof
])
def test_a_raw_client_with_a_forged_request_gets_nothing_but_the_challenge(server, forged):
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        challenge, _ = transport.recv(sock)
        assert isinstance(challenge, wire.AuthChallenge)
        transport.send_frame(sock, forged)
        assert closed_without_reply(sock)  # no reply
    assert server.done.wait(10) and server.handled == []


def test_an_unauthenticated_peer_cannot_make_the_server_allocate(server):
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        transport.recv(sock)
        sock.sendall(struct.pack("!II", 2, 1 << 31) + b"{}")  # a 2 GiB payload announced
        assert closed_without_reply(sock)
    assert server.done.wait(10) and "too large" in server.refused[0][1]


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(server, monkeypatch):
    monkeypatch.setattr(transport, "HANDSHAKE_TIMEOUT_S", 0.2)
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        assert server.done.wait(10)
        assert "timed out" in server.refused[0][1]
        transport.recv(sock)  # the challenge, then the close
        assert closed_without_reply(sock)


def test_the_client_refuses_a_server_that_cannot_prove_the_secret():
    """E.g. a process that took over a dead agent's port: it accepts any proof, but cannot
    make its own, so the client never sends it a request."""
    listener, address = transport.listen()
    got: list[wire.Message] = []

    def impostor():
        conn, _ = listener.accept()
        with conn:
            transport.send(conn, wire.AuthChallenge(nonce="ab" * 32))
            transport.recv(conn)
            transport.send(conn, wire.AuthAccepted(mac="00" * 32))
            with contextlib.suppress(OSError, ConnectionError):
                got.append(transport.recv(conn)[0])

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(ProtocolError, match="did not prove the job secret"):
            transport.request(address, wire.HoldingsQuery(), wire.Ok, secret=SECRET)
        thread.join(timeout=10)
        assert got == []
    finally:
        listener.close()


def test_a_peer_that_closes_during_the_handshake_is_no_refusal(server, caplog):
    """A process that dies while it connects (its socket closed before its proof) was
    neither refused nor served: logged at INFO as ended, with no refusal reported (the
    launcher would record one as an intrusion)."""
    caplog.set_level("INFO", logger="mnemojax")
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        assert isinstance(transport.recv(sock)[0], wire.AuthChallenge)
    wait_until(lambda: "ended before it proved the job secret" in caplog.text)
    assert server.refused == [] and server.handled == []
    assert transport.request(server.address, wire.HoldingsQuery(), wire.Ok,
                             secret=SECRET)[0] == wire.Ok()
