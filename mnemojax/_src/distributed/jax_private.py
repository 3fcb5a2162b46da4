"""The one module that touches JAX's (and Orbax's) private distributed-runtime APIs.

JAX's public ``jax.distributed.initialize`` starts the coordination service inside process 0,
so process 0's death takes the service (and with it every peer) down. mnemojax instead hosts
the service in the launcher (`new_service`, used by `launcher.services`) and makes every
worker a plain client (`new_client`, `global_state`, used by `worker.coordination`). That
needs ``jax._src.distributed.global_state`` and
``jax._src.lib._jax.get_distributed_runtime_{service,client}``, used only here, behind
`check_jax_version` and `check_private_api` (a unit test calls the latter, so a JAX upgrade
that changes these shapes fails loudly instead of misbehaving at the first failure). Also
here: the persistent-cache writer of every process (`cache_entries_from_this_process`, with
cache keys made the same in every process and entries written atomically, and
`counting_cache_writes`), a hook on JAX's cache read that can wait for another process's
entry before compiling (`before_compiling_a_miss`, for `coordination.OneCompile`), a hook
on JAX's backend compile that lets another process compile a module (`compiles_elsewhere`,
for `compile_process`) and an export's private VJP field (`export_without_vjp`, for
`compiler.ExportedSteps`).

Nothing happens on import: JAX itself is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import platform
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from mnemojax._src.errors import UnsupportedJaxVersionError

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
    ("jax._src.compiler", "_cache_write",
     ("cache_key", "compile_time_secs", "module_name", "backend", "executable",
      "host_callbacks")),
    ("jax._src.compiler", "_cache_read",
     ("module_name", "cache_key", "compile_options", "backend", "executable_devices")),
    ("jax._src.compilation_cache", "put_executable_and_time",
     ("cache_key", "module_name", "executable", "backend", "compile_time")),
    ("jax._src.cache_key", "_hash_accelerator_config", ("hash_obj", "accelerators")),
    ("jax._src.lru_cache", "LRUCache.put", ("self", "key", "value")),
    ("jax._src.lru_cache", "_CACHE_SUFFIX", ()),
    ("jax._src.lru_cache", "_is_local_filesystem", ("path",)),
    ("jax._src.compiler", "backend_compile_and_load",
     ("backend", "module", "executable_devices", "options", "host_callbacks")),
    ("jax._src.interpreters.mlir", "module_to_bytecode", ("module",)),
)
EXPORTED_VJP_FIELD = "_get_vjp"  # `export_without_vjp`
CLIENT_METHODS = ("connect", "shutdown", "get_live_nodes", "wait_at_barrier")
STATE_FIELDS = ("process_id", "num_processes", "client", "service", "coordinator_address",
                "preemption_sync_manager")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _jax_version() -> str:
    import jax
    return jax.__version__


def check_jax_version(version: str | None = None) -> None:
    """Raises `UnsupportedJaxVersionError` unless JAX is in the range checked by hand."""
    version = _jax_version() if version is None else version
    lo, hi = SUPPORTED_JAX
    if not lo <= _version_tuple(version) < hi:
        raise UnsupportedJaxVersionError(
            f"jax=={version} is unsupported: mnemojax's multi-process layer uses private JAX "
            f"APIs checked on jax {SUPPORTED_TEXT}; re-check mnemojax/_src/distributed/"
            "jax_private.py against the new jax before widening SUPPORTED_JAX",
            version=version, supported=SUPPORTED_TEXT)


def _jaxlib() -> Any:
    """``jax._src.lib._jax``: the jaxlib extension (private; its shape is checked below)."""
    # Private on purpose (this module's whole point): `check_private_api` guards its shape.
    from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]
    return _jax


def check_private_api() -> None:
    """Asserts that every private attribute and parameter used here exists.

    Raises:
        UnsupportedJaxVersionError: an attribute or a parameter is gone.
    """
    missing = []
    for module_name, attr, params in PRIVATE_API:
        obj: Any = importlib.import_module(module_name)
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
    missing += [f"DistributedRuntimeClient.{m}" for m in CLIENT_METHODS
                if not hasattr(_jaxlib().DistributedRuntimeClient, m)]
    missing += [f"global_state.{f}" for f in STATE_FIELDS if not hasattr(global_state(), f)]
    from jax.experimental import multihost_utils
    if not hasattr(multihost_utils.live_devices, "devices"):
        missing.append("multihost_utils.live_devices.devices")
    from jax import export
    if EXPORTED_VJP_FIELD not in {f.name for f in dataclasses.fields(export.Exported)}:
        missing.append(f"jax.export.Exported.{EXPORTED_VJP_FIELD}")
    if missing:
        version = _jax_version()
        raise UnsupportedJaxVersionError(
            f"jax=={version} changed private APIs mnemojax relies on: {missing}",
            version=version, supported=SUPPORTED_TEXT)


def new_service(address: str, num_processes: int, *, heartbeat_s: int,
                shutdown_timeout_s: int) -> Any:
    """A recoverable coordination service (jaxlib object with ``shutdown()``).

    Recoverable means a client that stops heartbeating is marked dead without aborting the
    others (no fate sharing), and ``get_live_nodes`` reports it.
    """
    check_jax_version()
    return _jaxlib().get_distributed_runtime_service(
        address, num_processes, heartbeat_timeout=heartbeat_s,
        shutdown_timeout=shutdown_timeout_s, recoverable=True)


def new_client(coordinator: str, process_id: int, *, init_timeout_s: int, heartbeat_s: int,
               on_error: Callable[..., None]) -> Any:
    """A coordination client, not yet connected (jaxlib object: ``connect``, ``shutdown``,
    ``wait_at_barrier``...)."""
    return _jaxlib().get_distributed_runtime_client(
        coordinator, process_id, init_timeout=init_timeout_s, heartbeat_timeout=heartbeat_s,
        shutdown_timeout=heartbeat_s, missed_heartbeat_callback=on_error,
        use_compression=True)


def global_state() -> Any:
    """``jax._src.distributed.global_state``: what ``jax.distributed.initialize`` sets."""
    from jax._src import distributed
    return distributed.global_state


def backends_are_initialized() -> bool:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())


_cache_writes = threading.local()  # .on: this thread's compiles write their cache entries


def _install_cache_writer() -> None:
    """Wraps JAX's persistent-cache write (once) so that a compile inside
    `cache_entries_from_this_process` writes its entry whatever this process's index."""
    from jax._src import compilation_cache, compiler
    original = compiler._cache_write
    if getattr(original, "mnemojax_wrapped", False):
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                    host_callbacks):
        if not getattr(_cache_writes, "on", False) or host_callbacks:
            return original(cache_key, compile_time_secs, module_name, backend, executable,
                            host_callbacks)
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs))
            _cache_writes.written = getattr(_cache_writes, "written", 0) + 1
        except Exception as e:  # noqa: BLE001 - a cache entry is an optimisation
            logger.warning("mnemojax: could not write the compilation cache entry of %s: "
                           "%s", module_name, e)

    cache_write.mnemojax_wrapped = True  # type: ignore[attr-defined]
    compiler._cache_write = cache_write


