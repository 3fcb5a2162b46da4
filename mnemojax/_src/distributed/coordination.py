"""The one module that touches JAX's private distributed-runtime APIs.

JAX's public ``jax.distributed.initialize`` starts the coordination service inside process 0,
so process 0's death takes the service (and with it every peer) down. mnemojax instead hosts
the service in the launcher (`start_service`) and makes every worker a plain client
(`initialize_worker`). That needs ``jax._src.distributed.global_state`` and
``jax._src.lib._jax.get_distributed_runtime_{service,client}``, used only here, behind
`check_jax_version` and `check_private_api` (a unit test calls the latter, so a JAX upgrade
that changes these shapes fails loudly instead of misbehaving at the first failure).

Nothing happens on import: JAX itself is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from typing import Any

from mnemojax._src.distributed.env import WorldSpec, world_from_env
from mnemojax._src.distributed.errors import DistributedError, UnsupportedJaxVersionError

logger = logging.getLogger("mnemojax")

SUPPORTED_JAX = ((0, 10, 0), (0, 11, 0))  # [lower, upper): checked by hand on 0.10.2
SUPPORTED_TEXT = ">=0.10.0,<0.11.0"

# What this module relies on: (module path, attribute, parameters the callable must accept).
PRIVATE_API = (
    ("jax._src.lib", "_jax.get_distributed_runtime_service",
     ("address", "num_nodes", "heartbeat_timeout", "shutdown_timeout", "recoverable")),
    ("jax._src.lib", "_jax.get_distributed_runtime_client",
     ("address", "node_id", "init_timeout", "shutdown_timeout", "heartbeat_timeout",
      "use_compression")),
    ("jax._src.distributed", "global_state", ()),
    ("jax._src.xla_bridge", "backends_are_initialized", ()),
)
CLIENT_METHODS = ("connect", "shutdown", "get_live_nodes", "wait_at_barrier")
STATE_FIELDS = ("process_id", "num_processes", "client", "service", "coordinator_address",
                "preemption_sync_manager")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_jax_version(version: str | None = None) -> None:
    """Raises `UnsupportedJaxVersionError` unless JAX is in the range checked by hand."""
    if version is None:
        import jax
        version = jax.__version__
    lo, hi = SUPPORTED_JAX
    if not lo <= _version_tuple(version) < hi:
        raise UnsupportedJaxVersionError(
            f"jax=={version} is unsupported: mnemojax's multi-process layer uses private JAX "
            f"APIs checked on jax {SUPPORTED_TEXT}; re-check mnemojax/_src/distributed/"
            "coordination.py against the new jax before widening SUPPORTED_JAX",
            version=version, supported=SUPPORTED_TEXT)


def check_private_api() -> None:
    """Asserts that every private attribute and parameter used here exists.

    Raises:
        UnsupportedJaxVersionError: an attribute or a parameter is gone.
    """
    import importlib

    import jax
    missing = []
    for module_name, attr, params in PRIVATE_API:
        obj = importlib.import_module(module_name)
        for name in attr.split("."):
            obj = getattr(obj, name, None)
        if obj is None:
            missing.append(f"{module_name}.{attr}")
            continue
        if params:
            doc = obj.__doc__ or ""  # pybind11 functions carry their signature in __doc__
            try:
                names = set(inspect.signature(obj).parameters)
            except (TypeError, ValueError):
                names = {p for p in params if f"{p}:" in doc}
            missing += [f"{module_name}.{attr}({p}=)" for p in params if p not in names]
    from jax._src.distributed import global_state
    from jax._src.lib import _jax
    missing += [f"DistributedRuntimeClient.{m}" for m in CLIENT_METHODS
                if not hasattr(_jax.DistributedRuntimeClient, m)]
    missing += [f"global_state.{f}" for f in STATE_FIELDS if not hasattr(global_state, f)]
    from jax.experimental import multihost_utils
    if not hasattr(multihost_utils.live_devices, "devices"):
        missing.append("multihost_utils.live_devices.devices")
    if missing:
        raise UnsupportedJaxVersionError(
            f"jax=={jax.__version__} changed private APIs mnemojax relies on: {missing}",
            version=jax.__version__, supported=SUPPORTED_TEXT)


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
    """Starts a recoverable coordination service in this process.

    Recoverable means a client that stops heartbeating is marked dead without aborting the
    others (no fate sharing), and ``get_live_nodes`` reports it.
    """
    check_jax_version()
    from jax._src.lib import _jax
    handle = _jax.get_distributed_runtime_service(
        f"[::]:{port}", num_processes, heartbeat_timeout=heartbeat_s,
        shutdown_timeout=shutdown_timeout_s, recoverable=True)
    logger.info("coordination service on %s:%d for %d processes", host, port, num_processes)
    return CoordinationService(address=f"{host}:{port}", num_processes=num_processes,
                               handle=handle)


def configure_process(world: WorldSpec) -> None:
    """Sets what must be set before JAX's backend starts: flags, device count, collectives.

    Raises:
        DistributedError: the backend is already initialised (too late to configure).
    """
    check_jax_version()
    import jax
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():
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


def _client_error(*status) -> None:
    logger.warning("coordination client error: %s", status)


def _connect(world: WorldSpec, init_timeout_s: int) -> None:
    from jax._src import distributed
    from jax._src.lib import _jax
    state = distributed.global_state
    if state.client is not None:
        raise DistributedError("this process already has a distributed client")
    # With any error callback set, a failed connect (a member of the new world died after
    # the agreement) raises in Python instead of aborting the process (the default callback
    # is a fatal log). jaxlib 0.10 cannot pass the absl status to Python (the call fails
    # with std::bad_cast before reaching the callback), so the callback itself never runs.
    client = _jax.get_distributed_runtime_client(
        world.coordinator, world.process_id, init_timeout=init_timeout_s,
        heartbeat_timeout=world.heartbeat_s, shutdown_timeout=world.heartbeat_s,
        missed_heartbeat_callback=_client_error, use_compression=True)
    client.connect()
    # The fields jax.distributed.initialize would set; no preemption sync manager (it
    # depends on the client and would have to be rebuilt on every re-initialisation).
    state.client = client
    state.process_id = world.process_id
    state.num_processes = world.num_processes
    state.coordinator_address = world.coordinator


def initialize_worker(world: WorldSpec | None = None, *, init_timeout_s: int = 120) -> WorldSpec:
    """Joins the launcher's coordination service as a client (call before any JAX use).

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
    from jax._src import distributed
    state = distributed.global_state
    client, state.client = state.client, None
    if client is not None:
        try:
            client.shutdown()
        except Exception as e:  # a dead peer can fail the shutdown barrier; the client is gone
            logger.warning("client shutdown reported %s: %s", type(e).__name__, e)
    jax.extend.backend.clear_backends()
    jax.clear_caches()


def attach_worker(world: WorldSpec, *, init_timeout_s: int = 120) -> None:
    """Joins a new world after `detach_worker` (step 5-6 of DESIGN §4)."""
    from jax.experimental import multihost_utils
    _connect(world, init_timeout_s)
    multihost_utils.live_devices.devices = None  # stale device map of the old world
    _forget_orbax_client()


def _forget_orbax_client() -> None:
    """Orbax caches the distributed client of the first world it saw (for its commit
    signals); after a re-initialisation its saves would talk to a stopped service."""
    import sys
    module = sys.modules.get("orbax.checkpoint._src.futures.signaling_client")
    cached = getattr(module, "get_signaling_client", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
    elif module is not None:
        logger.warning("orbax's signaling client cache moved: checkpoints after a world "
                       "re-initialisation may fail")


def barrier(name: str, timeout_s: float = 300.0) -> None:
    """Waits at a coordination-service barrier across the current world.

    Used after every compile: a peer still compiling when the others enter a collective
    would otherwise trip the collective timeout (a false alarm, DESIGN §4).
    """
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise DistributedError("barrier needs an initialised distributed client")
    client.wait_at_barrier(name, int(timeout_s * 1000))
