"""`persistent.store_barrier`, the barrier under `mnemojax.checkpoint_barrier`, against a real
coordination service with two clients in this process (one per simulated process)."""

import concurrent.futures
import socket
import time

import jax
import pytest

from mnemojax._src import persistent
from mnemojax._src.distributed import jax_private
from mnemojax.errors import CheckpointLostError


@pytest.fixture(scope="module")
def clients():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = jax_private.new_service(f"[::]:{port}", 2, heartbeat_s=10, shutdown_timeout_s=5)
    made = [jax_private.new_client(f"127.0.0.1:{port}", i, init_timeout_s=30, heartbeat_s=10,
                                   on_error=lambda *_: None) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda c: c.connect(), made))
    try:
        yield made
    finally:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda c: c.shutdown(), made))
        service.shutdown()


def _barriers(clients, given_up=lambda: None):
    return [persistent.store_barrier(c, i, 2, given_up) for i, c in enumerate(clients)]


def test_every_process_passes_together_and_the_keys_go(clients):
    """Both pass once both came (process 1 comes 0.5 s late); a key used again is a new
    barrier; the last process to see a barrier complete deletes its keys."""
    barriers = _barriers(clients)
    passed: list[float] = []

    def zero():
        for _ in range(2):
            barriers[0](key="commit", timeout_ms=20_000)
            passed.append(time.monotonic())

    def one():
        for _ in range(2):
            time.sleep(0.5)
            barriers[1](key="commit", timeout_ms=20_000)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, second = pool.submit(zero), pool.submit(one)
        first.result(timeout=60)
        second.result(timeout=60)
    assert len(passed) == 2 and passed[1] - passed[0] >= 0.4  # waited for the second arrival
    deadline = time.monotonic() + 10
    while clients[0].key_value_dir_get("mnemojax") and time.monotonic() < deadline:
        time.sleep(0.05)  # (the last one to see it deletes, just after it returns)
    assert clients[0].key_value_dir_get("mnemojax") == []


def test_a_process_that_never_comes_is_named_at_the_timeout(clients):
    [zero, _] = _barriers(clients)
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"DEADLINE_EXCEEDED.*barrier alone: processes \[1\] of 2 did not "
                             r"arrive within 0.6 s"):
        zero(key="alone", timeout_ms=600)


@pytest.mark.timeout(60)
def test_a_death_heard_of_ends_the_wait_with_the_checkpoint_lost(clients):
    """Process 1 never comes; once ``given_up`` names a reason (a peer's death heard of),
    the wait ends with `CheckpointLostError` (the barrier's timeout is 10 min, the test's 60 s), on the
    caller's own thread: nothing is left blocked in jaxlib."""
    t0 = time.monotonic()
    [zero, _] = _barriers(clients, lambda: "a peer died" if time.monotonic() - t0 > 0.3 else None)
    with pytest.raises(CheckpointLostError, match="barrier doomed: a peer died"):
        zero(key="doomed", timeout_ms=600_000)