def shared_key_platform(devices: Any) -> bool:
    """Whether `cache_entries_from_this_process` makes the cache key of a program over
    ``devices`` the same in every process: CPU devices only."""
    return all(getattr(d, "platform", None) == "cpu" for d in devices)


def _install_shared_keys() -> None:
    """Wraps JAX's cache-key part for the devices (once): inside
    `cache_entries_from_this_process`, a program over CPU devices gets a key that every
    process computes alike.

    On jaxlib 0.10 CPU, the key of one multi-process program differs between processes in
    that part alone (``get_topology_for_devices(...).fingerprint()`` depends on the
    asking process; measured with two processes), though the executable is not
    process-specific: one process's entry, loaded by another, computes the same (JAX's own
    ``jax_share_binary_between_hosts`` hands one process's binary to all; the loader
    deserializes it with its own compile options). Hashing the devices' ids, processes
    and kinds instead (the ids give each process's devices their places) lets any
    process's entry serve every process index: a survivor renumbered onto a lost
    process's index finds the entry some other process wrote.
    """
    from jax._src import cache_key
    original = cache_key._hash_accelerator_config
    if getattr(original, "mnemojax_wrapped", False):
        return

    def hash_accelerator_config(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if not getattr(_cache_writes, "on", False) or not shared_key_platform(devices):
            return original(hash_obj, accelerators)
        described = [(d.id, d.process_index, d.device_kind) for d in devices]
        # The host's CPU stands in for what the fingerprint held of it (XLA:CPU compiles
        # for the host's instruction set): hosts of other CPUs sharing a cache directory
        # never load each other's entries.
        hash_obj.update(f"mnemojax-shared-key:{_host_cpu()}:{described!r}".encode())
        return None

    hash_accelerator_config.mnemojax_wrapped = True  # type: ignore[attr-defined]
    cache_key._hash_accelerator_config = hash_accelerator_config


@functools.cache
def _host_cpu() -> str:
    """This host's CPU model and features (``/proc/cpuinfo``'s first processor; the
    machine and processor names elsewhere): what an XLA:CPU executable is compiled for."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return f"{platform.machine()}:{platform.processor()}"
    fields = {k.strip(): v for k, v in (line.split(":", 1) for line in first.splitlines()
                                        if ":" in line)}
    return ":".join(" ".join(fields.get(k, "").split()) for k in
                    ("vendor_id", "model name", "flags", "Features", "CPU implementer",
                     "CPU part"))


def _install_atomic_put() -> None:
    """Wraps JAX's file-cache write (once) so that an entry appears whole or not at all.

    JAX writes an entry in place (``Path.write_bytes``) when the cache has no size limit.
    With keys shared between processes (`_install_shared_keys`), two processes may write
    the same entry at once, and a reader may read it while it is written; an interleaved
    file would be a corrupt executable. So the entry is written to a file of this process
    and thread, then renamed over the name (either writer's complete entry is valid).
    A cache with a size limit (JAX locks its writes) or off the local file system is
    left to JAX.
    """
    from jax._src import lru_cache
    original = lru_cache.LRUCache.put
    if getattr(original, "mnemojax_wrapped", False):
        return

    def put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled or not lru_cache._is_local_filesystem(str(self.path)):
            return original(self, key, value)
        if not key:
            raise ValueError("key cannot be empty")
        path = os.path.join(str(self.path), f"{key}{lru_cache._CACHE_SUFFIX}")
        if os.path.exists(path):
            return None
        # A name no other writer (another thread, process or host) can have.
        fd, part = tempfile.mkstemp(prefix=f".{key[:80]}.", suffix=".part", dir=str(self.path))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(part, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
        return None

    put.mnemojax_wrapped = True  # type: ignore[attr-defined]
    lru_cache.LRUCache.put = put


@contextlib.contextmanager
def cache_entries_from_this_process() -> Iterator[None]:
    """Compiles in this block (this thread) write their persistent compilation cache entry
    from this process, whatever its index and however fast they compiled, under a key
    every process computes alike for a program over CPU devices.

    JAX writes entries from process 0 only, and only for compiles slower than
    ``jax_persistent_cache_min_compile_time_secs``. And a multi-process cache key holds
    the compiling process's view of the devices (measured on jaxlib 0.10 CPU: one entry
    per process for the same program), so process ``i`` of a later world would find its
    executable only if some process ``i`` wrote it. Here every process writes, the key of
    a program over CPU devices is the same in every process (`_install_shared_keys`), and
    entries are written whole (`_install_atomic_put`): a world formed after a loss loads
    its executables from the cache, whichever process compiled them (`compiler`).
    Without a persistent cache directory nothing is written.
    """
    _install_cache_writer()
    _install_shared_keys()
    _install_atomic_put()
    with _set_in_this_thread(_cache_writes, "on", True):
        yield


@contextlib.contextmanager
def counting_cache_writes() -> Iterator[Callable[[], int]]:
    """Yields a function giving how many persistent-cache entries compiles inside
    `cache_entries_from_this_process` on this thread wrote since the block began."""
    before = getattr(_cache_writes, "written", 0)
    yield lambda: getattr(_cache_writes, "written", 0) - before


@contextlib.contextmanager
def _set_in_this_thread(local: threading.local, name: str, value: Any) -> Iterator[None]:
    was = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, was)


_misses = threading.local()  # `before_compiling_a_miss`


@contextlib.contextmanager
def before_compiling_a_miss(wait: Callable[[], bool]) -> Iterator[None]:
    """In this block (this thread), a persistent-cache miss calls ``wait()`` before JAX
    compiles; if it returns True, the cache is read again first (another process may have
    written the entry meanwhile: `coordination.OneCompile`)."""
    _install_miss_hook()
    with _set_in_this_thread(_misses, "wait", wait):
        yield


def _install_miss_hook() -> None:
    from jax._src import compiler
    original = compiler._cache_read
    if getattr(original, "mnemojax_wrapped", False):
        return

    def cache_read(module_name, cache_key, compile_options, backend, executable_devices):
        found = original(module_name, cache_key, compile_options, backend,
                         executable_devices)
        wait = getattr(_misses, "wait", None)
        if found[0] is None and wait is not None and wait():
            found = original(module_name, cache_key, compile_options, backend,
                             executable_devices)
        return found

    cache_read.mnemojax_wrapped = True  # type: ignore[attr-defined]
    compiler._cache_read = cache_read


_elsewhere = threading.local()  # `compiles_elsewhere`


@contextlib.contextmanager
def compiles_elsewhere(compile: Callable[[Any, bytes, Any, Any], tuple[Any, bytes] | None]
                       ) -> Iterator[Callable[[], bool]]:
    """In this block (this thread), JAX's XLA compile of a module without host callbacks
    on CPU devices calls ``compile(backend, module bytecode, executable devices, compile
    options)`` first, which returns the loaded executable and its serialized form, or None
    (JAX compiles it then). Only the backend compile is replaced: the cache key, the
    persistent-cache read and write, and the executable's wrapping stay JAX's, except that
    the entry written holds the serialized form given, not the executable serialized
    again: on XLA:CPU an executable loaded from its serialized form serializes without
    some of its kernels (measured: 8109 of 14570 bytes; such an entry fails to run,
    "NOT_FOUND: Function ... not found"). Yields a function telling whether a module of
    the block was compiled by ``compile``."""
    _install_compile_hook()
    _elsewhere.loaded = None  # (the newest executable compiled elsewhere, and its bytes)
    with _set_in_this_thread(_elsewhere, "compile", compile):
        try:
            yield lambda: _elsewhere.loaded is not None
        finally:
            _elsewhere.loaded = None


def _install_compile_hook() -> None:
    from jax._src import compilation_cache, compiler
    from jax._src.interpreters import mlir
    original = compiler.backend_compile_and_load
    if getattr(original, "mnemojax_wrapped", False):
        return

    def backend_compile_and_load(backend, module, executable_devices, options,
                                 host_callbacks):
        compile = getattr(_elsewhere, "compile", None)
        if compile is not None and not host_callbacks and backend.platform == "cpu":
            done = compile(backend, mlir.module_to_bytecode(module), executable_devices,
                           options)
            if done is not None:
                _elsewhere.loaded = done
                return done[0]
        return original(backend, module, executable_devices, options, host_callbacks)

    put = compilation_cache.put_executable_and_time

    def put_executable_and_time(cache_key, module_name, executable, backend, compile_time):
        loaded = getattr(_elsewhere, "loaded", None)
        if loaded is not None and executable is loaded[0]:
            executable = _Serialized(loaded[1])  # (JAX only calls its `serialize`)
        return put(cache_key, module_name, executable, backend, compile_time)

    backend_compile_and_load.mnemojax_wrapped = True  # type: ignore[attr-defined]
    compiler.backend_compile_and_load = backend_compile_and_load
    compilation_cache.put_executable_and_time = put_executable_and_time


class _Serialized:
    """An executable's serialized form, where JAX's cache write asks the executable for it."""

    def __init__(self, data: bytes):
        self._data = data

    def serialize(self) -> bytes:
        return self._data


def has_host_callbacks(lowered: Any) -> bool | None:
    """Whether a lowered computation (`jax.stages.Lowered`) calls back to the host: JAX
    writes no persistent-cache entry for such an executable. None where it cannot be told
    (the private field is gone)."""
    try:
        return bool(lowered._lowering.compile_args["host_callbacks"])
    except (AttributeError, KeyError, TypeError):
        return None


def shard_map_axes(closed_jaxpr: Any, scope: str) -> frozenset[str] | None:
    """The mesh axes a ``jax.shard_map`` maps over, in the top-level equations of
    ``closed_jaxpr`` traced in the name scope ``scope`` and in every computation they
    call: of the axes it makes manual (every axis of the mesh unless ``axis_names=``),
    those its in/out specs split along or a collective in its body names (``psum``,
    ``ppermute``, ``axis_index``...). ``jax.lax.axis_size`` leaves no trace (a constant).
    None where it cannot be told (the jaxpr's private layout changed)."""
    try:
        from jax._src import core  # pyright: ignore[reportPrivateImportUsage]

        found: set[str] = set()

        def names(value: Any) -> list[str]:
            values = value if isinstance(value, tuple | list | set | frozenset) else (value,)
            return [v for v in values if isinstance(v, str)]

        def walk(eqns: Any, manual: frozenset[str]) -> None:
            for eqn in eqns:
                inner = manual
                if eqn.primitive.name == "shard_map":
                    mapped = frozenset(str(a) for a in eqn.params["newly_manual_axes"])
                    found.update(a for spec in (*eqn.params["in_specs"],
                                                *eqn.params["out_specs"])
                                 for entry in spec for a in names(entry) if a in mapped)
                    inner = manual | mapped
                elif manual:  # a collective in a shard_map's body
                    found.update(a for key in ("axes", "axis_name")
                                 for a in names(eqn.params.get(key)) if a in manual)
                for sub in core.jaxprs_in_params(eqn.params):
                    walk(getattr(sub, "jaxpr", sub).eqns, inner)  # (a ClosedJaxpr or Jaxpr)

        walk((eqn for eqn in closed_jaxpr.jaxpr.eqns
              if scope in str(eqn.source_info.name_stack)), frozenset())
        return frozenset(found)
    except (AttributeError, KeyError, TypeError, ImportError):
        return None


def export_without_vjp(exported: Any) -> Any:
    """A `jax.export.Exported` without its VJP closure, which holds the traced function
    and its concrete devices (and so their client) alive; such an export can be called,
    not differentiated."""
    return dataclasses.replace(exported, **{EXPORTED_VJP_FIELD: None})


def reset_live_devices() -> None:
    """Forgets ``live_devices``' device map of the old world."""
    from jax.experimental import multihost_utils
    multihost_utils.live_devices.devices = None  # pyright: ignore[reportFunctionMemberAccess]  # set by JAX on the function object


def forget_orbax_client() -> None:
    """Orbax caches the distributed client of the first world it saw (for its commit
    signals); after a re-initialisation its saves would talk to a stopped service."""
    module = sys.modules.get("orbax.checkpoint._src.futures.signaling_client")
    cached = getattr(module, "get_signaling_client", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
    elif module is not None:
        logger.warning("orbax's signaling client cache moved: checkpoints after a world "
                       "re-initialisation may fail")
