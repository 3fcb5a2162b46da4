"""Framing for the loopback control and data connections (launcher, agents, workers).

A frame is ``!II`` (header length, payload length), a UTF-8 JSON header (a `wire` message),
then the raw payload bytes. JSON keeps the control plane debuggable; the payload is binary
so snapshots travel without encoding. Every connection is authenticated before its first
message: `connect` and `accept_loop` run the job secret's handshake (`auth`), and a peer
that fails it is closed (and logged) before it can send anything else. No JAX here: the
agent imports this.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from mnemojax._src.distributed import auth, wire
from mnemojax._src.errors import ProtocolError

logger = logging.getLogger("mnemojax")

_PREFIX = struct.Struct("!II")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 2**32 - 1  # a frame's payload length is 32 bits (`_PREFIX`)
HANDSHAKE_MAX_HEADER = 1024  # an unauthenticated peer cannot make the server allocate more
HANDSHAKE_TIMEOUT_S = 10.0

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


Payload = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]
"""A frame's binary payload: one buffer, or parts sent one after the other (no join)."""


def send_frame(sock: socket.socket, header: dict[str, Any], payload: Payload = b"") -> None:
    """Sends one frame (a JSON header, an optional binary payload).

    Raises:
        ProtocolError: the payload is longer than a frame carries (`MAX_PAYLOAD`); nothing
            was sent.
    """
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [memoryview(payload).cast("B")] if isinstance(
        payload, bytes | bytearray | memoryview) else [memoryview(p).cast("B") for p in payload]
    try:
        size = sum(len(p) for p in parts)
        if size > MAX_PAYLOAD or len(head) > MAX_PAYLOAD:
            raise ProtocolError(f"a payload of {size} bytes is larger than one frame "
                                f"carries ({MAX_PAYLOAD} bytes)")
        sock.sendall(_PREFIX.pack(len(head), size) + head)
        for part in parts:
            if len(part):
                sock.sendall(part)
    finally:  # no view of the caller's buffers outlives the call (even in a traceback)
        for part in parts:
            part.release()


def recv_frame(sock: socket.socket, *, max_header: int = MAX_HEADER,
               max_payload: int | None = None,
               on_header: Callable[[Any], None] | None = None) -> tuple[Any, bytearray]:
    """Receives one frame: its decoded JSON header (not checked) and its payload.
    ``on_header`` is called with the header before the payload is read (and allocated).

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the header (or the payload) is too large, or the header is not JSON.
    """
    head_len, payload_len = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if head_len > max_header:
        raise ProtocolError(f"header of {head_len} bytes is too large")
    if max_payload is not None and payload_len > max_payload:
        raise ProtocolError(f"payload of {payload_len} bytes is too large")
    try:
        header = json.loads(_recv_exact(sock, head_len))
    except ValueError as e:
        raise ProtocolError(f"header is not JSON: {e}") from None
    if on_header is not None:
        on_header(header)
    payload = _recv_exact(sock, payload_len) if payload_len else bytearray()
    return header, payload


def send(sock: socket.socket, message: wire.Message, payload: Payload = b"") -> None:
    """Sends one message (and an optional binary payload)."""
    send_frame(sock, message.to_wire(), payload)


def recv(sock: socket.socket, *, before_payload: Callable[[wire.Message], None] | None = None
         ) -> tuple[wire.Message, bytearray]:
    """Receives one message and its payload; ``before_payload`` is called with the
    message before its payload is read (to make room for it).

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: the frame or the message is malformed (`wire.decode`).
    """
    decoded: list[wire.Message] = []

    def on_header(header: Any) -> None:
        decoded.append(wire.decode(header))
        if before_payload is not None:
            before_payload(decoded[0])

    _, payload = recv_frame(sock, on_header=on_header)
    return decoded[0], payload


def expect(message: wire.Message, kind: type[M]) -> M:
    """``message`` as a ``kind``; `ProtocolError` if it is another message."""
    if not isinstance(message, kind):
        raise ProtocolError(f"expected a {kind.OP!r} message, got {message.OP!r}",
                            op=message.OP)
    return message


