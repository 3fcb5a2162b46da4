"""Executables per mesh: compiled on demand, or ahead of time in the background.

Compile dominates recovery on CPU (7-10 s for the tiny GPT, DESIGN.md section 4), so after
the first step the runtime compiles the step for every mesh that one more failure would
produce, on a background thread, and a recovery takes the ready executable. JAX's persistent
compilation cache backs the rest. On CPU the cache key includes the device assignment, so
each reduced mesh needs its own entry; on GPU JAX strips it and one entry serves all
meshes of a shape.

Across processes a new world has a new client, so what was compiled ahead in the old world
reaches it only through the persistent cache, and the new world still traces and lowers the
step again (JAX caches traces per function, and its caches are cleared with the old
client). `ExportedSteps` takes that trace off the recovery: each step compiled ahead is
`jax.export`-ed first and compiled through ``jax.jit(exported.call)``; the new world lowers
the same wrapper on its own mesh, which is ×7 cheaper than a trace (``python -m
mnemojax._src.bench.micro 5``) and lowers to the same module, so the cache entry written
ahead is found. A step that cannot be exported (a host callback, say), or an export that
fails to lower or compile, is traced as before. The export is the old world's trace: a
step seen reading its world's size or its process index while tracing (its first export
is watched) is traced in every world instead, and ``CompileOptions(export_ahead=False)``
turns exports off for a step whose dependence the watch cannot see.

Every process traces the same program, so one trace serves them all (`ExportSharing`):
process 0 exports each candidate world's step and publishes it through the coordination
service's store with flat structures; the others compare the structures' leaf paths, put
their own back and keep it, then compile from it or (`CompileOptions.ahead_compilers`)
load the entry a compiling process wrote under the key every process shares.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mnemojax._src import compile_process
from mnemojax._src import sharding as shd
from mnemojax._src.distributed import jax_private
from mnemojax._src.errors import MnemojaxError, UnsupportedStateError
from mnemojax._src.step_forms import batch_splits, example_axes
from mnemojax._src.topology import MeshPlan

log = logging.getLogger("mnemojax")

_cache_lock = threading.Lock()
_CACHE_FLAG = "jax_compilation_cache_dir"
_CACHE_ON_FLAG = "jax_enable_compilation_cache"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()  # .count: persistent-cache hits of this thread's compiles
_listening = False


def _count_cache_hit(event: str, **kwargs: Any) -> None:
    del kwargs
    if event == _CACHE_HIT:
        _hits.count = getattr(_hits, "count", 0) + 1


def _listen_for_cache_hits() -> None:
    """Counts JAX's persistent-cache hits per thread (once per process)."""
    global _listening
    with _cache_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_count_cache_hit)
            _listening = True


def enable_persistent_cache(cache_dir: str | os.PathLike[str] | None) -> bool:
    """Points JAX's persistent compilation cache at `cache_dir`, a process-wide setting,
    and says so once (a warning naming the path). The user's own setting wins: a cache
    directory already set (``JAX_COMPILATION_CACHE_DIR``, ``jax.config``) or the cache
    switched off (``jax_enable_compilation_cache=False``) is left alone.

    Returns:
        Whether this call turned the cache on.
    """
    if cache_dir is None:
        return False
    with _cache_lock:
        # Flags JAX's stubs do not declare.
        if getattr(jax.config, _CACHE_FLAG) is not None \
                or not getattr(jax.config, _CACHE_ON_FLAG):
            return False
        path = os.fspath(cache_dir)
        jax.config.update(_CACHE_FLAG, path)
    log.warning("mnemojax: JAX's persistent compilation cache is on, in %s, for this "
                "process (pass CompileOptions(cache_dir=None) to leave JAX's setting alone)",
                path)
    return True


@dataclasses.dataclass
class Executable:
    compiled: Any
    mesh: Mesh
    state_shardings: list[NamedSharding]
    batch_shardings: Any
    lower_s: float
    compile_s: float
    ahead_of_time: bool
    from_cache: bool = False  # loaded from the persistent compilation cache
    exported: bool = False  # lowered from a `jax.export` of the step (no trace)
    warm: bool = False  # executed once already (`StepCompiler.warm_one`)
    # Per pack the step also writes (`pack_groups`), the state leaves it holds; () when
    # it writes none. Its fourth output is the packs, in this order.
    pack_members: tuple[tuple[int, ...], ...] = ()
    # The shared state leaves (`StepCompiler.shared_leaves`) this executable returns as
    # given (traced here; () when lowered from an export): their snapshot copy is kept.
    kept: frozenset[int] = frozenset()


def leaf_nbytes(leaf_structs) -> list[int]:
    """Each state leaf's global bytes, from its (shape, dtype)."""
    return [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in leaf_structs]


def _axes_of(spec: PartitionSpec) -> set[str]:
    return {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}


def pack_groups(specs: Sequence[PartitionSpec], leaf_structs, mesh: Mesh
                ) -> list[tuple[tuple[str, ...], tuple[int, ...]]] | None:
    """The state leaves packed together (`snapshot.Packed`): per pack, the mesh axes its
    members are sharded over (in the mesh's order) and the members, grouped by those axes
    and dtype. None where some leaf's shards differ in size (a dimension its axes do not
    divide): such a leaf has no one place in a pack of equal-sized device shards."""
    groups: dict[tuple, list[int]] = {}
    for i, (spec, (shape, dtype)) in enumerate(zip(specs, leaf_structs, strict=True)):
        for dim, entry in zip(shape, tuple(spec), strict=False):
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            if dim % int(np.prod([mesh.shape[a] for a in names], dtype=int)):
                return None
        used = _axes_of(spec)
        axes = tuple(a for a in mesh.axis_names if a in used)
        groups.setdefault((axes, np.dtype(dtype)), []).append(i)
    return [(axes, tuple(members)) for (axes, _), members in groups.items()]


def packer(mesh: Mesh, specs: Sequence[PartitionSpec], axes: tuple[str, ...]):
    """A function of one pack's members (laid out by `specs`, sharded over `axes`) to
    the pack: on each device its shards of them, flattened, side by side (a local copy:
    no data moves between devices)."""

    def local(*xs):
        flat = jnp.concatenate([jnp.reshape(x, (-1,)) for x in xs])
        return jnp.reshape(flat, (1,) * len(axes) + (-1,))

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                         out_specs=PartitionSpec(*axes, None), check_vma=False)


def single_copy_state(specs: Sequence[PartitionSpec], mesh: Mesh) -> bool:
    """Whether some state leaf laid out by `specs` on `mesh` has shards held by one device
    only (every axis of the mesh wider than 1 splits it); `snapshot.has_single_copy_shards`
    of the placed arrays in one process."""
    wide = {a for a, n in mesh.shape.items() if n > 1}
    return any(wide <= _axes_of(spec) for spec in specs)


@dataclasses.dataclass
class StepFacts:
    """What the compiles of one step learned about it, kept across worlds (a
    `RuntimeBuilder` gives every compiler it builds the same one)."""

    # Calls back to the host (`jax.debug.print`, a callback): JAX writes no persistent-
    # cache entry for its executables. None until a compile tells.
    host_callbacks: bool | None = None
    # The mesh axes a ``jax.shard_map`` in the step maps over (`USER_SCOPE`), from its
    # first trace (every process traces its first compile): no recovery narrows those
    # that are not batch axes (`RecoveryOptions.shrink_shard_map_axes`). None until a
    # trace tells.
    shard_map_axes: frozenset[str] | None = None
    # Mesh shapes the step could not be compiled for at a recovery in one process (its
    # trace or compile failed there: a shape computed from an axis's width): later plans
    # take another (`DeviceRecovery.recover`).
    refused_shapes: set[tuple[int, ...]] = dataclasses.field(default_factory=set)
    # The state leaves the step returns as given (the very value it was passed: a frozen
    # base the optimizer does not update), from its first trace. None until a trace tells.
    forwarded: frozenset[int] | None = None


