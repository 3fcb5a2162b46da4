"""Frozen, keyword-only option dataclasses, nested by concern and validated on construction."""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import signal
import time
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

from mnemojax._src import retry
from mnemojax._src.errors import InvalidOptionError

BatchPolicy = Literal["keep_math", "truncate_batch"]
NonFinitePolicy = Literal["raise", "skip_batch", "ignore"]
_BATCH_POLICIES = ("keep_math", "truncate_batch")
_NONFINITE_POLICIES = ("raise", "skip_batch", "ignore")
AUTO = "auto"
# What data_axis="auto" takes for batch axes, in mesh order: the names data-parallel and
# FSDP axes go by (MaxText and the Flax examples shard the batch over data and fsdp).
AUTO_BATCH_AXES = ("data", "batch", "dp", "fsdp")


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if origin is tuple:
        return f"a tuple of {_describe(typing.get_args(hint)[0])}"
    if origin is collections.abc.Callable:
        return "a callable"
    if origin is os.PathLike:
        return "a path"
    name = getattr(hint, "__name__", str(hint))
    return {"int": "an int", "float": "a number", "bool": "a bool", "str": "a str"}.get(
        name, f"a {name}")


def _matches(value: object, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(hint))
    if origin is Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return isinstance(value, tuple) and all(_matches(v, item) for v in value)
    if origin is collections.abc.Callable:
        return callable(value)
    if origin is os.PathLike:
        return isinstance(value, os.PathLike)
    if getattr(hint, "_is_protocol", False):  # e.g. StopRule: checked by its own rule
        return True
    return not isinstance(hint, type) or isinstance(value, hint)


def _check_types(options: object) -> None:
    """Every field has its annotated type (bools are not ints, ints are numbers)."""
    hints = typing.get_type_hints(type(options))
    for field in dataclasses.fields(options):  # type: ignore[arg-type]
        value = getattr(options, field.name)
        _check(_matches(value, hints[field.name]), field.name, value,
               _describe(hints[field.name]))


