"""`distributed.worker.coordination`: joining a world that may never form."""

from __future__ import annotations

import concurrent.futures
import socket
import threading

import pytest

from mnemojax._src.distributed import jax_private
from mnemojax._src.distributed.env import WorldSpec
from mnemojax._src.distributed.worker import coordination, peer_watch


def _world(port: int) -> WorldSpec:
    return WorldSpec(coordinator=f"127.0.0.1:{port}", process_id=0, num_processes=2,
                     generation=3)


def test_a_connect_is_given_up_once_a_member_is_known_dead():
    """jaxlib's connect to a world of two whose other member never comes (it died after
    the decision): once the launcher's word arrives, `attach_worker` gives the connect up
    at once (`ConnectAbandoned`), adopting no client; its thread, still in jaxlib (it
    cannot be cancelled), is joined at exit until some seconds past the connect timeout.
    Without that word it would wait the whole timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = jax_private.new_service(f"127.0.0.1:{port}", 2, heartbeat_s=10,
                                      shutdown_timeout_s=1)
    heard: concurrent.futures.Future = concurrent.futures.Future()
    timer = threading.Timer(0.3, lambda: heard.set_result("workers [1] died"))
    timer.start()
    try:
        with pytest.raises(coordination.ConnectAbandoned, match=r"world 3 cannot form: "
                                                                r"workers \[1\] died") as e:
            coordination.attach_worker(_world(port), init_timeout_s=2, cannot_form=heard)
        thread = e.value.thread
        assert thread is not None and thread.is_alive()  # given up, not waited out
        assert jax_private.global_state().client is None
        [(left, what, until)] = [t for t in peer_watch._pending.left_behind if t[0] is thread]
        assert what == "a connect to world 3" and peer_watch._pending.exit_join
    finally:
        timer.cancel()
        service.shutdown()


def test_a_world_known_not_to_form_is_not_connected_to():
    """The word came before the connect started (or its watch failed): nothing is started,
    and the reason says what was known."""
    known: concurrent.futures.Future = concurrent.futures.Future()
    known.set_result("workers [2] left it for a new agreement")
    with pytest.raises(coordination.ConnectAbandoned,
                       match=r"workers \[2\] left it for a new agreement") as e:
        coordination.attach_worker(_world(1), init_timeout_s=2, cannot_form=known)
    assert e.value.thread is None
    broken: concurrent.futures.Future = concurrent.futures.Future()
    broken.set_exception(OSError("launcher gone"))
    with pytest.raises(coordination.ConnectAbandoned,
                       match="its watch ended with OSError: launcher gone"):
        coordination.attach_worker(_world(1), init_timeout_s=2, cannot_form=broken)