# The name scope the user's step is traced in, inside mnemojax's own wrapper (whose
# shard_maps, the finiteness check and the packs, are not the step's).
USER_SCOPE = "mnemojax_step"


class ExportedSteps:
    """The step exported per plan and batch (`StepCompiler.key`), kept across worlds.

    A `RuntimeBuilder` holds one for every runtime it builds: the background compiles of the
    old world fill it, the new world's compile reads it. An `Exported` kept here holds the
    module and its shardings (over an abstract mesh), no device or client (its VJP closure
    is dropped), so it does not keep the old world's backend alive. The newest
    ``max_entries`` are kept (the candidate worlds of the last precompiles; a mesh compiled
    on demand is not exported).

    The export is the old world's trace: a step that reads the world while tracing
    (``jax.process_count()``, ``jax.device_count()``, ``jax.process_index()``,
    ``jax.devices()``) would run with the old world's values. The step's first export is
    traced under a watch for such reads from code outside JAX, Flax and optax; one seen
    refuses exports for the run (the step is traced in every world). Reads the watch
    cannot see (a value computed before the step was built, another thread) need
    ``CompileOptions(export_ahead=False)``.

    Attributes:
        refused: why the step could not be exported, once it could not. Then nothing more
            is tried for the rest of the run, whatever the mesh: every compile traces the
            step.
    """

    def __init__(self, max_entries: int = 16):  # the builder: 2 x max_precompiled
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries!r}")
        self._max = max_entries
        self._by_key: dict[tuple, jax_export.Exported] = {}
        self._lock = threading.Lock()
        self.refused: str | None = None
        self.taken = 0  # exports taken from the exporting process (`ExportSharing`)
        # The step's first trace was watched (`_world_reads_while`): process 0's first
        # compile, or else the first export.
        self.watched = False

    def get(self, key: tuple) -> jax_export.Exported | None:
        with self._lock:
            return self._by_key.get(key)

    def put(self, key: tuple, exported: jax_export.Exported) -> None:
        # Its VJP closure holds the traced step and its concrete devices, which would keep
        # the old world's client alive; the new world only calls the export.
        exported = jax_private.export_without_vjp(exported)
        with self._lock:
            self._by_key.pop(key, None)
            self._by_key[key] = exported
            while len(self._by_key) > self._max:
                del self._by_key[next(iter(self._by_key))]

    def refuse(self, why: str) -> None:
        with self._lock:
            first = self.refused is None
            self.refused = why
        if first:
            log.warning("mnemojax: the step cannot be exported (%s); a new world after a "
                        "process loss traces it again on the recovery path (and compiles it "
                        "there too if it calls back to the host: JAX caches no executable "
                        "of such a step)", why)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)


# What a step may read of its world while tracing; under an export the new world would
# get the old world's value (`ExportedSteps`).
_WORLD_READS = ("process_count", "process_index", "device_count", "devices")
# Code of these packages reads the world for its own checks; only the step's own reads
# (code outside them) count.
_LIBRARIES = tuple(os.sep + name + os.sep for name in ("jax", "jaxlib", "flax", "optax"))


def _world_reads_while(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Runs ``fn()`` on this thread and returns its result and the world reads (the
    functions of `_WORLD_READS`) that code outside JAX, Flax and optax made meanwhile, as
    ``"jax.process_count() at file:line"``. A profile hook of this thread only; it slows
    the call down, so `StepCompiler` watches the step's first export only. A cached read
    (``process_count`` is an ``lru_cache``) runs no Python code, so that cache is cleared
    first; another thread may refill it meanwhile, and that read goes unseen."""
    watched: dict[Any, str] = {}
    for name in _WORLD_READS:
        f = getattr(jax, name)  # the functions themselves (JAX re-exports, not wrappers)
        if hasattr(f, "cache_clear"):  # an lru_cache: a hit runs no Python code to see
            f.cache_clear()
        watched[getattr(f, "__wrapped__", f).__code__] = f"jax.{name}()"
    reads: list[str] = []

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        what, caller = watched.get(frame.f_code), frame.f_back
        if what is not None and caller is not None:
            path = caller.f_code.co_filename
            if not any(lib in path for lib in _LIBRARIES):
                reads.append(f"{what} at {path}:{caller.f_lineno}")

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        return fn(), reads
    finally:
        sys.setprofile(before)


class ExportExchange(Protocol):
    """Where one process's export of a candidate world's step reaches its peers
    (`coordination.SharedExports`)."""

    def publish(self, name: str, payload: bytes | None, *, refused: str | None = None,
                structure: str | None = None) -> None: ...

    def fetch(self, name: str, *, cancelled: Callable[[], bool] = ...) -> Any: ...


@dataclasses.dataclass(frozen=True)
class ExportSharing:
    """`StepCompiler.precompile` under several processes: this process either exports each
    candidate's step and publishes it (``publish``), or takes the publisher's export from
    ``exchange`` instead of tracing the step (every process traces the same program)."""

    exchange: ExportExchange
    publish: bool


def export_name(key: tuple) -> str:
    """The name a candidate's export travels under, the same in every process: the plan's
    device ids and the batch's shapes and dtypes (`StepCompiler.key` without the tree
    structure, whose text may hold per-process addresses; the structures are compared by
    their leaf paths instead, `structure_digest`)."""
    return hashlib.sha256(repr(key[:2]).encode()).hexdigest()[:32]


def structure_digest(in_tree, out_tree) -> str | None:
    """A digest of a step's argument and result structures by their leaves' paths (no
    per-process text), the same in every process for the same structures; None where
    a structure cannot be rebuilt from placeholder leaves."""
    try:
        paths = [[jax.tree_util.keystr(path) for path, _ in
                  jax.tree_util.tree_flatten_with_path(t.unflatten(range(t.num_leaves)))[0]]
                 for t in (in_tree, out_tree)]
    except Exception:  # noqa: BLE001 - a node that checks its leaves: nothing to compare
        return None
    return hashlib.sha256(json.dumps(paths).encode()).hexdigest()


def ahead_compiler_ranks(num_processes: int, compilers: int) -> set[int]:
    """The ranks that compile each candidate world ahead when ``compilers`` of
    ``num_processes`` do (`CompileOptions.ahead_compilers`): spread over the ranks (0,
    n/k, ...), so a host that loses several neighbouring ranks keeps one elsewhere."""
    if compilers >= num_processes:
        return set(range(num_processes))
    return {round(i * num_processes / compilers) for i in range(compilers)}


def shares_cache_entries(*, one_host: bool) -> bool:
    """Whether every process of this world loads what any of them compiled: several
    processes on one host (one cache directory), CPU devices (the key every process
    shares, `jax_private.cache_entries_from_this_process`) and a persistent cache on."""
    return jax.process_count() > 1 and one_host and _keys_shared()


def _keys_shared() -> bool:
    """A persistent cache is on, under keys every process computes alike (CPU devices,
    `jax_private.shared_key_platform`): any process's entry serves every process."""
    return (jax_private.shared_key_platform(jax.devices())
            and bool(getattr(jax.config, _CACHE_ON_FLAG)) and bool(getattr(jax.config, _CACHE_FLAG)))


