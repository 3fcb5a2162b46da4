"""The worker's membership of a JAX world: join, leave, join the next one, barriers.

Every worker is a plain client of the coordination service the launcher hosts
(`launcher.services`); no worker is special, so any one of them may die. The re-init
sequence of DESIGN §4 is `detach_worker` (clients first), the agreement
(`recovery.recover_world`), then `attach_worker`. JAX's private APIs are reached through
`jax_private` only. Nothing happens on import: JAX itself is imported inside the functions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mnemojax._src import checksum as checksums
from mnemojax._src.distributed import jax_private
from mnemojax._src.distributed.env import WorldSpec, world_from_env
from mnemojax._src.distributed.worker import peer_watch, state_transfer
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


def _connected_client(world: WorldSpec, init_timeout_s: int) -> Any:
    """A client of ``world``'s coordination service, connected (``connect`` is a barrier
    over every process of the world; it raises ``RuntimeError`` after ``init_timeout_s``).
    Touches no global state: it may run on a thread that is abandoned."""
    # With any error callback set, a failed connect (a member of the new world died after
    # the agreement) raises in Python instead of aborting the process (the default callback
    # is a fatal log). jaxlib 0.10 cannot pass the absl status to Python (the call fails
    # with std::bad_cast before reaching the callback), so the callback itself never runs.
    client = jax_private.new_client(world.coordinator, world.process_id,
                                    init_timeout_s=init_timeout_s,
                                    heartbeat_s=world.heartbeat_s, on_error=_client_error)
    client.connect()
    return client


def _adopt(world: WorldSpec, client: Any) -> None:
    """Makes ``client`` (connected) this process's distributed client."""
    state = jax_private.global_state()
    # The fields jax.distributed.initialize would set; no preemption sync manager (it
    # depends on the client and would have to be rebuilt on every re-initialisation).
    state.client = client
    state.process_id = world.process_id
    state.num_processes = world.num_processes
    state.coordinator_address = world.coordinator


def _connect(world: WorldSpec, init_timeout_s: int,
             cannot_form: concurrent.futures.Future | None = None) -> None:
    """Connects to ``world`` (given up when ``cannot_form`` completes first:
    `_connect_unless`) and makes that client this process's."""
    if jax_private.global_state().client is not None:
        raise DistributedError("this process already has a distributed client")
    _adopt(world, _connected_client(world, init_timeout_s) if cannot_form is None
           else _connect_unless(world, init_timeout_s, cannot_form))


# How long after its timeout a connect that never completes returns (measured: 6-9 s,
# jaxlib 0.10, whatever the heartbeat timeout).
CONNECT_OVERRUN_S = 15


class ConnectAbandoned(DistributedError):
    """`attach_worker` gave up joining a world that cannot form (a member died, or left
    for a new agreement, before it connected). ``thread`` (None if it never started) is
    still blocked in jaxlib's ``connect``, which cannot be cancelled (nor ended by a
    shutdown of its client or service): it returns some seconds after the connect timeout
    (`CONNECT_OVERRUN_S`), and is joined at exit until then (`peer_watch.leave_behind`)."""

    def __init__(self, message: str, thread: threading.Thread | None):
        super().__init__(message)
        self.thread = thread


def _why(cannot_form: concurrent.futures.Future) -> str:
    try:
        return str(cannot_form.result(timeout=0))
    except BaseException as e:  # noqa: BLE001 - failed or cancelled: say so
        return f"its watch ended with {type(e).__name__}: {e}"


