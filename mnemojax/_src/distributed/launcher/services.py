"""The JAX coordination services the launcher hosts, one per world generation.

Hosting the service outside the workers is what makes any worker's death survivable
(`jax_private` explains why). A world's service starts before its workers join (world 0 at
launch, world g+1 at the agreement's decision) and stops after every survivor has detached
from it (clients first, service last).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from mnemojax._src.distributed import jax_private, transport

logger = logging.getLogger("mnemojax")


@dataclasses.dataclass
class CoordinationService:
    """A JAX coordination service hosted outside the workers (in the launcher).

    Attributes:
        address: ``host:port`` the workers connect to.
        num_processes: number of clients the service expects.
        handle: the jaxlib service object (None once shut down).
    """

    address: str
    num_processes: int
    handle: Any

    def shutdown(self) -> None:
        """Stops the service. Call after every live client has shut down (clients first)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            handle.shutdown()


def start_service(port: int, num_processes: int, *, heartbeat_s: int = 10,
                  shutdown_timeout_s: int = 30, host: str = "127.0.0.1") -> CoordinationService:
    """Starts a recoverable coordination service in this process, listening on ``host``
    only: loopback on one machine, since JAX's service authenticates no one; a job over
    several nodes gives the node's address, which must be on a private network."""
    handle = jax_private.new_service(f"{host}:{port}", num_processes, heartbeat_s=heartbeat_s,
                                     shutdown_timeout_s=shutdown_timeout_s)
    # (Not at INFO: on several nodes each survivor's node may start one for the next world
    # and all but the deciding node's stop unused; the world's log line names the one used.)
    logger.debug("coordination service on %s:%d for %d processes", host, port, num_processes)
    return CoordinationService(address=f"{host}:{port}", num_processes=num_processes,
                               handle=handle)


class ServiceHost:
    """The services of the worlds that are live: ``generation -> service``. Thread-safe.

    Args:
        heartbeat_s: heartbeat timeout of every service started.
        host: the address they listen on (loopback unless the job spans several nodes).
        exit_wait_s: how long `stop_all` waits for the services being stopped.
    """

    def __init__(self, *, heartbeat_s: int, host: str = "127.0.0.1",
                 exit_wait_s: float = 60.0):
        self.heartbeat_s, self.host, self.exit_wait_s = heartbeat_s, host, exit_wait_s
        self._lock = threading.Lock()
        self._services: dict[int, CoordinationService] = {}
        self._stopping: list[threading.Thread] = []
        self._closed = False  # `stop_all` ran: what stops later stops at once

    def start(self, generation: int, num_processes: int) -> CoordinationService:
        """Starts world ``generation``'s service on a free port; the one it has, for as
        many processes, when a decision is made again (etcd failed the first one's
        transaction: it may have committed it, naming that service)."""
        with self._lock:
            held = self._services.get(generation)
            if held is not None and held.num_processes == num_processes:
                return held
        if held is not None:
            self.stop(generation)
        service = start_service(transport.free_port(self.host), num_processes,
                                heartbeat_s=self.heartbeat_s, host=self.host)
        with self._lock:
            if not self._closed:
                self._services[generation] = service
                return service
        service.shutdown()  # the host closed meanwhile
        return service

    def stop(self, generation: int) -> bool:
        """Starts stopping world ``generation``'s service, on a thread of its own; False if
        it had none (or it was stopped).

        Not blocking: the old world's service stops when the next world is decided, and a
        service stopped while clients are still in its connect barrier (the world never
        formed: a member died after its decision) takes seconds to shut down (measured: 5 s,
        jaxlib 0.10); the decision's reply must not wait for it. After `stop_all`, it
        stops at once, on the caller's thread.
        """
        with self._lock:
            service = self._services.pop(generation, None)
            if service is None:
                return False
            if not self._closed:
                thread = threading.Thread(target=service.shutdown, daemon=True,
                                          name=f"mnemojax-stop-service-{generation}")
                self._stopping = [t for t in self._stopping if t.is_alive()] + [thread]
                thread.start()
                return True
        service.shutdown()
        return True

    def stop_all(self) -> None:
        """Stops every service, and waits (at most ``exit_wait_s``) for those being stopped:
        a thread that returns from jaxlib into a finalising interpreter aborts the
        process."""
        with self._lock:
            self._closed = True
            services, self._services = list(self._services.values()), {}
            stopping = list(self._stopping)
        for service in services:
            service.shutdown()
        deadline = time.monotonic() + self.exit_wait_s
        for thread in stopping:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("a coordination service still stopping after %.0f s (%s)",
                               self.exit_wait_s, thread.name)