def cache_dir() -> str:
    """JAX's persistent compilation cache directory, as a real path ("" without one)."""
    path = getattr(jax.config, _CACHE_FLAG)
    return os.path.realpath(path) if path else ""


def compiles_ahead_here(ahead_compilers: int | None, *, one_host: bool) -> bool:
    """Whether this process compiles the candidate worlds' step ahead, or only keeps its
    export and loads what another process compiled (`CompileOptions.ahead_compilers`;
    None: 1 on one host, else every process). Every process compiles unless the cache
    keys are shared (CPU devices, `jax_private.shared_key_platform`) and a persistent
    compilation cache is on."""
    n = jax.process_count()
    compilers = ahead_compilers if ahead_compilers is not None else (1 if one_host else n)
    if compilers >= n or not _keys_shared():
        return True  # (no cache or per-process keys: nothing to load another's compile from)
    return jax.process_index() in ahead_compiler_ranks(n, compilers)


def _distributed() -> bool:
    """Under `jax.distributed` (a world of one after losses too, which loads what a bigger
    world compiled ahead for it)."""
    return jax.process_count() > 1 or jax_private.global_state().client is not None


def _compile_lowered(lowered, distributed: bool) -> Any:
    # ``distributed`` (`_distributed`, read by the caller before a compile that its
    # world's end may leave running): a later world's process of any index may need the
    # entry, under the key every process computes.
    if distributed:
        with jax_private.cache_entries_from_this_process():
            return lowered.compile()
    return lowered.compile()


def _zeros(shape, dtype, sharding: NamedSharding) -> jax.Array:
    """A zero array laid out by ``sharding``, each shard made on its own (no global host
    copy)."""
    block = sharding.shard_shape(tuple(shape))
    return jax.make_array_from_callback(tuple(shape), sharding,
                                        lambda _: np.zeros(block, dtype))


class _SwitchInterval:
    """Lowers Python's thread switch interval while any background compile runs (counted
    across compilers), and restores what it was when the last one ends."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._saved: float | None = None

    def enter(self, seconds: float) -> None:
        with self._lock:
            if self._active == 0:
                self._saved = sys.getswitchinterval()
                if seconds < self._saved:
                    sys.setswitchinterval(seconds)
            self._active += 1

    def exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._saved is not None:
                sys.setswitchinterval(self._saved)
                self._saved = None


_switch_interval = _SwitchInterval()

_export_lowering_warmed = threading.Event()


def warm_export_lowering() -> None:
    """Lowers a trivial deserialised export once in this process (later calls return at
    once). The first lowering of any `jax.export` artifact in a process costs ~0.2 s more
    than every later one, whatever the module: one-time set-up, which `jax.clear_caches`
    keeps (`python -m mnemojax._src.bench.micro 7`). A process that holds the step's
    export but compiled none (`CompileOptions.ahead_compilers`: another process compiles
    it) would pay it in the new world's compile phase, on the recovery's critical path;
    it pays it here instead, on the background thread that took or made the export.
    Never raises: it saves time only."""
    if _export_lowering_warmed.is_set():
        return
    _export_lowering_warmed.set()
    t0 = time.perf_counter()
    try:
        x = jax.ShapeDtypeStruct((2,), jnp.float32)
        exported = jax_export.deserialize(jax_export.export(jax.jit(jnp.sin))(x).serialize())
        jax.jit(exported.call).lower(x)
    except Exception as e:  # noqa: BLE001 - only a warm-up
        log.debug("mnemojax: warming up the lowering of exports failed: %s", e)
        return
    log.info("mnemojax: warmed up the lowering of exports in %.2fs", time.perf_counter() - t0)


@contextlib.contextmanager
def _pmap_style_told(mesh: Mesh) -> Iterator[None]:
    """A step written for ``jax.pmap`` (a collective over a named axis, ``lax.pmean(g,
    'batch')``, ``BatchNorm(axis_name='batch')``) fails its trace under ``jax.jit`` with
    JAX's "unbound axis name": the error is raised as it is, with a note on what to do."""
    try:
        yield
    except NameError as e:
        if "unbound axis name" in str(e):
            e.add_note(
                "mnemojax runs the step under jax.jit over the global batch (mesh "
                f"{dict(mesh.shape)}), not once per device as jax.pmap does: either drop "
                "the collectives (jit already computes over the whole batch), or keep the "
                "step as written for pmap by building jax.shard_map(step, "
                "in_specs=(P(), P(axis)), out_specs=(P(), P()), check_vma=False) inside "
                "the function you decorate, over a mesh whose data axis has that name "
                "(README: 'A step written for jax.pmap')")
        raise


def layout_key(batch) -> tuple:
    """A batch's layout, hashable: its leaves' shapes and dtypes, and its structure (what
    a step compiled for one layout takes, `StepCompiler.key`)."""
    return (tuple((tuple(s.shape), str(s.dtype)) for s in jax.tree.leaves(batch)),
            jax.tree.structure(batch))


_live_compilers: weakref.WeakSet[StepCompiler] = weakref.WeakSet()
_exit_hooked = threading.Lock()


def _drop_queued_compiles_at_exit() -> None:
    """At the interpreter's exit, the compiles ahead that have not started are dropped,
    the compile process is killed with the compile it runs (`compile_process`), and a
    compile running on a thread is waited for, saying so (an XLA compile cannot be
    cancelled).
    Without it, a step never closed held its process's exit until every queued compile
    had run (a user trial: 67 s, silent): `concurrent.futures` joins a pool only once its
    thread has run everything queued before the pool's end-of-work marker."""
    compilers = list(_live_compilers)
    for compiler in compilers:
        compiler._closing.set()  # (before the abandon below: its failure is not logged)
    compile_process.abandon()  # a compile in flight there ends now (`CompileAbandoned`)
    for compiler in compilers:
        compiler.cancel_pending()
        compiler._pool.shutdown(wait=False, cancel_futures=True)
        if compiler.left_running is not None:
            log.info("mnemojax: at exit, waiting for the compile an ended world left running "
                     "(an XLA compile cannot be cancelled)")
        elif compiler.pending() and not compiler.uses_child():
            log.warning("mnemojax: at exit, waiting for the compile ahead of time in flight "
                        "(it cannot be cancelled; step.close() at the end of training waits "
                        "for it there)")


def _hook_exit() -> None:
    """Registers `_drop_queued_compiles_at_exit` once, to run before `concurrent.futures`'
    own exit join (threading's exit hooks run in reverse order of registration, and the
    pool's was registered when its module was imported, before any compiler existed)."""
    if not _exit_hooked.acquire(blocking=False):
        return
    register = getattr(threading, "_register_atexit", None)  # (CPython >= 3.9)
    if register is not None:
        register(_drop_queued_compiles_at_exit)