def _handshake_message(sock: socket.socket, kind: type[M]) -> M:
    header, _ = recv_frame(sock, max_header=HANDSHAKE_MAX_HEADER, max_payload=0)
    return expect(wire.decode(header), kind)


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Proves the job secret to the server and checks the server's proof (`auth`).

    Raises:
        ProtocolError: the server's proof is wrong or it sent something else.
        ConnectionError: the server closed the connection (it refused our proof).
    """
    challenge = _handshake_message(sock, wire.AuthChallenge)
    nonce = auth.new_nonce()
    send(sock, wire.AuthResponse(nonce=nonce, mac=auth.proof(secret, "client",
                                                              challenge.nonce, nonce)))
    accepted = _handshake_message(sock, wire.AuthAccepted)
    if not auth.verify(secret, "server", challenge.nonce, nonce, accepted.mac):
        raise ProtocolError("the server did not prove the job secret", op=accepted.OP)


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Challenges a new client; returns once it proved the job secret (then proves it back).

    Raises:
        ProtocolError: the client's proof is wrong, or it sent something else first.
        ConnectionError, OSError: it closed the connection or was too slow.
    """
    nonce = auth.new_nonce()
    send(sock, wire.AuthChallenge(nonce=nonce))
    response = _handshake_message(sock, wire.AuthResponse)
    if not auth.verify(secret, "client", nonce, response.nonce, response.mac):
        raise ProtocolError("wrong proof of the job secret", op=response.OP)
    send(sock, wire.AuthAccepted(mac=auth.proof(secret, "server", nonce, response.nonce)))


def connect(address: str, timeout_s: float | None = 10.0, *, secret: bytes) -> socket.socket:
    """Opens an authenticated TCP connection to ``host:port`` (`client_handshake`), with
    Nagle off (small control messages).

    Raises:
        OSError, ConnectionError: the peer is unreachable or refused our proof.
        ProtocolError: the peer did not prove the job secret.
    """
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return sock


def request(address: str, message: wire.Message, reply: type[M],
            payload: Payload = b"", *, secret: bytes,
            timeout_s: float | None = 10.0) -> tuple[M, bytearray]:
    """One request/response exchange on a fresh connection.

    Raises:
        ProtocolError: the peer answered `wire.ErrorReply` (its message is included) or
            another message than ``reply``.
        OSError, ConnectionError: the peer is unreachable or closed the connection.
    """
    with connect(address, timeout_s, secret=secret) as sock:
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


def close_server(server: socket.socket) -> None:
    """Closes a listening socket and wakes the `accept_loop` blocked on it: on Linux a
    plain ``close`` from another thread leaves ``accept`` blocked (its thread then outlives
    the server), a ``shutdown`` first makes it return."""
    with contextlib.suppress(OSError):  # never connected: nothing to shut down
        server.shutdown(socket.SHUT_RDWR)
    server.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free now (bind port 0). Racy by nature; used for JAX's service."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _authenticated(conn: socket.socket, peer: str, secret: bytes,
                   handle: Callable[[socket.socket], None],
                   on_refused: Callable[[str, str], None] | None) -> None:
    try:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)  # a silent peer cannot hold the thread
        server_handshake(conn, secret)
        conn.settimeout(None)
    except (OSError, ConnectionError, ProtocolError) as e:
        conn.close()
        reason = f"{type(e).__name__}: {e}"
        if isinstance(e, ConnectionError):  # the peer closed it (a process that died while
            logger.info("a connection from %s ended before it proved the job secret (%s); "
                        "closed", peer, reason)  # connecting): nothing to refuse
            return
        # It answered without the job secret, or stayed silent past the handshake's time.
        logger.warning("refused a connection from %s: %s", peer, reason)
        if on_refused is not None:
            on_refused(peer, reason)
        return
    handle(conn)


def accept_loop(server: socket.socket, handle: Callable[[socket.socket], None], *,
                secret: bytes, stop: threading.Event | None = None,
                on_refused: Callable[[str, str], None] | None = None) -> None:
    """Accepts connections on `server` until it is closed (or `stop` is set). Each one, on
    its own daemon thread, must first pass `server_handshake`; then it goes to
    `handle(conn)`. One that fails is closed, logged, and passed to
    ``on_refused(peer, reason)``."""
    while stop is None or not stop.is_set():
        try:
            conn, addr = server.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = f"{addr[0]}:{addr[1]}"
        threading.Thread(target=_authenticated, args=(conn, peer, secret, handle, on_refused),
                         daemon=True).start()
