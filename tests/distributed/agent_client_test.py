"""`distributed.worker.agent_client.fetch_snapshot`: a survivor checks what it fetches."""

from __future__ import annotations

import threading
import zlib

import pytest

from mnemojax._src.checksum import checksum
from mnemojax._src.distributed import transport, wire
from mnemojax._src.distributed.worker.agent_client import fetch_snapshot
from mnemojax._src.errors import StateUnavailableError
from tests.distributed.fakes import SECRET

PAYLOAD = bytes(range(256)) * 4


def _agent_serving(payload: bytes, crc: int) -> tuple[str, threading.Thread]:
    """A one-shot fake agent: answers one `Get` with ``payload`` and ``crc``."""
    server, address = transport.listen()

    def run():
        with server:
            conn, _ = server.accept()
            with conn:
                transport.server_handshake(conn, SECRET)
                request, _ = transport.recv(conn)
                assert isinstance(request, wire.Get)
                transport.send(conn, wire.Snapshot(origin=request.origin, step=request.step,
                                                   crc=crc), payload)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return address, thread


def test_an_intact_copy_is_returned():
    address, thread = _agent_serving(PAYLOAD, checksum(PAYLOAD))
    data, got_from = fetch_snapshot([address], 0, 3, secret=SECRET, timeout_s=10)
    thread.join(timeout=10)
    assert bytes(data) == PAYLOAD and got_from == address


@pytest.mark.parametrize("byte", [0, 511, len(PAYLOAD) - 1])
def test_a_flipped_bit_in_transit_is_refused_and_the_next_agent_used(byte):
    bad = bytearray(PAYLOAD)
    bad[byte] ^= 0x20
    first, t1 = _agent_serving(bytes(bad), checksum(PAYLOAD))
    second, t2 = _agent_serving(PAYLOAD, checksum(PAYLOAD))
    data, got_from = fetch_snapshot([first, second], 0, 3, secret=SECRET, timeout_s=10)
    t1.join(timeout=10)
    t2.join(timeout=10)
    assert bytes(data) == PAYLOAD and got_from == second


def test_a_copy_checked_with_another_algorithm_is_refused():
    address, thread = _agent_serving(PAYLOAD, zlib.crc32(PAYLOAD))
    with pytest.raises(StateUnavailableError, match="CRC32C"):
        fetch_snapshot([address], 0, 3, secret=SECRET, timeout_s=10)
    thread.join(timeout=10)


def test_between_calls_of_the_step_the_worker_says_it_is_alive(monkeypatch):
    """`AgentClient.in_step`: a fast loop of calls says nothing (no message per step). A
    worker between calls for `PING_S` is said to be there, and again every `PING_S` (the
    watchdog takes silence there for a frozen process); entering the next call is said
    once; inside a call nothing more."""
    import time

    from mnemojax._src.distributed.worker import agent_client

    monkeypatch.setattr(agent_client, "PING_S", 0.05)
    server, address = transport.listen()
    heard: list[tuple[float, bool]] = []

    def run():
        with server:
            conn, _ = server.accept()
            with conn:
                transport.server_handshake(conn, SECRET)
                while True:
                    try:
                        message, _ = transport.recv(conn)
                    except (OSError, ConnectionError):
                        return
                    assert isinstance(message, wire.InStep)
                    heard.append((time.monotonic(), message.inside))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    client = agent_client.AgentClient(address, secret=SECRET)
    try:
        for _ in range(200):  # fast steps
            client.in_step(True)
            client.in_step(False)
        client.in_step(True)
        time.sleep(0.3)
        fast_loop_words = len(heard)
        client.in_step(False)
        time.sleep(1.0)  # the user's code: about twenty words
        client.in_step(True)
        inside_from = time.monotonic()
        time.sleep(0.4)  # a step: nothing more
    finally:
        client.close()
    thread.join(timeout=10)
    assert fast_loop_words == 0
    outside = [t for t, inside in heard if not inside]
    assert [inside for _, inside in heard].count(True) == 1
    assert len(outside) >= 4 and max(b - a for a, b in zip(outside, outside[1:], strict=False)) < 0.8
    assert all(t < inside_from for t in outside)
