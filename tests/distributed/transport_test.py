"""`distributed.transport`: frames and request/reply on loopback."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from mnemojax._src.distributed import transport, wire
from mnemojax._src.errors import ProtocolError


def _serve_once(reply_frame: bytes | None = None, reply: wire.Message | None = None):
    """A one-shot server: reads one message, answers with ``reply`` (or raw bytes)."""
    server, address = transport.listen()
    got: list[tuple[wire.Message, bytearray]] = []

    def run():
        conn, _ = server.accept()
        with conn:
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
    reply, data = transport.request(address, wire.Get(origin=0, step=3), wire.Snapshot)
    thread.join(timeout=10)
    assert reply == wire.Snapshot(origin=0, step=3, crc=7) and data == b"payload"
    assert got[0] == (wire.Get(origin=0, step=3), bytearray())


def test_error_reply_and_unexpected_reply_are_protocol_errors():
    address, _, thread = _serve_once(reply=wire.ErrorReply(message="no copy"))
    with pytest.raises(ProtocolError, match="get to .* failed: no copy"):
        transport.request(address, wire.Get(origin=0, step=3), wire.Snapshot)
    thread.join(timeout=10)
    address, _, thread = _serve_once(reply=wire.Ok())
    with pytest.raises(ProtocolError, match="expected a 'snapshot' message, got 'ok'"):
        transport.request(address, wire.Get(origin=0, step=3), wire.Snapshot)
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
