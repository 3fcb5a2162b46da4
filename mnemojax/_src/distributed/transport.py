"""Framing for the loopback control and data connections (launcher, agents, workers).

A frame is ``!II`` (header length, payload length), a UTF-8 JSON header (a `wire` message),
then the raw payload bytes. JSON keeps the control plane debuggable; the payload is binary
so snapshots travel without encoding. No JAX here: the agent imports this.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from mnemojax._src.distributed import wire
from mnemojax._src.errors import ProtocolError

_PREFIX = struct.Struct("!II")
MAX_HEADER = 1 << 20

M = TypeVar("M", bound=wire.Message)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got}/{n} bytes")
        got += k
    return buf


def send_frame(sock: socket.socket, header: dict[str, Any],
               payload: bytes | bytearray | memoryview = b"") -> None:
    """Sends one frame (a JSON header, an optional binary payload)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_PREFIX.pack(len(head), len(payload)) + head)
    if len(payload):
        sock.sendall(payload)


def recv_frame(sock: socket.socket) -> tuple[Any, bytearray]:
    """Receives one frame: its decoded JSON header (not checked) and its payload.

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the header is too large or not JSON.
    """
    head_len, payload_len = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if head_len > MAX_HEADER:
        raise ProtocolError(f"header of {head_len} bytes is too large")
    try:
        header = json.loads(_recv_exact(sock, head_len))
    except ValueError as e:
        raise ProtocolError(f"header is not JSON: {e}") from None
    payload = _recv_exact(sock, payload_len) if payload_len else bytearray()
    return header, payload


def send(sock: socket.socket, message: wire.Message,
         payload: bytes | bytearray | memoryview = b"") -> None:
    """Sends one message (and an optional binary payload)."""
    send_frame(sock, message.to_wire(), payload)


def recv(sock: socket.socket) -> tuple[wire.Message, bytearray]:
    """Receives one message and its payload.

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the frame or the message is malformed (`wire.decode`).
    """
    header, payload = recv_frame(sock)
    return wire.decode(header), payload


def expect(message: wire.Message, kind: type[M]) -> M:
    """``message`` as a ``kind``; `ProtocolError` if it is another message."""
    if not isinstance(message, kind):
        raise ProtocolError(f"expected a {kind.OP!r} message, got {message.OP!r}",
                            op=message.OP)
    return message


def connect(address: str, timeout_s: float | None = 10.0) -> socket.socket:
    """Opens a TCP connection to ``host:port`` with Nagle off (small control messages)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request(address: str, message: wire.Message, reply: type[M],
            payload: bytes | bytearray | memoryview = b"", *,
            timeout_s: float | None = 10.0) -> tuple[M, bytearray]:
    """One request/response exchange on a fresh connection.

    Raises:
        ProtocolError: the peer answered `wire.ErrorReply` (its message is included) or
            another message than ``reply``.
        OSError, ConnectionError: the peer is unreachable or closed the connection.
    """
    with connect(address, timeout_s) as sock:
        send(sock, message, payload)
        answer, data = recv(sock)
    if isinstance(answer, wire.ErrorReply):
        raise ProtocolError(f"{message.OP} to {address} failed: {answer.message}",
                            op=message.OP)
    return expect(answer, reply), data


def listen(host: str = "127.0.0.1", port: int = 0) -> tuple[socket.socket, str]:
    """A listening socket on a free port chosen by the OS; returns it and ``host:port``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    return sock, f"{host}:{sock.getsockname()[1]}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free now (bind port 0). Racy by nature; used for JAX's service."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def accept_loop(server: socket.socket, handle: Callable[[socket.socket], None], *,
                stop: threading.Event | None = None) -> None:
    """Accepts connections on `server` until it is closed (or `stop` is set), handing each
    to `handle(conn)` on its own daemon thread."""
    while stop is None or not stop.is_set():
        try:
            conn, _ = server.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(conn,), daemon=True).start()