class LeftCompiles:
    """The XLA compiles that ended worlds left running (`StepCompiler.close`), by key,
    shared by one step's compilers of every world (`runtime.RuntimeBuilder`): a later
    world's compile of the same plan (the same ids: `topology.plans_ahead`) waits for the
    one left running, then loads the persistent-cache entry it wrote, rather than
    compiling the plan a second time beside it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: dict[tuple, threading.Event] = {}

    def leave(self, key: tuple) -> None:
        with self._lock:
            self._running.setdefault(key, threading.Event())

    def done(self, key: tuple) -> None:
        with self._lock:
            ended = self._running.pop(key, None)
        if ended is not None:
            ended.set()

    def wait(self, key: tuple, *, give_up: Callable[[], bool] = lambda: False
             ) -> tuple[float, bool]:
        """Waits for the compile of `key` left running, if there is one, unless
        ``give_up()`` turns true first; returns the seconds waited and whether it ended
        (True without one)."""
        with self._lock:
            ended = self._running.get(key)
        if ended is None:
            return 0.0, True
        t0 = time.perf_counter()
        while not ended.wait(0.2):
            if give_up():
                return time.perf_counter() - t0, False
        return time.perf_counter() - t0, True


class GivenUp(Exception):
    """A compile's world ended while it waited for one left running: it compiles
    nothing."""


def _forwarded(checked: Callable) -> frozenset[int]:
    """The shared leaves the trace of ``checked`` (`StepCompiler._checked_for`) found
    returned as given: `Executable.kept`."""
    return checked.__dict__.get("forwarded", frozenset())


def _source_function(fn: Callable | None) -> Callable | None:
    """The plain Python function `fn` is, under partials and wrappers (what JAX's trace
    errors can point at with a file and line), or None."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if fn is None:
        return None
    try:
        fn = inspect.unwrap(fn)
    except ValueError:  # (a wrapper loop)
        return None
    return fn if hasattr(fn, "__code__") else None