def _check(cond: bool, name: str, value: object, legal: str) -> None:
    if not cond:
        raise InvalidOptionError(f"{name}={value!r} is invalid: expected {legal}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    _check(value in choices, name, value, "one of " + ", ".join(repr(c) for c in choices))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapshotOptions:
    """Host-memory snapshots of the training state.

    A snapshot is a full copy of params, optimizer state, step counter and RNG state (one
    copy of every shard). How often one is needed depends on the mesh:

    * when every shard has a copy on another device (a data axis replicates the state),
      live replicas are the just-in-time source for any single failure; snapshots only
      guard against losing every copy at once, so they can be rare (`every_steps`);
    * when some shard has a single copy (a fully model-sharded mesh), the snapshot is its
      only other copy: `unreplicated_every_steps` (default every step) keeps the loss to at
      most one step.

    The cadence is re-chosen whenever a recovery changes the mesh.

    Attributes:
        every_steps: snapshot cadence when every shard is replicated (0: never).
        unreplicated_every_steps: snapshot cadence when some shard has a single copy
            (0: never).
        grads_every_steps: also keep the step's gradients (the pytree under the metrics key
            ``"grads"``, if the step returns one) as a separate entry every N steps; 0: never.
        host_memory_budget_bytes: snapshots (both buffers) may use at most this much host
            memory; if the state does not fit, snapshots are disabled with a warning.
        verify_checksums: check each buffer's CRC32C before restoring from it.
        hold_live_replicas: multi-process: at a peer failure each survivor hands its agent
            the regions of the last good state its devices hold that its snapshots lack
            (data-parallel replicas), so a host lost together with its ring buddy loses
            nothing a third survivor still holds. Costs a device-to-host copy of those
            regions per failure, before the agreement; skipped when they would not fit
            ``host_memory_budget_bytes`` beside the snapshots, or when the survivor did not
            publish that step in its current world.
        overlap_publish: multi-process: copy each snapshot into the agent on a thread
            while the next step runs, instead of before it starts. Off by default: a
            process whose copy takes longer than the next step can die with neither of
            its last two steps complete while a peer has moved two steps on, leaving no
            step that every worker holds (the recovery then falls back to the persistent
            tier). For hosts with spare cores where the copy is short against the step;
            on this project's 2-core CPU VM it measured no faster. Ignored with
            ``CompileOptions.donate_state`` (the next step donates these arrays).
        replicate_in_series: multi-process: each publish returns only once the agent's
            ring buddy holds the snapshot just published, so the next step starts after
            it (replication in series with training). By default (False) the copy to the
            buddy overlaps the next step, and a publish waits only for the one before.
            That leaves one narrow window: a host dying while its last copy is still on
            the wire, while a peer's next copy has already pushed the step before out of
            its own buddy, leaves no step every worker holds (then the persistent tier).
            In series, every worker's step N+1 starts after its buddy holds N, and no
            worker can finish step N+2 (and overwrite N) before every peer has started it,
            so in steady training some step is held both by each worker's agent and by
            its buddy. That needs a collective across processes in every step (true of
            any step that shares gradients or state), and each wait to succeed: it is
            bounded as the one before a publish is (min(5 s, half the agent's hang floor):
            2.5 s by default), returns at once when the buddy refuses the copy or cannot
            be reached, and is logged when it gives up. Right after a recovery the
            guarantee starts again with the first publish of the new world (a spare holds
            no copy before it). Costs the replication's latency per snapshot
            (`tests.jobs.publish_overhead`). Lowers the host's snapshot memory at the
            peak from 5x to 4x its own share: the buddy drops the copy a new one outdates
            as soon as the new one starts to arrive, which is safe only in series
            (`tests.jobs.snapshot_layout_model`). Not with ``overlap_publish``.
        pack_copies: where a copy of the state is taken every step (in one process a
            snapshot every step; across processes the publish to the agent after each
            step), the compiled step also writes the new state packed: per device, its
            shards of the leaves sharded over the same mesh axes (and of one dtype) side by
            side in one flat array. The copy then reads a few buffers per device instead
            of one per leaf, the cost that dominates a small model's copy (on this
            project's 2-core CPU VM the bench GPT's every-step overhead went from
            x1.17-1.19 to x1.07, ``python -m mnemojax._src.bench.micro 6``); what is
            stored, and how it is read back, is unchanged. Costs one more copy of the state
            in device memory and a device-side copy per step. None (the default): on CPU
            devices; True: on any platform (unmeasured on GPUs, where it would replace
            many small device-to-host transfers by a few large ones, on the training
            thread across processes); False: off. Not where a leaf's shards differ in
            size.
        share_unchanged_leaves: in one process, the state leaves the step returns exactly
            as given (a frozen base: ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``,
            found at the step's first trace) are copied to host memory once and held by
            both snapshots, copied again only when they may have changed (a change made
            between steps to them, a step of another batch layout that changes them, a
            recovery onto other shards or one that rolled back); they are not packed, and
            ``host_memory_budget_bytes`` counts them once. Where the budget has no room
            for two copies of them, a change gives up the older snapshot while they are
            copied anew (said once; ``Statistics.snapshots_given_up``). False: every
            snapshot copies them, as any leaf (two independent host copies). Not yet
            across processes (the publishes to the agents copy the whole state).
    """

    every_steps: int = 20
    unreplicated_every_steps: int = 1
    grads_every_steps: int = 0
    host_memory_budget_bytes: int = 8 << 30
    verify_checksums: bool = True
    hold_live_replicas: bool = True
    overlap_publish: bool = False
    replicate_in_series: bool = False
    pack_copies: bool | None = None
    share_unchanged_leaves: bool = True

    def __post_init__(self):
        _check_types(self)
        _check(not (self.replicate_in_series and self.overlap_publish),
               "replicate_in_series", self.replicate_in_series,
               "False with overlap_publish=True (a copy in series cannot overlap the step)")
        _check(self.every_steps >= 0, "every_steps", self.every_steps, "an int >= 0")
        _check(self.unreplicated_every_steps >= 0, "unreplicated_every_steps",
               self.unreplicated_every_steps, "an int >= 0")
        _check(self.grads_every_steps >= 0, "grads_every_steps", self.grads_every_steps, ">= 0")
        _check(
            self.host_memory_budget_bytes > 0,
            "host_memory_budget_bytes",
            self.host_memory_budget_bytes,
            "> 0",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryOptions:
    """What a recovery may do, and when to give up.

    Attributes:
        batch_policy: when the surviving data-parallel width does not divide the global
            batch. ``"keep_math"`` (default) uses the widest data axis that divides it and
            keeps the other healthy devices idle; ``"truncate_batch"`` uses every surviving
            replica and drops the trailing examples of each batch (changes the math: warned
            and recorded in the statistics).
        stop: when to stop recovering while running one step (composable rules from
            `mnemojax.retry`, e.g. ``stop_after_attempt(3) | stop_after_delay(600)``); then
            `RecoveryExhaustedError`.
        run_stop: the same over the whole run: misconfigured triggers must not cascade
            into endless recoveries.
        retry_stop: when to stop retrying a transient error in place.
        retry_backoff: seconds to wait before retry n (``exponential_backoff(...)``).
        min_devices: never continue on fewer devices than this (`MeshTooSmallError`).
        model_shrink_headroom: how much more of the state each device may take on in one
            recovery when an axis the state is sharded along (a model axis, an FSDP
            axis) shrinks: a plan that narrows such an axis from width W to w needs
            W / w <= this; otherwise another axis shrinks (replicas are dropped), or
            `MeshTooSmallError`. Per recovery: two in a row compound. None: no bound from
            this option. In one process, where the devices report their memory
            (``Device.memory_stats()``: GPU, TPU, not CPU), the planner also bounds the
            factor by each device's limit over its peak use since the process started,
            taken once per mesh at its first plan (everything on a device is taken to
            grow with the factor); across processes only this option bounds it, since
            every process must plan alike.
        shrink_shard_map_axes: whether a recovery may narrow a mesh axis other than the
            batch axes that a ``jax.shard_map`` in the step maps over. Off by default: the
            map's body sees its local shapes and ``jax.lax.axis_size`` change with the
            width (a pipeline written for a fixed number of stages would apply some of
            them only: other math, silently), so plans keep such an axis whole (replicas
            are dropped instead, or `MeshTooSmallError` names the axis). On for a body
            written for any width (a tensor-parallel matmul that sums or gathers over the
            axis).
        probe_timeout_s: a device that does not answer a health probe in this time is dead.
        hang_timeout_s: a step whose results are not ready after this long is treated as
            a failure (its devices are probed). None: ``hang_factor`` x the median step
            time, at least ``hang_floor_s``.
        hang_factor: with ``hang_timeout_s=None``, the hang timeout in median step times.
        hang_floor_s: with ``hang_timeout_s=None``, the least hang timeout, in seconds.
        clock: the time source (injectable so budget tests run instantly).
        sleep: how to wait (injectable likewise).
    """

    batch_policy: BatchPolicy = "keep_math"
    stop: retry.StopRule = dataclasses.field(
        default_factory=lambda: retry.stop_after_attempt(3) | retry.stop_after_delay(600.0))
    run_stop: retry.StopRule = dataclasses.field(
        default_factory=lambda: retry.stop_after_attempt(64))
    retry_stop: retry.StopRule = dataclasses.field(
        default_factory=lambda: retry.stop_after_attempt(3))
    retry_backoff: Callable[[int], float] = dataclasses.field(
        default_factory=retry.exponential_backoff)
    min_devices: int = 1
    model_shrink_headroom: float | None = None
    shrink_shard_map_axes: bool = False
    probe_timeout_s: float = 10.0
    hang_timeout_s: float | None = None
    hang_factor: float = 50.0
    hang_floor_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self):
        _check_types(self)
        _check_choice("batch_policy", self.batch_policy, _BATCH_POLICIES)
        for name in ("stop", "run_stop", "retry_stop"):
            value = getattr(self, name)
            _check(retry.is_stop_rule(value), name, value,
                   "a stop rule (mnemojax.retry.stop_after_attempt(...) | ...)")
        _check(callable(self.retry_backoff), "retry_backoff", self.retry_backoff,
               "a callable attempt -> seconds (mnemojax.retry.exponential_backoff)")
        _check(self.min_devices >= 1, "min_devices", self.min_devices, ">= 1")
        _check(self.model_shrink_headroom is None or self.model_shrink_headroom >= 1,
               "model_shrink_headroom", self.model_shrink_headroom, ">= 1 or None")
        _check(self.probe_timeout_s > 0, "probe_timeout_s", self.probe_timeout_s, "> 0")
        _check(self.hang_timeout_s is None or self.hang_timeout_s > 0, "hang_timeout_s",
               self.hang_timeout_s, "> 0 or None")
        _check(self.hang_factor > 1, "hang_factor", self.hang_factor, "> 1")
        _check(self.hang_floor_s > 0, "hang_floor_s", self.hang_floor_s, "> 0")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mnemojax", "xla")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Getting executables off the recovery path.

    Attributes:
        precompile: after the first step, compile in the background the step for every
            mesh that the loss of one device would produce.
        max_precompiled: at most this many fallback meshes are compiled ahead.
        cache_dir: JAX's persistent compilation cache directory, a process-wide setting
            made when the first resilient step is built and announced once with its path
            (a logged warning). None: leave JAX's setting alone. A cache directory the user
            set already, or ``jax_enable_compilation_cache=False``, always wins.
        export_ahead: under several processes, a step compiled ahead for a world one
            process's loss would form is `jax.export`-ed too, and that world lowers the
            export instead of tracing the step again (×7 cheaper; `compiler.ExportedSteps`).
            The export is this world's trace: a step that reads the world while tracing
            (``jax.process_count()``, ``jax.device_count()``, ...) would keep this
            world's values there. Such reads in the step's first export are seen and turn
            exports off for the run (a warning); set False for a step whose world
            dependence the watch cannot see (a value computed before the step).
        donate_state: donate the state buffers to the step. Saves one copy of the state
            in device memory, but a step that fails after donation leaves no live state,
            so recovery rolls back to the newest host snapshot and replays the steps since:
            a donated state is snapshotted before the first step too, and each copy is
            complete before the next step starts (it reads the buffers that step donates).
            At the default ``SnapshotOptions.every_steps`` a loss replays up to that many
            steps; ``every_steps=1`` loses at most one, for a host copy waited for every
            step. With donation
            a `NonFiniteLossError` leaves no previous state to continue from (restore a
            checkpoint), and ``nonfinite="skip_batch"`` is refused.
        background_switch_interval_s: while steps compile in the background, Python's
            thread switch interval (`sys.setswitchinterval`, process-wide) is lowered to
            this, then restored. Tracing holds the GIL, and every hand-off of the
            training thread (freeing each array of the previous state, waiting on the
            step) would otherwise wait up to the default 5 ms for it: the call that
            recovered from a device loss returned ~0.6 s late on the tiny GPT, and the
            steps after it were slow. Process-wide (data-loader threads see it too), and
            a value set meanwhile by the user is overwritten on restore. None: leave it
            alone.
        ahead_losses: under several processes, how many process losses the candidate
            worlds compiled ahead reach: 1, the world the loss of any one process forms; 2,
            also the world a second loss forms from it, compiled after the first (a second
            death during or right after a recovery then finds its step compiled: kill ->
            next good step 0.52 s against 1.25 s, `python -m tests.jobs.mp_measure --nproc
            4 --at-step 15 --steps 25 --then-after-decision 2 --precompile --ahead-losses
            2`). Its cost: one more background compile per world. A single fault that
            lands in it does not wait for it (a world's end leaves such a compile running:
            an XLA compile cannot be cancelled; it writes its persistent-cache entry, which
            a later world needing that plan waits for rather than compiling it again), but
            on a host with few cores it slows the recovery beside it.
        ahead_layouts: for how many batch layouts (the inputs' shapes and dtypes: bucketed
            sequence lengths, say) the candidate worlds are compiled ahead: 1, the newest
            batch's; N, also those of the N-1 layouts seen most recently before it, each
            compiled once first seen (N times the background compiles). A recovery in a
            step of a layout not compiled ahead compiles on its path (a user trial's
            bucketed sst2: 4.0-9.2 s).
        ahead_compilers: under several processes, how many of them compile each candidate
            world's step ahead (spread over the ranks: 0, n/k, ...); the others keep its
            export, and when that world forms they load the executable from the
            persistent compilation cache, whose keys mnemojax makes the same in every
            process for CPU devices (`jax_private.cache_entries_from_this_process`). Saves
            the other processes' compile (CPU that training shares on a host); a world that
            forms after every compiler of a candidate died before finishing compiles on
            the recovery path (with 1: a fault that kills process 0 before its
            background compiles are done, a few seconds after each world forms), on one
            host once: the first process to ask compiles, the others load its entry
            (`coordination.OneCompile`).
            Every process must see the same cache directory (one host, or a shared file
            system). None: 1 when the launcher runs the job on one host
            (``MNEMOJAX_ONE_HOST``), otherwise every process. Other platforms than CPU,
            or no persistent cache: every process compiles. Whatever this is, process 0
            alone traces each candidate's step (with ``export_ahead``): the others take its
            export through the coordination service (`coordination.SharedExports`), and
            trace it themselves only if none comes.
        warm_fallbacks: one process (ignored under ``mnemojax launch``): run each step
            compiled ahead once, on zeros, on the training thread between steps (one per
            call, bounded by the step's hang timeout), so a recovery does not pay its
            first execution (XLA's one-time set-up per executable: ~2-3 step times of the
            tiny GPT on CPU). Off by default: each warm-up costs that same first
            execution up front, for every candidate mesh (up to ``max_precompiled``),
            after the first step and after each recovery, so it trades throughput for
            recovery latency; while it runs the candidate's devices hold a zero state,
            its outputs and temporaries beside the live state. A step with host
            callbacks is never warmed (they would see the zeros).
        compile_process: run the XLA part of each compile ahead of time in a child
            process (`compile_process`), stopped (SIGSTOP) while a recovery compiles on
            its path, so a fault soon after a recovery does not share the cores with a
            compile it does not need (a second device loss right after a recovery:
            x1.18-1.24 of one cold compile against x1.74-1.82 on a thread, ``python -m
            mnemojax._src.bench.micro 8``), and the interpreter's exit kills it rather
            than wait for it. CPU devices, in one process or under ``jax.distributed``
            (on accelerators the background thread compiles as before); the child costs
            ~0.2 GB of host memory and ~2 s of CPU to start, when the step is built.
            Whatever fails there is compiled on the thread.
        compile_process_nice: the compile process's nice value (0-19; one compile process
            per value: a step with another value gets its own, and idle ones of other
            values end). Higher slows the steps beside the compiles
            ahead less but makes them ready later, and a fault before they are ready
            compiles on the recovery's path: ``micro 9`` measured steps x1.57 of steady
            beside them at 0 (ready in 14 s), x1.23 at 10 (24 s), x1.15 at 19 (29 s).
    """

    precompile: bool = True
    max_precompiled: int = 8
    cache_dir: str | os.PathLike[str] | None = dataclasses.field(default_factory=_default_cache_dir)
    donate_state: bool = False
    export_ahead: bool = True
    background_switch_interval_s: float | None = 0.0005
    ahead_compilers: int | None = None
    ahead_losses: int = 1
    ahead_layouts: int = 1
    warm_fallbacks: bool = False
    compile_process: bool = True
    compile_process_nice: int = 0

    def __post_init__(self):
        _check_types(self)
        _check(self.max_precompiled >= 0, "max_precompiled", self.max_precompiled, ">= 0")
        _check(self.ahead_compilers is None or self.ahead_compilers >= 1, "ahead_compilers",
               self.ahead_compilers, "None or >= 1")
        _check(self.ahead_losses in (1, 2), "ahead_losses", self.ahead_losses, "1 or 2")
        _check(self.ahead_layouts >= 1, "ahead_layouts", self.ahead_layouts, ">= 1")
        _check(0 <= self.compile_process_nice <= 19, "compile_process_nice",
               self.compile_process_nice, "0-19")
        _check(self.background_switch_interval_s is None
               or self.background_switch_interval_s > 0, "background_switch_interval_s",
               self.background_switch_interval_s, "None or > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PersistentOptions:
    """The persistent tier: Orbax checkpoints, used when no in-memory copy survives.

    Attributes:
        directory: checkpoint directory (None: no persistent tier).
        every_steps: asynchronous checkpoint every N steps (0: only just-in-time ones).
        max_to_keep: checkpoints kept on disk.
        preemption_signals: signals that announce a preemption: the running step finishes,
            the last complete step is checkpointed, then the step raises `PreemptionExit`.
            Empty: not watched.
        memory_pressure_fraction: when host (or device) memory use is above this fraction
            of its limit and rising, checkpoint at once and keep training (None: off).
        memory_check_every_steps: how often memory use is sampled.
    """

    directory: str | os.PathLike[str] | None = None
    every_steps: int = 0
    max_to_keep: int = 2
    preemption_signals: tuple[int, ...] = (signal.SIGTERM,)
    memory_pressure_fraction: float | None = 0.92
    memory_check_every_steps: int = 5

    def __post_init__(self):
        _check_types(self)
        _check(self.every_steps >= 0, "every_steps", self.every_steps, "an int >= 0")
        _check(self.max_to_keep >= 1, "max_to_keep", self.max_to_keep, ">= 1")
        valid = set(signal.valid_signals())
        for sig in self.preemption_signals:
            _check(sig in valid and sig not in (signal.SIGKILL, signal.SIGSTOP),
                   "preemption_signals", self.preemption_signals, "catchable signal numbers")
        if self.memory_pressure_fraction is not None:
            _check(0 < self.memory_pressure_fraction <= 1, "memory_pressure_fraction",
                   self.memory_pressure_fraction, "in (0, 1] or None")
        _check(self.memory_check_every_steps >= 1, "memory_check_every_steps",
               self.memory_check_every_steps, ">= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResilienceOptions:
    """All options of `mnemojax.resilient`.

    Attributes:
        snapshot: host snapshot options.
        recovery: recovery options.
        compile: compile / executable options.
        persistent: the persistent (Orbax) tier (None: none, as ``PersistentOptions()``).
        event_log: path of a JSONL event log to append to (None: no log).
        run_name: the ``run`` field of this step's events.
        data_axis: the mesh axis along which the batch is split and replicas are dropped,
            or several (``("data", "fsdp")``: the batch is split over their product, as
            MaxText does); the mesh must have them (checked when the step is built).
            ``"auto"`` (default): the mesh's axes named ``data``, ``batch``, ``dp`` or
            ``fsdp`` (`AUTO_BATCH_AXES`), in mesh order; a mesh with none of them is an
            `InvalidOptionError` naming this option. None: the mesh has no data-parallel
            axis, and every device sees the whole batch.
        loss_key: where the NaN/Inf policy finds the loss in what the step returns: a
            key of a metrics dict, or a callable taking the return value and giving the
            scalar loss (``lambda out: out[0]``, say). A scalar return value is the loss
            itself. Where no scalar loss is found, `LossCheckWarning` is issued once and
            only the new state is checked (a step that returns nothing, or a pure step
            its state alone, has only its state checked, without a warning).
        nonfinite: what a NaN/Inf in the loss or in the new state (from non-finite
            gradients) does. ``"raise"`` (default): `NonFiniteLossError`, the state of the
            previous step is kept; ``"skip_batch"``: keep the previous state, skip the batch,
            warn (`NonFiniteSkipWarning`) and record it in ``statistics.skipped_batches``;
            ``"ignore"``: no check.
        check_state: with ``nonfinite`` other than ``"ignore"``, also check every float of
            the new state (NaN gradients with a finite loss). It is one pass over the state
            per step, fused into the compiled step: ~5–8 % of the CPU demo step
            (``python -m mnemojax._src.bench.micro``). False: the loss only.
    """

    snapshot: SnapshotOptions = dataclasses.field(default_factory=SnapshotOptions)
    recovery: RecoveryOptions = dataclasses.field(default_factory=RecoveryOptions)
    compile: CompileOptions = dataclasses.field(default_factory=CompileOptions)
    persistent: PersistentOptions = dataclasses.field(default_factory=PersistentOptions)
    event_log: str | os.PathLike[str] | None = None
    run_name: str = "mnemojax"
    data_axis: str | tuple[str, ...] | None = "auto"
    loss_key: str | Callable[[Any], Any] = "loss"
    nonfinite: NonFinitePolicy = "raise"
    check_state: bool = True

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """`data_axis` as a tuple (empty for None; ``"auto"`` is resolved against the mesh
        when the step is built, see `batch_axes_of`)."""
        axis = self.data_axis
        return (axis,) if isinstance(axis, str) else tuple(axis or ())

    def batch_axes_of(self, axis_names: Sequence[str]) -> tuple[str, ...]:
        """The batch axes on a mesh with `axis_names` (``"auto"`` resolved).

        Raises:
            InvalidOptionError: the mesh lacks one of them (or, for ``"auto"``, has none
                of `AUTO_BATCH_AXES`), naming ``data_axis``.
        """
        names = tuple(axis_names)
        if self.data_axis == AUTO:
            axes = tuple(a for a in names if a in AUTO_BATCH_AXES)
            if not axes:
                raise InvalidOptionError(
                    f"data_axis='auto' finds no batch axis on the mesh (axes {names}; "
                    f"looked for {AUTO_BATCH_AXES}): set ResilienceOptions(data_axis=...) to "
                    "the axis (or axes) the batch is split along, or data_axis=None if the "
                    "mesh has none (every device then sees the whole batch)")
            return axes
        missing = [a for a in self.batch_axes if a not in names]
        if missing:
            raise InvalidOptionError(
                f"data_axis={self.data_axis!r}: {', '.join(map(repr, missing))} is not an "
                f"axis of the mesh (axes {names}): set ResilienceOptions(data_axis=...) to "
                "the axis (or axes) the batch is split along, or data_axis=None if the mesh "
                "has none (every device then sees the whole batch)")
        return self.batch_axes

    def __post_init__(self):
        if self.persistent is None:  # ``X if cond else None``: no persistent tier
            object.__setattr__(self, "persistent", PersistentOptions())
        _check_types(self)
        for name, cls in (("snapshot", SnapshotOptions), ("recovery", RecoveryOptions),
                          ("compile", CompileOptions), ("persistent", PersistentOptions)):
            value = getattr(self, name)
            _check(isinstance(value, cls), name, value, f"a {cls.__name__}")
        axes = self.batch_axes
        _check(all(axes) and len(set(axes)) == len(axes)
               and (self.data_axis is None or bool(axes)), "data_axis", self.data_axis,
               "a non-empty axis name, a tuple of distinct ones, or None")
        _check_choice("nonfinite", self.nonfinite, _NONFINITE_POLICIES)
        # A skipped batch keeps the previous state, which a donating step has consumed.
        _check(not (self.compile.donate_state and self.nonfinite == "skip_batch"),
               "nonfinite", self.nonfinite,
               "'raise' or 'ignore' with CompileOptions(donate_state=True) (the skipped "
               "step's input state is donated, so there is no previous state to keep)")