def _connect_unless(world: WorldSpec, init_timeout_s: int,
                    cannot_form: concurrent.futures.Future) -> Any:
    """``_connected_client`` on a thread, given up as soon as ``cannot_form`` completes
    (its result says why) before the connect did (`ConnectAbandoned`), or when this wait
    is interrupted (the thread is abandoned alike, the interruption raised).

    Rarely, the world forms although the word came: the member told of connected before
    dying. The connect that then completes late is shut down on its thread; the others,
    who joined it, are told this process left (`peer_watch`) and agree again too."""
    if cannot_form.done():
        raise ConnectAbandoned(f"world {world.generation} cannot form: {_why(cannot_form)}",
                               None)
    connected: concurrent.futures.Future = concurrent.futures.Future()
    lock, abandoned = threading.Lock(), []

    def run() -> None:
        client, error = None, None
        try:
            client = _connected_client(world, init_timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, or dropped
            error = e
        with lock:
            if not abandoned:
                if error is None:
                    connected.set_result(client)
                else:
                    connected.set_exception(error)
                return
        if client is not None:  # connected after all, too late (see above)
            try:
                client.shutdown()
            except Exception as e:  # noqa: BLE001 - a dead member fails the shutdown
                logger.info("abandoned client of world %d: shutdown reported %s",
                            world.generation, e)

    thread = threading.Thread(target=run, daemon=True,
                              name=f"mnemojax-connect-{world.generation}")
    thread.start()
    try:
        concurrent.futures.wait([connected, cannot_form],
                                return_when=concurrent.futures.FIRST_COMPLETED)
    finally:
        with lock:
            if not connected.done():
                abandoned.append(True)
        if abandoned:  # joined at exit (a thread returning from jaxlib then would abort)
            peer_watch.leave_behind(thread, world.generation,
                                    what=f"a connect to world {world.generation}",
                                    wait_s=init_timeout_s + CONNECT_OVERRUN_S)
    if connected.done():
        return connected.result()
    raise ConnectAbandoned(f"world {world.generation} cannot form: {_why(cannot_form)}",
                           thread)


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
    state_transfer.forget_layouts()


def attach_worker(world: WorldSpec, *, init_timeout_s: int = 120,
                  cannot_form: concurrent.futures.Future | None = None) -> None:
    """Joins a new world after `detach_worker` (step 5-6 of DESIGN §4).

    Barrier: ``connect`` waits for every member of ``world``; it raises ``RuntimeError``
    after ``init_timeout_s`` when one never comes (it died after the agreement).

    Args:
        cannot_form: completes (with the reason) once the world is known not to form (the
            launcher heard of a member's death): the connect is then given up at once
            rather than at its timeout.

    Raises:
        RuntimeError: the connect timed out.
        ConnectAbandoned: ``cannot_form`` completed first.
    """
    import jax.extend.backend
    _connect(world, init_timeout_s, cannot_form)
    # A thread of the user's that asked JAX anything since `detach_worker` (a logger's
    # `jax.process_index()`, Orbax's save thread failing with the old client) made a
    # backend then: without a distributed client, under the old process id. It would
    # stand for the new world's (only this process's devices in it). Forgotten here, the
    # next use makes the new world's, with the client just connected.
    jax.extend.backend.clear_backends()
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
    post_value(prefix, value)
    return posted_values(prefix, count, timeout_s=timeout_s, stop=stop, poll_s=poll_s)


def post_value(prefix: str, value: str) -> None:
    """Stores this process's ``value`` under ``prefix`` (at its process index) for its
    peers' `posted_values`.

    Raises:
        DistributedError: no distributed client.
    """
    import jax
    _store_client().key_value_set(f"{prefix}/{jax.process_index()}", value)


def posted_values(prefix: str, count: int, *, timeout_s: float, stop=None,
                  poll_s: float = 0.02) -> dict[int, str] | None:
    """The values the processes posted under ``prefix`` (`post_value`), by process index,
    once ``count`` are there; None if ``stop()`` returns true first, or after
    ``timeout_s``."""
    client = _store_client()
    deadline = time.monotonic() + timeout_s
    while True:
        found = {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(prefix)}
        if len(found) >= count:
            return found
        if (stop is not None and stop()) or time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def _store_client() -> Any:
    client = jax_private.global_state().client
    if client is None:
        raise DistributedError("the key-value store needs an initialised distributed client")
    return client


# How long a process waits, in all, for a peer's exports of the candidate worlds' step
# (one `SharedExports`) before it traces the step itself; a death heard of ends it sooner.
EXPORT_WAIT_S = 120.0
# Values of the coordination service's store travel as gRPC messages: exports in pieces.
_EXPORT_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A peer's export (``payload``, with its call structures' digest ``structure``), or why
    the peer could not export (``refused``), or neither: the peer shared none (trace the
    step here), or the wait was given up (``given_up``: a death heard of or the compiler
    closing; the world is ending)."""

    payload: bytes | None
    refused: str | None = None
    given_up: bool = False
    structure: str | None = None


class SharedExports:
    """One process exports each candidate world's step; its peers take that export through
    the coordination service's key-value store instead of tracing the step themselves
    (`compiler.StepCompiler.precompile`). Every process of a job traces the same program,
    so one trace serves all; each piece is checked by CRC32C on arrival.

    Args:
        prefix: the keys' prefix, the same in every process for one build of one world.
        stop: returns True once waiting is pointless (a peer's death already heard of).
        timeout_s: the longest all `fetch` calls together wait, from this object's creation
            (one per round of candidates: a publisher that never comes costs it once).
        poll_s: the interval between looks at the store.
    """

    def __init__(self, prefix: str, *, stop: Callable[[], bool] | None = None,
                 timeout_s: float = EXPORT_WAIT_S, poll_s: float = 0.02):
        self._prefix = prefix
        self._stop = stop
        self._deadline = time.monotonic() + timeout_s
        self._poll_s = poll_s

    def publish(self, name: str, payload: bytes | None, *, refused: str | None = None,
                structure: str | None = None) -> None:
        """Gives the peers ``payload`` under ``name`` (the pieces first, the header last, so
        a reader that finds the header finds every piece), or tells them the step could
        not be exported (``refused``), or, with neither, that they trace it themselves.
        Publishing a name again (a second round in one world) overwrites it alike."""
        client = _client()
        key = f"{self._prefix}/{name}"
        pieces = [] if payload is None else [
            payload[i:i + _EXPORT_CHUNK] for i in range(0, len(payload), _EXPORT_CHUNK)]
        for i, piece in enumerate(pieces):
            client.key_value_set_bytes(f"{key}/piece/{i}", piece, allow_overwrite=True)
        client.key_value_set(f"{key}/header", json.dumps({
            "pieces": len(pieces), "size": 0 if payload is None else len(payload),
            "crc32c": checksums.checksum(payload) if payload is not None else None,
            "refused": refused, "structure": structure}), allow_overwrite=True)

    def fetch(self, name: str, *, cancelled: Callable[[], bool] = lambda: False
              ) -> Fetched | None:
        """The peer's export under ``name``, once published. Given up (`Fetched.given_up`)
        if ``cancelled()`` or the ``stop`` given is true first; None once this object's
        deadline has passed, or if what arrived is damaged (logged): the caller then
        traces the step itself."""
        client = _client()
        key = f"{self._prefix}/{name}"
        found = _poll_key(client, f"{key}/header", deadline=self._deadline, poll_s=self._poll_s,
                          stop=lambda: cancelled() or (self._stop is not None and self._stop()))
        if found is _STOPPED:
            return Fetched(None, given_up=True)
        if found is None:
            return None
        header = json.loads(found)
        if header["refused"] is not None or header["crc32c"] is None:
            return Fetched(None, header["refused"])  # nothing to take: trace it here
        payload = b"".join(client.key_value_try_get_bytes(f"{key}/piece/{i}")
                           for i in range(header["pieces"]))
        if len(payload) != header["size"] or checksums.checksum(payload) != header["crc32c"]:
            logger.warning("mnemojax: a peer's export for %s arrived damaged (%d bytes of "
                           "%d, or its CRC32C differs); tracing the step here instead",
                           name, len(payload), header["size"])
            return None
        return Fetched(payload, structure=header["structure"])


class OneCompile:
    """A new world's step compiled once on one host: when no process finds its executable in
    the persistent cache (nothing compiled it ahead), the first process to ask compiles
    it and the others wait for its entry, instead of every process compiling the same
    program at once on the cores they share (`recovery.compile_for_world`, under
    `jax_private.before_compiling_a_miss`).

    `claim` decides who compiles (the first to set the claim, which names its cache
    directory: a process that reads another one compiles itself). The claimer says when it
    is done and whether its entry is in the cache (`done`); a waiter then reads the cache
    again, or compiles itself when there is no entry (a step with host callbacks, whose
    executables JAX does not write). A waiter also stops at ``stop()`` (a death heard of)
    or after ``timeout_s``, and then compiles itself.

    Args:
        prefix: the keys' prefix, the same in every process for one program in one world.
        cache_dir: this process's persistent compilation cache directory.
        stop: returns True once waiting is pointless.
        timeout_s: the longest a waiter waits.
        poll_s: the interval between looks at the store.
    """

    def __init__(self, prefix: str, cache_dir: str, *, stop: Callable[[], bool] | None = None,
                 timeout_s: float = 300.0, poll_s: float = 0.02):
        self._prefix = prefix
        self._dir = cache_dir
        self._stop = stop
        self._timeout_s = timeout_s
        self._poll_s = poll_s

    def claim(self) -> bool:
        """True if this process compiles (it claimed first, or the store failed: then it
        compiles as without sharing); False if another did, into this process's cache."""
        try:
            _client().key_value_set(f"{self._prefix}/claim", self._dir)
            return True
        except Exception as e:  # noqa: BLE001 - ALREADY_EXISTS: another process claimed it
            if "ALREADY_EXISTS" not in str(e):
                logger.info("mnemojax: could not claim the step's compile (%s); compiling "
                            "it here", e)
                return True
        theirs = self._get(f"{self._prefix}/claim")
        if theirs != self._dir:
            logger.info("mnemojax: the process compiling the step writes its compilation "
                        "cache to %s, this process reads %s: compiling it here too",
                        theirs, self._dir)
            return True
        return False

    def done(self, entry: bool) -> None:
        """The claimer, after its compile (or its failure): whether its entry is cached."""
        _client().key_value_set(f"{self._prefix}/done", "entry" if entry else "none",
                                allow_overwrite=True)

    def wait(self) -> bool:
        """A process that did not claim, on a cache miss: True once the claimer's entry is in
        the cache (read it again), False to compile here. Never raises."""
        try:
            return _poll_key(_client(), f"{self._prefix}/done",
                             deadline=time.monotonic() + self._timeout_s, poll_s=self._poll_s,
                             stop=lambda: self._stop is not None and self._stop()) == "entry"
        except Exception as e:  # noqa: BLE001 - no store: compile here
            logger.info("mnemojax: waiting for the step's compile failed (%s); compiling it "
                        "here", e)
            return False

    @staticmethod
    def _get(key: str) -> str | None:
        try:
            return _client().key_value_try_get(key)
        except Exception:  # noqa: BLE001 - gone: compile here
            return None


_STOPPED = object()  # `_poll_key`: its ``stop()`` came true first


def _poll_key(client, key: str, *, stop: Callable[[], bool], deadline: float,
              poll_s: float) -> Any:
    """The value under ``key`` in the coordination service's store once it is set;
    `_STOPPED` if ``stop()`` is true first; None once ``deadline`` (monotonic) has passed.
    Any error other than NOT_FOUND (the service going away with its world) is logged at
    DEBUG and polling goes on, within the same bounds."""
    while True:
        try:
            return client.key_value_try_get(key)
        except Exception as e:  # noqa: BLE001 - NOT_FOUND until a peer sets it
            if "NOT_FOUND" not in str(e):
                logger.debug("mnemojax: looking for %s: %s", key, e)
        if stop():
            return _STOPPED
        if time.monotonic() > deadline:
            return None
        time.sleep(poll_s)


def _client():
    client = jax_private.global_state().client
    if client is None:
        raise DistributedError("the coordination service's store needs an initialised "
                               "distributed client")
    return client
