"""`launcher.services`: the coordination services the launcher hosts."""

from __future__ import annotations

import threading

from mnemojax._src.distributed.launcher.services import CoordinationService, ServiceHost


class _SlowHandle:
    """A jaxlib service whose shutdown blocks until released (one with clients still in
    its connect barrier took 5 s, jaxlib 0.10)."""

    def __init__(self):
        self.release, self.stopped = threading.Event(), threading.Event()

    def shutdown(self):
        self.release.wait(30)
        self.stopped.set()


def test_stopping_an_old_world_service_does_not_block_the_decision():
    """The launcher stops world g's service inside the decision of world g+1: it stops on
    a thread, and `stop_all` (the launcher's exit) waits for it; a stop after `stop_all`
    (a node's mirror thread, late) shuts down at once."""
    host = ServiceHost(heartbeat_s=10)
    slow, late = _SlowHandle(), _SlowHandle()
    host._services[1] = CoordinationService("127.0.0.1:1", 2, slow)
    host._services[2] = CoordinationService("127.0.0.1:2", 2, late)
    assert host.stop(1) and not host.stop(1)
    assert not slow.stopped.is_set()  # returned while the shutdown blocks
    [stopping] = host._stopping
    slow.release.set()
    late.release.set()
    host.stop_all()
    assert slow.stopped.is_set() and late.stopped.is_set() and not stopping.is_alive()
    other = _SlowHandle()
    other.release.set()
    host._services[3] = CoordinationService("127.0.0.1:3", 2, other)  # as a late start
    assert host.stop(3) and other.stopped.is_set() and host._stopping == [stopping]


def test_a_decision_made_again_takes_the_service_it_started_for_that_world():
    """A decision whose etcd transaction failed may have committed it, naming the service
    it started: made again (`EtcdArbiter._through_outage`), it takes that service rather
    than starting a second and leaving the first running (review 28); for another number
    of processes the first is stopped."""
    host = ServiceHost(heartbeat_s=10)
    try:
        first = host.start(1, 2)
        assert host.start(1, 2) is first
        other = host.start(1, 3)
        for stopping in host._stopping:
            stopping.join(30)
        assert other is not first and first.handle is None and host._services[1] is other
    finally:
        host.stop_all()