class StepCompiler:
    """Compiles ``pure(leaves, batch)`` for a mesh; caches executables by mesh and batch.

    Every mesh keeps the user's axis types (`axis_types`, by name): a step written for
    Explicit axes (``out_sharding`` specs on activations) is traced under such a mesh.

    With `exports` (multi-process), a step compiled ahead is exported there first and
    compiled through its export; a plan found there is lowered from it, not traced
    (module docstring).
    """

    def __init__(self, pure: Callable, specs: Sequence[PartitionSpec], leaf_structs,
                 *, batch_axes: Sequence[str], donate: bool, check_state: bool = True,
                 axis_types: shd.AxisTypes | None = None,
                 exports: ExportedSteps | None = None,
                 switch_interval_s: float | None = None,
                 leaf_names: Sequence[str] | None = None,
                 facts: StepFacts | None = None, left: LeftCompiles | None = None,
                 traced_as: Callable | None = None,
                 pack: Callable[[Mesh, bool, int, int], bool] | None = None,
                 share_forwarded: bool = False,
                 in_child: bool = False, child_nice: int = 0):
        self._pure = pure
        # Whether the leaves the step returns as given are snapshotted once and left out
        # of the packs (`shared_leaves`); fixed at its first use.
        self._share_forwarded = share_forwarded
        self._shared: frozenset[int] | None = None
        self._first_trace: tuple[tuple, Any, Any] | None = None  # (`trace_first`)
        # Compiles ahead of time in the compile process where it applies (`compile_process`,
        # `CompileOptions.compile_process`).
        self._in_child = in_child
        self._child_nice = child_nice
        # Whether the step also writes the state packed for the snapshot's copy, given the
        # mesh, whether its state has single-copy shards, the state's bytes and of them
        # the shared leaves' (`snapshot.Packed`).
        self._pack = pack
        self._traced_as = _source_function(traced_as)
        self._left = left if left is not None else LeftCompiles()
        self._leaf_names = list(leaf_names) if leaf_names is not None else None
        self._switch_interval_s = switch_interval_s
        self._exports = exports
        self._axis_types = dict(axis_types or {})
        self._specs = list(specs)
        self.leaf_structs = list(leaf_structs)  # (shape, dtype) per state leaf
        self._batch_axes = tuple(batch_axes)
        self._donate = donate
        self._check_state = check_state
        self._ready: dict[tuple, Executable] = {}
        self._said_not_warmed = False  # (`warm_one`, once: a step with host callbacks)
        self.facts = facts if facts is not None else StepFacts()
        self.warmed = 0
        self._futures: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mnemojax-compile")
        _live_compilers.add(self)
        _hook_exit()
        self._closing = threading.Event()  # ends a wait for a peer's export
        self._leavable: set[tuple] = set()  # `precompile(leavable=True)`: `close` may leave
        self._in_xla: tuple | None = None  # (key, mesh shape) whose XLA compile runs
        self.left_running: tuple | None = None  # the compile `close` left running
        self._said_failed: set[str] = set()  # mesh shapes whose compile ahead failed
        self.compiles = 0
        self.compiled_ahead = 0
        self.compiled_in_child = 0  # compiles ahead done in the compile process

    def shared_leaves(self) -> frozenset[int]:
        """The state leaves snapshotted once (`snapshot.SnapshotStore.share`) and left out
        of the packs: those the step returns as given (`StepFacts.forwarded`), where
        ``share_forwarded``. Fixed at the first call: the packs of every executable, and
        the store, agree on them (before the first trace: none)."""
        if self._shared is None:
            self._shared = (self.facts.forwarded or frozenset()) if self._share_forwarded \
                else frozenset()
        return self._shared

    def packs_for(self, mesh: Mesh) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """The packs the step writes on `mesh` (`pack_groups`): none where `pack` says no;
        never a shared leaf (`shared_leaves`: copied once, not every step). The same on
        every mesh a recovery plans (their axes divide every dimension they split), so a
        step exported for one mesh returns as many packs on another."""
        shared = self.shared_leaves()
        sizes = leaf_nbytes(self.leaf_structs)
        if (self._pack is None
                or not self._pack(mesh, single_copy_state(self._specs, mesh), sum(sizes),
                                  sum(sizes[i] for i in shared))):
            return []
        own = [i for i in range(len(self._specs)) if i not in shared]
        groups = pack_groups([self._specs[i] for i in own],
                             [self.leaf_structs[i] for i in own], mesh)
        return [(axes, tuple(own[j] for j in members)) for axes, members in groups or []]

    def trace_first(self, plan: MeshPlan, batch_struct) -> None:
        """Traces the step for `plan` now (its first compile then lowers this trace), so
        that `StepFacts.forwarded` is known before the first snapshot is laid out. In one
        process only (with exports the first trace is watched: `_lower`). A trace that
        fails is left to the compile, which raises it where it always did."""
        if self._exports is not None or self.facts.forwarded is not None:
            return
        key = self.key(plan, batch_struct)
        mesh, _, _, jit, args = self._setup(plan, batch_struct)
        try:
            with jax.set_mesh(mesh), _pmap_style_told(mesh):
                fn = self._checked_for(mesh)
                self._first_trace = (key, self._traced(jit(fn), args), fn)
        except Exception:  # noqa: BLE001 - raised again by the compile's own trace
            log.debug("mnemojax: the step's first trace failed; its compile traces again",
                      exc_info=True)

    def _checked_for(self, mesh: Mesh):
        """The step, plus per-device flags: is every float of the new state's local shards
        finite? (NaN gradients show up there even when the loss is finite.) Each device
        checks only its own shards: no collective, unlike a global ``jnp.all`` per leaf
        (compared in ``python -m mnemojax._src.bench.micro``). Fourth, the new state packed
        for the snapshot's copy (`packs_for`; an empty list where it is not packed)."""
        everywhere = PartitionSpec(tuple(mesh.axis_names))

        def local_flags(*xs):
            ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))
            return jnp.reshape(ok, (1,))

        explicit = {name for name, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                    if t == jax.sharding.AxisType.Explicit}

        def checked(leaves, batch):
            with jax.named_scope(USER_SCOPE):
                new, metrics = self._pure(leaves, batch)
            # The leaves returned as given (the same tracer): unchanged by the step, so not
            # packed where they are shared (`shared_leaves`: copied once). Still checked
            # for NaN/Inf: one given so (loaded between steps) is caught as before.
            forwarded = frozenset(i for i, (x, y) in enumerate(zip(leaves, new, strict=False))
                                  if x is y)
            if self.facts.forwarded is None:
                self.facts.forwarded = forwarded
            checked.__dict__["forwarded"] = forwarded & self.shared_leaves()
            # On Explicit axes a leaf the step resharded itself is read in the state's
            # layout (where the step's out_shardings put it too); shard_map refuses another.
            read = [jax.sharding.reshard(x, shd.explicit_part(spec, explicit))
                    for x, spec in zip(new, self._specs, strict=True)] if explicit else new
            packs = [packer(mesh, [self._specs[i] for i in members], axes)(
                *(read[i] for i in members)) for axes, members in self.packs_for(mesh)]
            floats = [i for i, (_, dtype) in enumerate(self.leaf_structs)
                      if self._check_state and jnp.issubdtype(dtype, jnp.inexact)]
            if not floats:
                return new, metrics, jnp.ones((1,), bool), packs
            check = jax.shard_map(local_flags, mesh=mesh,
                                  in_specs=tuple(self._specs[i] for i in floats),
                                  out_specs=everywhere, check_vma=False)
            finite = [read[i] for i in floats]
            if multi_process:  # every process must see the same verdict: one global flag
                return new, metrics, jnp.all(check(*finite)), packs
            return new, metrics, check(*finite), packs

        checked.__dict__["forwarded"] = frozenset()  # (set by its trace: `_forwarded`)
        multi_process = any(d.process_index != jax.process_index() for d in mesh.devices.flat)
        if self._traced_as is not None:
            # JAX names the traced function in its trace errors ("while tracing the
            # function ... at file:line"): the user's step, not this wrapper. Its own
            # signature stays (JAX names the arguments from it), and debug info is not in
            # the persistent cache's key (stripped there), so keys do not change.
            checked.__signature__ = inspect.signature(checked)  # type: ignore[attr-defined]
            checked.__wrapped__ = self._traced_as  # type: ignore[attr-defined]
        return checked

    @staticmethod
    def key(plan: MeshPlan, batch_struct) -> tuple:
        return (plan.key, *layout_key(batch_struct))

    def batch_shardings(self, mesh: Mesh, batch_struct):
        """Split along the batch axes, or whole on every device (`batch_splits`)."""
        return jax.tree.map(
            lambda s, split, axis: NamedSharding(
                mesh, shd.batch_spec(mesh, self._batch_axes, len(s.shape) if split else 0,
                                     axis)),
            batch_struct, batch_splits(batch_struct), example_axes(batch_struct))

    def _setup(self, plan: MeshPlan, batch_struct) -> tuple:
        """For `plan`: its mesh, the state's and the batch's shardings, ``jit`` (a function
        jitted with them and the donation) and the abstract arguments to lower with."""
        mesh = shd.mesh_from_plan(plan, self._axis_types)
        state_sh = shd.named(mesh, self._specs)
        batch_sh = self.batch_shardings(mesh, batch_struct)

        def jit(fn):
            return jax.jit(fn, in_shardings=(state_sh, batch_sh),
                           out_shardings=(state_sh, None, None, None),
                           donate_argnums=(0,) if self._donate else ())

        args = (
            [jax.ShapeDtypeStruct(shape, dtype, sharding=s)
             for (shape, dtype), s in zip(self.leaf_structs, state_sh, strict=True)],
            jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         batch_struct, batch_sh),
        )
        return mesh, state_sh, batch_sh, jit, args

    def _compile(self, plan: MeshPlan, batch_struct, ahead: bool) -> Executable:
        key = self.key(plan, batch_struct)
        if _keys_shared():  # (else none is left running: `close`)
            waited, ended = self._left.wait(key, give_up=self._closing.is_set)
            if not ended:
                raise GivenUp(plan.shape)
            if waited:
                log.info("mnemojax: waited %.2fs for the compile for mesh %s an ended world "
                         "left running (its persistent-cache entry is loaded now)", waited,
                         plan.shape)
        mesh, state_sh, batch_sh, jit, args = self._setup(plan, batch_struct)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh), _pmap_style_told(mesh):
            lowered, exported, kept = self._lower(jit, mesh, args, key, ahead)
        t1 = time.perf_counter()
        if self.facts.host_callbacks is None:
            self.facts.host_callbacks = jax_private.has_host_callbacks(lowered)
        self._check_state_types(lowered)
        _listen_for_cache_hits()
        hits = getattr(_hits, "count", 0)
        try:
            compiled, in_child = self._xla_compile(lowered, key, plan.shape, ahead)
        except Exception as e:
            if not exported or self.left_running == key:  # (left: its world has ended)
                raise
            log.warning("mnemojax: compiling the step for mesh %s from its export failed "
                        "(%s: %s); tracing it", plan.shape, type(e).__name__, e)
            with jax.set_mesh(mesh):
                fn = self._checked_for(mesh)
                lowered = self._traced(jit(fn), args).lower()
                exported, kept = False, _forwarded(fn)
            compiled, in_child = self._xla_compile(lowered, key, plan.shape, ahead)
        t2 = time.perf_counter()
        from_cache = getattr(_hits, "count", 0) > hits
        with self._lock:
            self.compiles += 1
            self.compiled_ahead += int(ahead)
            left = self.left_running == key
            self.compiled_in_child += int(in_child)
        log.info("mnemojax: compiled step for mesh %s (%s%s%s): lower %.2fs compile %.2fs%s",
                 plan.shape, "ahead of time" if ahead else "on demand",
                 ", from its export" if exported else "",
                 ", from the persistent cache" if from_cache else
                 ", in the compile process" if in_child else "", t1 - t0, t2 - t1,
                 "; its world had ended, only its persistent-cache entry is kept" if left
                 else "")
        return Executable(compiled, mesh, state_sh, batch_sh, t1 - t0, t2 - t1, ahead,
                          from_cache, exported,
                          pack_members=self._pack_members(compiled, mesh, plan.shape),
                          kept=kept)

    def _pack_members(self, compiled, mesh: Mesh, shape) -> tuple[tuple[int, ...], ...]:
        """The members of the packs `compiled` returns (its fourth output): those
        `packs_for` gives `mesh`, checked against the executable (one lowered from an
        export made under other options would return other packs, and every copy of
        them would be refused); () when they differ."""
        members = tuple(m for _, m in self.packs_for(mesh))
        try:
            returned = jax.tree_util.treedef_children(compiled.out_tree)[3].num_leaves
        except Exception:  # noqa: BLE001 - no output structure to check: nothing packed
            returned = None
        if returned != len(members):
            if members or returned:
                log.warning("mnemojax: the step compiled for mesh %s returns %s packs where "
                            "%d were planned; its snapshots are copied per leaf", shape,
                            returned, len(members))
            return ()
        return members

    def _xla_compile(self, lowered, key: tuple, shape, ahead: bool) -> tuple[Any, bool]:
        """The compile of ``lowered`` and whether the compile process made it; ahead of
        time, marked as one `close` may leave running (what it reads of this world is
        read before)."""
        distributed = _distributed()
        if not ahead:
            with compile_process.paused():  # (on a recovery's path: the cores are its own)
                return _compile_lowered(lowered, distributed), False
        child = self._child()
        with self._lock:
            self._in_xla = (key, shape)
        try:
            if child is None:
                return _compile_lowered(lowered, distributed), False
            with jax_private.compiles_elsewhere(child.compile) as elsewhere:
                return _compile_lowered(lowered, distributed), elsewhere()
        finally:
            with self._lock:
                self._in_xla = None
                left = self.left_running == key
            if left:
                self._left.done(key)

    def start_child(self) -> None:
        """Starts the compile process now, if this step compiles ahead there (otherwise at
        its first compile ahead)."""
        child = self._child()
        if child is not None:
            child.start()

    def uses_child(self) -> bool:
        """Whether this step's compiles ahead run in the compile process (one started)."""
        return self._in_child and compile_process.current() is not None

    def _child(self) -> compile_process.CompileProcess | None:
        """The compile process that compiles ahead of time for this step, if any: CPU
        devices only (`compile_process`; a later world with fewer devices uses the
        first one's)."""
        if not self._in_child:
            return None
        devices = jax.devices()
        if not all(d.platform == "cpu" for d in devices):
            return None
        return compile_process.shared(len(devices), self._child_nice)

    def _check_state_types(self, lowered) -> None:
        """The step must return each state leaf with the shape and dtype it was given: the
        runtime snapshots, reshards and feeds back the state by those (``jax.jit`` would
        trace again for the new types; the executable here would be refused at the next
        step, naming only a leaf index).

        Raises:
            UnsupportedStateError: naming every leaf whose type the step changes.
        """
        # As traced on both sides: numpy float64 state under JAX's default x64=False is
        # float32 going in as well as coming out (the user's array types are not it).
        given = [(tuple(a.shape), np.dtype(a.dtype)) for a in lowered.args_info[0][0]]
        out = [(tuple(o.shape), np.dtype(o.dtype)) for o in lowered.out_info[0]]
        changed = [(i, a, b) for i, (a, b) in enumerate(zip(given, out, strict=True)) if a != b]
        if not changed:
            return

        def name(i: int) -> str:
            return repr(self._leaf_names[i]) if self._leaf_names else f"#{i}"

        def typed(struct) -> str:
            return f"{np.dtype(struct[1]).name}{list(struct[0])}"

        listed = "; ".join(f"{name(i)}: {typed(a)} -> {typed(b)}" for i, a, b in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise UnsupportedStateError(
            f"the step changes the type of {len(changed)} state leaf(s) ({listed}{more}): a "
            "resilient step keeps the state's shapes and dtypes, to snapshot, reshard and "
            "feed it back; cast in the step (e.g. a statistic promoted by float64 inputs), "
            "or create the state with the type the step gives it")

    def _lower(self, jit, mesh: Mesh, args, key: tuple, ahead: bool
               ) -> tuple[Any, bool, frozenset[int]]:
        """Lowers the step for `mesh`: from its export when one is kept for `key` (and,
        compiling ahead with `exports`, exports it first), else by tracing it (or from
        `trace_first`'s trace). Returns the lowered step, whether it came from an export,
        and the shared leaves it returns as given (`Executable.kept`; none from an
        export)."""
        exported = self._exported(jit, mesh, args, key, ahead)
        if exported is not None:
            try:
                return jit(exported.call).lower(*args), True, frozenset()
            except Exception as e:  # noqa: BLE001 - never worse than tracing
                log.warning("mnemojax: lowering the step for mesh %s from its export failed "
                            "(%s: %s); tracing it", dict(mesh.shape), type(e).__name__, e)
        # (the first lowering is the first call's compile: the trace is for it or for none)
        first, self._first_trace = self._first_trace, None
        if first is not None and first[0] == key:
            _, traced, fn = first
            return traced.lower(), False, _forwarded(fn)
        fn = self._checked_for(mesh)
        exports = self._exports
        if (exports is not None and not exports.watched and exports.refused is None
                and jax.process_index() == 0):
            # Process 0 exports the candidates for every process (`ExportSharing`): its
            # first trace, the world's first compile, is watched here, off the
            # candidates' path (the watch makes a trace ~2.4x slower).
            # (A read refuses exports; the lowering itself is right for this world.)
            step = jit(fn)  # (outside: mnemojax's own reads)
            lowered, _ = self._watched(exports, lambda: self._traced(step, args).lower())
            return lowered, False, _forwarded(fn)
        return self._traced(jit(fn), args).lower(), False, _forwarded(fn)

    def _traced(self, step, args) -> Any:
        """``step`` traced with ``args``; the first trace tells the step's facts
        (`StepFacts.shard_map_axes`)."""
        traced = step.trace(*args)
        if self.facts.shard_map_axes is None:
            self.facts.shard_map_axes = jax_private.shard_map_axes(traced.jaxpr, USER_SCOPE)
            if self.facts.shard_map_axes is None:
                self.facts.shard_map_axes = frozenset()  # (said once)
                log.warning("mnemojax: could not read which mesh axes a jax.shard_map in the "
                            "step maps over (this JAX's jaxprs differ): a recovery may "
                            "narrow them (RecoveryOptions.shrink_shard_map_axes)")
        return traced

    @staticmethod
    def _watched(exports: ExportedSteps, trace: Callable[[], Any]) -> tuple[Any, bool]:
        """``trace()`` (the step's first trace with `exports`) watched for reads of its
        world (`_world_reads_while`); returns its result and whether none was seen (with
        one, exports are refused for the run)."""
        exports.watched = True
        traced, reads = _world_reads_while(trace)
        if reads:
            exports.refuse("it reads its world while tracing, which an export would fix at "
                           "this world's value: " + "; ".join(sorted(set(reads))[:3]))
        return traced, not reads

    def _exported(self, jit, mesh: Mesh, args, key: tuple, ahead: bool):
        """The step's export for `key`: kept, or (`ahead`, with `exports`) made now; None
        where there is none (no exports, refused, or not exportable)."""
        exports = self._exports
        if exports is None:
            return None
        exported = exports.get(key)
        if exported is None and ahead and exports.refused is None:
            try:
                export = jax_export.export(jit(self._checked_for(mesh)))
                if exports.watched:
                    exported = export(*args)
                else:  # the step's first export: does it read the world while tracing?
                    exported, clean = self._watched(exports, lambda: export(*args))
                    exported = exported if clean else None
                if exported is not None:
                    exports.put(key, exported)
            except Exception as e:  # noqa: BLE001 - e.g. a host callback: not exportable
                exported = None
                exports.refuse(f"{type(e).__name__}: {e}"[:300])
        return exported

    def get(self, plan: MeshPlan, batch_struct) -> tuple[Executable, str]:
        """The executable for `plan`, and where it came from: ``"ready"`` (compiled ahead and
        finished), ``"waited"`` (compiled ahead, still running: waited for it),
        ``"cached"`` (loaded now from the persistent compilation cache) or ``"compiled"``
        (compiled now, on the critical path)."""
        k = self.key(plan, batch_struct)
        with self._lock:
            exe = self._ready.get(k)
            future = self._futures.get(k)
        if exe is not None:
            exe.warm = True  # it runs now
            return exe, "ready"
        self.cancel_pending(keep=k)  # free the background worker for what is needed now
        if future is not None:
            if not future.cancel():  # already compiling: waiting beats starting over
                exe = future.result()
                if exe is not None:
                    return exe, "waited"
                # (only exported here: compiled from the export below, or loaded)
            with self._lock:
                self._futures.pop(k, None)
        exe = self._compile(plan, batch_struct, ahead=False)
        with self._lock:
            self._ready[k] = exe
        return exe, "cached" if exe.from_cache else "compiled"

    def precompile(self, plans: Sequence[MeshPlan], batch_struct, *,
                   export_only: bool = False, sharing: ExportSharing | None = None,
                   leavable: bool = False) -> list[concurrent.futures.Future]:
        """Compiles `plans` in the background, in order; already known ones are skipped.

        With ``export_only`` (multi-process, `CompileOptions.ahead_compilers`) each is only
        exported (`ExportedSteps`): another process compiles it and writes the persistent
        cache entry that this process's `get` loads, under a key every process shares.
        With ``sharing`` (multi-process, exports kept) one process traces and exports
        each, the others take that export (`ExportSharing`) and compile or keep it; the
        publisher exports and publishes every plan before it compiles any (the others
        wait for the exports, not for its compiles).
        """
        futures = []
        take = None
        if sharing is not None and self._exports is not None:
            if sharing.publish:
                for plan in plans:  # queued first: the single worker runs them in order
                    self._pool.submit(self._publish_export, plan, batch_struct,
                                      sharing.exchange)
            else:
                take = sharing.exchange
        for plan in plans:
            k = self.key(plan, batch_struct)
            with self._lock:
                if k in self._ready or k in self._futures:
                    continue
                if export_only and (self._exports is None or self._exports.refused is not None
                                    or self._exports.get(k) is not None):
                    continue  # nothing to export (or done): `get` loads what others compile
                future = self._pool.submit(self._background, k, plan, batch_struct,
                                           export_only, take)
                self._futures[k] = future
                if leavable:
                    self._leavable.add(k)
            futures.append(future)
        return futures

    def _background(self, k, plan, batch_struct, export_only: bool = False,
                    take: ExportExchange | None = None) -> Executable | None:
        if take is not None and not self._take_export(k, plan, take):
            with self._lock:  # the world is ending: nothing to compile for it
                self._futures.pop(k, None)
            return None
        # `CompileOptions.background_switch_interval_s`: the training thread gets the GIL
        # back within this, not 5 ms, at each hand-off while this compile traces.
        if self._switch_interval_s is not None:
            _switch_interval.enter(self._switch_interval_s)
        try:
            if export_only:
                if self._export(plan, batch_struct) is not None:
                    warm_export_lowering()  # a new world lowers it here: not then
                exe = None
            else:
                exe = self._compile(plan, batch_struct, ahead=True)
        except GivenUp:
            with self._lock:
                self._futures.pop(k, None)
            return None
        except Exception as e:
            with self._lock:
                self._futures.pop(k, None)
                said = str(plan.shape) in self._said_failed
                self._said_failed.add(str(plan.shape))
            theirs = isinstance(e, (jax.errors.JaxRuntimeError, MnemojaxError))  # (not the step's)
            if not (self._closing.is_set() or said or theirs):  # (said now, once: no fault yet)
                log.warning("mnemojax: compiling the step ahead of time for mesh %s failed "
                            "(%s: %s): a recovery onto such a mesh would fail the same way "
                            "and plan around it (another mesh, or a StepCompileError)",
                            plan.shape, type(e).__name__, str(e)[:500])
            raise
        finally:
            if self._switch_interval_s is not None:
                _switch_interval.exit()
        with self._lock:
            if exe is not None and self.left_running != k:  # (an ended world's: dropped)
                self._ready[k] = exe
            self._futures.pop(k, None)
        return exe

    def _export(self, plan: MeshPlan, batch_struct) -> Any:
        """Exports the step for `plan` (`_lower` ahead of time) without compiling it, unless
        an export is kept already; returns it (None: not exportable)."""
        k = self.key(plan, batch_struct)
        if self._exports is not None and (kept := self._exports.get(k)) is not None:
            return kept
        mesh, _, _, jit, args = self._setup(plan, batch_struct)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            exported = self._exported(jit, mesh, args, k, True)
        log.info("mnemojax: exported the step for mesh %s ahead of time in %.2fs%s",
                 plan.shape, time.perf_counter() - t0, "" if exported else ", not exportable")
        return exported

    def _take_export(self, k, plan: MeshPlan, exchange: ExportExchange) -> bool:
        """Takes the publisher's export of `plan`'s step (`ExportSharing`), given back this
        process's own call structures. Never fails the compile: without it this process
        traces the step itself, as without sharing. Returns False when the wait for it was
        given up (the world is ending: the caller compiles nothing for it)."""
        exports = self._exports
        if exports is None or exports.refused is not None or exports.get(k) is not None:
            return True
        trees = self._trees(k)
        digest = None if trees is None else structure_digest(*trees)
        if trees is None or digest is None:  # nothing here to give the export back its own
            return True
        try:
            t0 = time.perf_counter()
            got = exchange.fetch(export_name(k), cancelled=self._closing.is_set)
            if got is None:
                log.info("mnemojax: no export of the step for mesh %s came from the "
                         "exporting process; tracing it here", plan.shape)
                return True
            if got.given_up:
                return False
            if got.refused is not None:
                exports.refuse(f"in the exporting process: {got.refused}")
                return True
            if got.payload is None:  # exported there, but not shared: trace it here
                return True
            if got.structure != digest:
                log.warning("mnemojax: the exporting process's step for mesh %s takes or "
                            "gives other structures than this one's; tracing it here",
                            plan.shape)
                return True
            flat = jax_export.deserialize(bytearray(got.payload))
            exports.put(k, dataclasses.replace(flat, in_tree=trees[0], out_tree=trees[1]))
            with self._lock:
                exports.taken += 1
            log.info("mnemojax: took the step's export for mesh %s from the exporting "
                     "process in %.2fs (%d bytes)", plan.shape, time.perf_counter() - t0,
                     len(got.payload))
        except Exception as e:  # noqa: BLE001 - sharing only saves a trace
            log.warning("mnemojax: taking the step's export for mesh %s from the exporting "
                        "process failed (%s: %s); tracing it here", plan.shape,
                        type(e).__name__, e)
        return True

    def _trees(self, k) -> tuple[Any, Any] | None:
        """The step's argument and result structures for a call of the batch structure of
        `k` (`StepCompiler.key`): those of an executable compiled here for that structure
        (the mesh does not change them, the packs included: `packs_for`), which a peer's
        export, shipped with flat ones, is given back (`_take_export`). None without
        one."""
        with self._lock:
            ready = [e for key, e in self._ready.items() if key[2] == k[2]]
        for exe in ready:
            try:
                return exe.compiled.in_tree, exe.compiled.out_tree
            except Exception:  # noqa: BLE001 - a compiled object without them: look on
                continue
        return None

    def _publish_export(self, plan: MeshPlan, batch_struct, exchange: ExportExchange) -> None:
        """Exports `plan`'s step here (unless kept) and publishes it with flat structures
        (the call's own may hold types jax.export cannot serialise; the takers put theirs
        back, `_take_export`) and their digest. When it cannot be exported, says why
        (every process would fail alike); on any other failure publishes nothing to take,
        so that the others trace the step themselves at once."""
        exports = self._exports
        assert exports is not None
        name = export_name(self.key(plan, batch_struct))
        payload = refused = structure = None
        if self._switch_interval_s is not None:  # as `_background`: it traces
            _switch_interval.enter(self._switch_interval_s)
        try:
            exported = self._export(plan, batch_struct) if exports.refused is None else None
            if exported is None:
                refused = exports.refused or "not exportable"
            else:
                structure = structure_digest(exported.in_tree, exported.out_tree)
                flat = dataclasses.replace(
                    exported, in_tree=jax.tree.structure(((0,) * exported.in_tree.num_leaves, {})),
                    out_tree=jax.tree.structure((0,) * exported.out_tree.num_leaves))
                payload = bytes(flat.serialize()) if structure is not None else None
        except Exception as e:  # noqa: BLE001 - e.g. an effect jax.export cannot serialise
            log.warning("mnemojax: the step's export for mesh %s cannot be shared (%s: %s); "
                        "every process traces it", plan.shape, type(e).__name__, e)
            payload = None
        finally:
            if self._switch_interval_s is not None:
                _switch_interval.exit()
            try:
                exchange.publish(name, payload, refused=refused, structure=structure)
            except Exception as e:  # noqa: BLE001 - the takers wait, then trace
                log.warning("mnemojax: publishing the step's export for mesh %s failed "
                            "(%s: %s)", plan.shape, type(e).__name__, e)

    def warm_one(self, *, dead: Collection[int] = (),
                 wait: Callable[[Any], Any] = jax.block_until_ready) -> bool:
        """Executes one executable compiled ahead and never run, once, on zeros, so its
        first execution (several step times: XLA's one-time set-up per executable) is
        not a recovery's. Call it from the training thread between steps: every device
        then runs it after the step in the same order (an execution dispatched from
        another thread could interleave with the step's collectives in another order
        per device). Holds a zero state, its outputs and temporaries on the plan's
        devices while it runs. Never warmed: an executable over a device in ``dead``
        (a candidate of a mesh that is gone), and any of a step with host callbacks
        (they would see the zeros; also when its HLO cannot be read). ``wait`` blocks on
        the outputs (the caller's bounded wait: `proxy.DeviceProxy.await_outputs`). A
        warm-up that fails, or that ``wait`` gives up on (it is then left running: the
        next step's hang rule judges the devices), counts as done; it never fails the
        caller.

        Returns:
            Whether one was executed.
        """
        gone = {int(d) for d in dead}
        with self._lock:
            cold = [(k, e) for k, e in self._ready.items() if e.ahead_of_time and not e.warm
                    and not gone.intersection(d.id for d in e.mesh.devices.flat)]
        if not cold:
            return False
        key, exe = cold[0]
        exe.warm = True
        if self.facts.host_callbacks is None:  # its lowering could not tell: read the HLO
            try:
                text = exe.compiled.as_text()
            except Exception:  # noqa: BLE001 - unreadable: assume callbacks (never warm)
                text = None
            self.facts.host_callbacks = text is None or "callback" in text
        if self.facts.host_callbacks:
            if not self._said_not_warmed:
                self._said_not_warmed = True
                log.info("mnemojax: the step calls back to the host (or its HLO cannot be "
                         "read): fallback executables are not warmed")
            return False
        try:  # dispatched on this (the training) thread: its order on every device
            state = [_zeros(shape, dtype, sh) for (shape, dtype), sh in
                     zip(self.leaf_structs, exe.state_shardings, strict=True)]
            _, leaves, treedef = key  # the batch's shapes and dtypes (`key`)
            batch = jax.tree.unflatten(treedef, [
                _zeros(shape, np.dtype(dtype), sh) for (shape, dtype), sh in
                zip(leaves, jax.tree.leaves(exe.batch_shardings), strict=True)])
            wait(exe.compiled(state, batch))
        except Exception as e:  # noqa: BLE001 - a warm-up never fails the training
            log.warning("mnemojax: warming the step for mesh %s failed (%s: %s); it runs "
                        "cold if a recovery needs it", dict(exe.mesh.shape),
                        type(e).__name__, e)
            return False
        with self._lock:
            self.warmed += 1
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._futures)

    def wait_precompiled(self, timeout_s: float | None = None) -> bool:
        """Waits for the background compiles queued so far; True if all finished."""
        with self._lock:
            futures = list(self._futures.values())
        done, not_done = concurrent.futures.wait(futures, timeout=timeout_s)
        return not not_done

    def cancel_pending(self, keep: tuple | None = None) -> None:
        """Cancels background compiles that have not started (except `keep`)."""
        with self._lock:
            for k, f in list(self._futures.items()):
                if k != keep and f.cancel():
                    self._futures.pop(k, None)

    def close(self, *, leave_running: bool = False) -> None:
        """Cancels the background compiles not started and waits for the running one.

        With ``leave_running`` (the world ends: `api.ResilientStep._forget_world`), a
        running compile of a plan queued ``leavable`` (a world only a second loss forms,
        `CompileOptions.ahead_losses`: a single loss does not need it) is not waited for
        once it is inside JAX's compile: an XLA compile cannot be cancelled. (Not one of a
        likely world left running in the compile process: the new world's other
        processes, not knowing it runs, compiled the same plan on the recovery's path
        (`coordination.OneCompile`), 1.7-2.8 s in ``tests.jobs.two_kills``, where waiting
        for its end here let them load its entry.) It runs to its
        end, writes its persistent-cache entry (a later world of this step that needs the
        plan waits for it: `LeftCompiles`) and its executable is dropped; the interpreter's
        exit joins its thread (a pool's). Its trace, lowering or export is always waited
        for. JAX's own Python around the compile (its cache write, the executable's set-up)
        then runs after the world's end and keeps the old client alive, through JAX's
        caches, until the next world change clears them: so only where the persistent
        cache's keys are shared (CPU devices, a cache on: `_keys_shared`); on an
        accelerator the old client's memory must be freed before the new world's."""
        self._closing.set()
        self.cancel_pending()
        self._pool.shutdown(wait=False, cancel_futures=True)  # nothing else starts
        world_ends = leave_running
        leave_running = leave_running and bool(self._leavable) and _keys_shared()
        newly_left = False
        with self._lock:
            running = self._in_xla
            if (leave_running and running is not None and running[0] in self._leavable
                    and self.left_running != running[0]):
                self.left_running = running[0]
                self._left.leave(running[0])
                newly_left = True
        if running is not None and self.left_running == running[0]:  # (also a second close)
            if newly_left:
                log.info("mnemojax: left the compile ahead for mesh %s running (a world a "
                         "second loss forms; this world's end does not wait for it)",
                         running[1])
            return
        t = time.perf_counter()
        self._pool.shutdown(wait=True)
        if world_ends and (waited := time.perf_counter() - t) > 1.0:
            # (a user trial: the others' agreement took 13 s, with nothing saying why)
            log.warning("mnemojax: the end of this world waited %.1f s for the compile "
                        "ahead under way%s (a trace, an export or an XLA compile cannot be "
                        "cancelled; the next world's processes load what it wrote); the "
                        "other processes wait for this one at the agreement meanwhile",
                        waited, f" (mesh {running[1]})" if running is not None else "")
