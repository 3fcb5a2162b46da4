"""The worker's membership of a JAX world: join, leave, join the next one, barriers.

Every worker is a plain client of the coordination service the launcher hosts
(`launcher.services`); no worker is special, so any one of them may die. The re-init
sequence of DESIGN §4 is `detach_worker` (clients first), the agreement
(`recovery.recover_world`), then `attach_worker`. JAX's private APIs are reached through
`jax_private` only. Nothing happens on import: JAX itself is imported inside the functions.
"""

from __future__ import annotations

import logging
import os
import time

from mnemojax._src.distributed import jax_private
from mnemojax._src.distributed.env import WorldSpec, world_from_env
from mnemojax._src.errors import DistributedError

logger = logging.getLogger("mnemojax")


def configure_process(world: WorldSpec) -> None:
    """Sets what must be set before JAX's backend starts: flags, device count, collectives.

    Raises:
        DistributedError: the backend is already initialised (too late to configure).
    """
    jax_private.check_jax_version()
    import jax
    if jax_private.backends_are_initialized():
        raise DistributedError("configure_process must run before any JAX backend use "
                               "(jax.devices(), a computation, a device_put)")
    t = world.collective_timeout_s
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in (f"--xla_cpu_collective_timeout_seconds={t}",
                 f"--xla_cpu_collective_call_terminate_timeout_seconds={t}"):
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if world.devices_per_proc is not None:
        jax.config.update("jax_num_cpu_devices", world.devices_per_proc)


def _client_error(*status: object) -> None:
    logger.warning("coordination client error: %s", status)


def _connect(world: WorldSpec, init_timeout_s: int) -> None:
    state = jax_private.global_state()
    if state.client is not None:
        raise DistributedError("this process already has a distributed client")
    # With any error callback set, a failed connect (a member of the new world died after
    # the agreement) raises in Python instead of aborting the process (the default callback
    # is a fatal log). jaxlib 0.10 cannot pass the absl status to Python (the call fails
    # with std::bad_cast before reaching the callback), so the callback itself never runs.
    client = jax_private.new_client(world.coordinator, world.process_id,
                                    init_timeout_s=init_timeout_s,
                                    heartbeat_s=world.heartbeat_s, on_error=_client_error)
    client.connect()
    # The fields jax.distributed.initialize would set; no preemption sync manager (it
    # depends on the client and would have to be rebuilt on every re-initialisation).
    state.client = client
    state.process_id = world.process_id
    state.num_processes = world.num_processes
    state.coordinator_address = world.coordinator


def initialize_worker(world: WorldSpec | None = None, *, init_timeout_s: int = 120) -> WorldSpec:
    """Joins the launcher's coordination service as a client (call before any JAX use).

    Barrier: ``connect`` returns once every process of the world has joined (or raises
    after ``init_timeout_s``).

    Args:
        world: the world (default: read from the environment, `world_from_env`).
        init_timeout_s: how long ``connect`` waits for every process to join.

    Returns:
        The world joined.
    """
    world = world_from_env() if world is None else world
    configure_process(world)
    t0 = time.perf_counter()
    _connect(world, init_timeout_s)
    logger.info("joined %s as process %d/%d (generation %d) in %.2f s", world.coordinator,
                world.process_id, world.num_processes, world.generation,
                time.perf_counter() - t0)
    return world


def detach_worker() -> None:
    """Shuts down this process's client and forgets the backends (step 3-4 of DESIGN §4).

    Clients first: the service (in the launcher) is stopped only after every survivor has
    detached (they detach before agreeing), otherwise a peer's shutdown fails and it aborts.
    """
    import jax
    import jax.extend.backend
    state = jax_private.global_state()
    client, state.client = state.client, None
    if client is not None:
        try:
            client.shutdown()
        except Exception as e:  # a dead peer can fail the shutdown barrier; the client is gone
            logger.warning("client shutdown reported %s: %s", type(e).__name__, e)
    jax.extend.backend.clear_backends()
    jax.clear_caches()


def attach_worker(world: WorldSpec, *, init_timeout_s: int = 120) -> None:
    """Joins a new world after `detach_worker` (step 5-6 of DESIGN §4).

    Barrier: ``connect`` waits for every member of ``world``; it raises ``RuntimeError``
    after ``init_timeout_s`` when one never comes (it died after the agreement).
    """
    _connect(world, init_timeout_s)
    jax_private.reset_live_devices()  # stale device map of the old world
    jax_private.forget_orbax_client()


def barrier(name: str, timeout_s: float = 300.0) -> None:
    """Waits at a coordination-service barrier across the current world.

    Used after every compile: a peer still compiling when the others enter a collective
    would otherwise trip the collective timeout (a false alarm, DESIGN §4).
    """
    client = jax_private.global_state().client
    if client is None:
        raise DistributedError("barrier needs an initialised distributed client")
    client.wait_at_barrier(name, int(timeout_s * 1000))


def agree_stop_step(name: str, proposal: int, *, timeout_s: float = 60.0) -> int:
    """The step after which every process of the world stops (a preemption notice).

    The first proposal stored under ``name`` wins (the service's set-if-absent); a later
    caller gets that step back. A process proposes the step after its last complete one:
    no peer can have completed that step yet (its collectives need the proposer), so every
    peer can still stop right after it.

    Blocking: one request to the coordination service; when a peer proposed first, a
    read of its proposal (at most `timeout_s`).

    Raises:
        DistributedError: no distributed client.
        jax.errors.JaxRuntimeError: the service failed the request (other than the key
            existing already), or the read timed out.
    """
    client = jax_private.global_state().client
    if client is None:
        raise DistributedError("agree_stop_step needs an initialised distributed client")
    key = f"mnemojax/stop/{name}"
    try:
        client.key_value_set(key, str(proposal))
        return proposal
    except Exception as e:
        if "ALREADY_EXISTS" not in str(e):
            raise
        logger.info("stop step %s already proposed by a peer", key)
    return int(client.blocking_key_value_get(key, int(timeout_s * 1000)))


def gather_values(prefix: str, value: str, count: int, *, timeout_s: float,
                  stop=None, poll_s: float = 0.02) -> dict[int, str] | None:
    """Every process's ``value`` under ``prefix`` (this one's at its process index), through
    the coordination service's key-value store (no device collective, so nothing compiles).

    Waits until ``count`` values are there; returns None if ``stop()`` returns true first
    (a peer's death already heard of: the caller goes on, and the recovery follows) or
    after ``timeout_s``.

    Raises:
        DistributedError: no distributed client.
    """
    import jax
    client = jax_private.global_state().client
    if client is None:
        raise DistributedError("gather_values needs an initialised distributed client")
    client.key_value_set(f"{prefix}/{jax.process_index()}", value)
    deadline = time.monotonic() + timeout_s
    while True:
        found = {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(prefix)}
        if len(found) >= count:
            return found
        if (stop is not None and stop()) or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)
