"""Recovery: from a failure to a runtime on a new mesh and a state to replay from.

Two collaborators of the resilient step, one per kind of failure:

* `DeviceRecovery`: devices of this process died. Plan the reduced mesh (pure, `topology`),
  take the state just in time from live replicas or host snapshots (`state_source`), or
  from the persistent tier, compile (or take the executable compiled ahead), reshard.
* `ProcessRecovery`: a peer process died (multi-process). Agree with the survivors on the
  new world and the step to resume from, re-initialise into it in-process, plan its mesh
  with the same planner and rules, compile, restore the agreed state from the agents. A
  process the plan gives no device leaves the job; the others agree again without it.

Both return a `Resumed`: the new `Runtime`, the state and the step it is the state after.
The step's own loop then replays the steps since, with their batches, and runs the failed
step; no recovery calls back into the step. Every recovery is timed by phase (detect,
agree, plan, reshard/restore, compile, replay) and recorded (`RecoveryRecord`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import jax

from mnemojax._src import monitoring
from mnemojax._src.compiler import (
    Executable,
    GivenUp,
    StepFacts,
    cache_dir,
    export_name,
    leaf_nbytes,
    shares_cache_entries,
)
from mnemojax._src.distributed import env as dist_env
from mnemojax._src.distributed import jax_private
from mnemojax._src.distributed.worker import coordination, peer_watch, state_transfer
from mnemojax._src.distributed.worker.recovery import WorldRecovery
from mnemojax._src.distributed.worker.session import DistributedSession
from mnemojax._src.durability import Durability
from mnemojax._src.errors import (
    DistributedError,
    MeshTooSmallError,
    MnemojaxError,
    RecoveryExhaustedError,
    StateUnavailableError,
    StepCompileError,
)
from mnemojax._src.options import ResilienceOptions
from mnemojax._src.persistent import PersistentTier
from mnemojax._src.replay import ReplayBuffer, batch_struct
from mnemojax._src.retry import Attempts, StopRule
from mnemojax._src.runtime import Runtime, RuntimeBuilder
from mnemojax._src.state_source import HostState, gather_given, gather_state
from mnemojax._src.statistics import RecoveryRecord, Statistics
from mnemojax._src.topology import (
    MeshPlan,
    Place,
    ShapeRules,
    aligned_with,
    plan_after_process_loss,
    plan_reduced_mesh,
    renumber_devices,
)

log = logging.getLogger("mnemojax")

# How long the survivors wait for process 0 to checkpoint the agreed state when too few
# survive (a missing member is evicted after this: keep it above the largest save).
CHECKPOINT_BARRIER_S = 900.0
# The compile barrier of a world (`DistributedSession.compiled`), which a recovering
# process reaches after restoring its regions and a joining one after `step.restore()`:
# this, plus the whole state's bytes at this rate (a process may fetch all of it, from
# another host), at most the cap, before a missing member is evicted. Every caller uses
# `compiled_barrier_s`: the launcher's barrier evicts by the first arrival's timeout.
COMPILED_BARRIER_S = 300.0
FETCH_FLOOR_BYTES_PER_S = 50e6
COMPILED_BARRIER_MAX_S = 1800.0


@dataclasses.dataclass
class Resumed:
    """What a recovery hands back to the step's loop.

    Attributes:
        runtime: the runtime on the new mesh.
        leaves: the state after `state_step`, on the new mesh.
        state_step: the step `leaves` is the state after; the loop replays the steps
            after it, up to the failed one.
        record: the recovery's record so far; the loop adds the replay and the total.
        publish_replayed: replayed steps are published to the agents (multi-process).
    """

    runtime: Runtime
    leaves: list
    state_step: int
    record: RecoveryRecord
    publish_replayed: bool = False


def check_budget(rule: StopRule, attempts: int, elapsed_s: float, *, step: int,
                 exc: BaseException, what: str) -> None:
    """Raises `RecoveryExhaustedError` (from `exc`) if `rule` says stop."""
    if rule(Attempts(attempts, elapsed_s)):
        raise RecoveryExhaustedError(
            f"step {step}: {what} budget exhausted after {attempts} attempt(s) in "
            f"{elapsed_s:.1f} s ({rule}); last error: {exc}", attempts=attempts,
            last_error=exc) from exc


def finish_recovery(record: RecoveryRecord, *, t_fault: float, t_end: float,
                    statistics: Statistics, durability: Durability) -> None:
    """Records a recovery once the failed step has run again (or failed again)."""
    record.total_s = t_end - t_fault
    statistics.recoveries.append(record)
    monitoring.record_recovery(record)
    # Emitted at the end of the recovery, stamped with when the fault surfaced.
    durability.emit("fault", step=record.step, failed_devices=list(record.failed_devices),
                    failed_processes=list(record.failed_processes),
                    classification="device_failure", hang=record.hang,
                    time_s=time.time() - record.total_s)
    for phase, seconds in record.phases_s.items():
        durability.emit("recovery_phase", step=record.step, phase=phase, duration_s=seconds)
    durability.emit("recovery", step=record.step, duration_s=record.total_s,
                    steps_lost=record.steps_lost, source=record.source, plan=record.plan_kind,
                    executable=record.executable, new_mesh=record.new_mesh_shape,
                    bytes_moved=record.bytes_moved, groups_changed=record.groups_changed,
                    guarded=record.guarded, joined_processes=list(record.joined_processes),
                    waited_s=record.waited_s)


@contextlib.contextmanager
def compiling_for(plan: MeshPlan, durability: Durability, step: int) -> Iterator[None]:
    """A recovery's compile of the step for ``plan``: an error of the step's own trace or
    compile there (it compiled on the first mesh) is a `StepCompileError` naming the
    mesh, the cause chained, told as a ``fault`` event (``step_compile``); a runtime error
    (a device failing meanwhile) and mnemojax's own errors pass unchanged."""
    try:
        yield
    except (jax.errors.JaxRuntimeError, MnemojaxError, OSError, MemoryError, GivenUp):
        raise  # (a device, mnemojax's own, the host's, the world ending)
    except Exception as e:
        durability.emit("fault", step=step, classification="step_compile",
                        mesh=plan.shape, detail=f"{type(e).__name__}: {str(e)[:200]}")
        raise StepCompileError(
            f"the step cannot be compiled for the recovery's mesh {plan.shape} "
            f"({type(e).__name__}: {str(e)[:500]}); it compiled for the first mesh, so "
            "it depends on the mesh's shape: a shape computed while tracing from the "
            "device count or an axis's width (a reshape into micro-batches per replica), "
            "or a jax.shard_map given mesh= or made once outside the step (it keeps that "
            "mesh: make it inside the step, without mesh=)",
            mesh_shape=plan.shape) from e


def compile_for_world(session: DistributedSession, runtime: Runtime, batch: Any,
                      examples: int | None, *, timeout_s: float = COMPILED_BARRIER_S
                      ) -> tuple[Executable, bool]:
    """Multi-process: compiles the step for `runtime`'s mesh (the ``compile`` phase), with
    no barrier yet: the caller waits at ``session.compiled()`` before the first collective.
    Returns the executable and whether it was compiled now, here or by the process this
    one waited for (not loaded from an entry written before).

    On one host (`compiler.shares_cache_entries`, with the peer watch on), when the
    executable is not in the persistent cache (a first world, or nothing compiled ahead
    for this one), the first process to ask compiles it and the others load its entry
    (`coordination.OneCompile`, waiting at most ``timeout_s``: the compile barrier's):
    one compile on the cores they share instead of one per process at once."""
    session.phase("compile")
    struct = batch_struct(batch, examples)
    compiler = runtime.compiler
    if (session.peer_watch is None or compiler.facts.host_callbacks
            or not shares_cache_entries(one_host=dist_env.one_host())):
        # (A step with host callbacks: JAX writes no entry to wait for.)
        exe, where = compiler.get(runtime.plan, struct)
        return exe, where == "compiled"
    # One program in one world: the same name in every process (not only its generation: a
    # second resilient step compiles another program in the same world).
    one = coordination.OneCompile(
        f"mnemojax/compile/{session.world.generation}/"
        f"{export_name(compiler.key(runtime.plan, struct))}", cache_dir(),
        stop=lambda: peer_watch.known_death() is not None, timeout_s=timeout_s)
    if not one.claim():
        waited = []

        def wait() -> bool:
            if compiler.facts.host_callbacks:  # (told by this compile's lowering)
                return False  # JAX writes no entry for it: nothing to wait for
            waited.append(True)
            return one.wait()

        with jax_private.before_compiling_a_miss(wait):
            exe, where = compiler.get(runtime.plan, struct)
        return exe, where == "compiled" or bool(waited)
    entry = False
    try:
        with jax_private.counting_cache_writes() as written:
            exe, where = compiler.get(runtime.plan, struct)
        entry = where == "cached" or written() > 0
        return exe, where == "compiled"
    finally:
        try:
            one.done(entry)
        except Exception as e:  # noqa: BLE001 - the others then compile after their wait
            log.warning("mnemojax: could not tell the other processes about the step's "
                        "compile (%s: %s)", type(e).__name__, e)


def compiled_barrier_s(builder: RuntimeBuilder) -> float:
    """The compile barrier's timeout for a world of ``builder``'s state (the constants
    above): the same in every process."""
    nbytes = sum(leaf_nbytes(builder.leaf_structs))
    return min(COMPILED_BARRIER_S + nbytes / FETCH_FLOOR_BYTES_PER_S, COMPILED_BARRIER_MAX_S)


def _groups_of(plan: MeshPlan) -> dict[str, dict[str, list]]:
    return {a: {"kept": list(c.kept), "added": list(c.added), "removed": list(c.removed)}
            for a, c in plan.groups.items()}


class _PersistentFallback:
    """The newest Orbax checkpoint as a recovery's last resort."""

    def __init__(self, durability: Durability, batches: ReplayBuffer,
                 leaf_structs: Sequence[tuple[tuple[int, ...], Any]]):
        self._durability = durability
        self._batches = batches
        self._structs = list(leaf_structs)

    def host_state(self, step: int, shardings, unavailable: StateUnavailableError) -> HostState:
        """The checkpoint's state, if the batches since it are still kept for replay."""
        restored = self._durability.restore_latest(shardings, self._structs)
        if restored is None:
            raise unavailable
        saved_step, leaves = restored
        self._batches.check_replayable(saved_step, step, "the newest checkpoint", unavailable)
        log.warning("mnemojax: step %d: no in-memory copy survives; restoring the persistent "
                    "checkpoint of step %d", step, saved_step)
        return HostState(list(leaves), "persistent", saved_step,
                         sum(x.nbytes for x in leaves))


class DeviceRecovery:
    """Recovers from the loss of devices of this process (see module docstring)."""

    def __init__(self, options: ResilienceOptions, builder: RuntimeBuilder,
                 durability: Durability, statistics: Statistics, batches: ReplayBuffer,
                 others: Callable[[], Sequence[MeshPlan]] = tuple):
        """``others``: the plans the other live steps of this process run on now (a plan
        takes the device order of one over the same devices: `topology.aligned_with`)."""
        self._options = options
        self._builder = builder
        self._durability = durability
        self._statistics = statistics
        self._batches = batches
        self._others = others
        self._persistent = _PersistentFallback(durability, batches, builder.leaf_structs)

    def _plan(self, runtime: Runtime, rules: ShapeRules) -> MeshPlan:
        """The mesh without the dead devices, in the device order of another step of this
        process already there (the arrays they pass each other then stay where they are)."""
        old, proxy = runtime.proxy.plan, runtime.proxy
        plan = plan_reduced_mesh(old.device_ids, old.axis_names, proxy.dead,
                                 spares=proxy.spares, **rules.as_kwargs())
        return aligned_with(plan, old.device_ids, self._others())

    def recover(self, runtime: Runtime, *, step: int, state_step: int, leaves: list,
                failed: Collection[int], detect_s: float, rules: ShapeRules,
                given: bool = False) -> Resumed:
        """A runtime on a mesh without the dead devices, and the newest complete state.

        Args:
            runtime: the runtime that failed (its proxy knows the dead devices).
            step: the step that failed (the loop's target).
            state_step: the step `leaves` is the state after.
            leaves: the state on the old mesh (read from its live replicas).
            failed: the devices whose loss this recovery handles (for the record).
            detect_s: seconds it took to classify the failure.
            rules: the planner's rules.
            given: `leaves` are the state given to a call before it ran, not the state
                the step last wrote (another step returned it, or the caller changed it):
                only their live copies (and host arrays) hold them, and a shard lost with
                every replica ends the recovery with `StateUnavailableError` (the step's
                snapshots, or a checkpoint, are of its own older state: mixing them in
                would lose the change silently, a review's finding).

        Raises:
            MeshTooSmallError: no valid mesh remains.
            StateUnavailableError: no complete copy of any step survives.
            jax.errors.JaxRuntimeError: another device failed during the recovery.
        """
        opts = self._options
        proxy = runtime.proxy
        old_plan = proxy.plan
        phases = {"detect": detect_s}
        t = time.perf_counter()
        plan = self._plan(runtime, rules)
        phases["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        runtime.store.wait_idle(timeout_s=60)  # a copy in flight either completes or fails
        unavailable: StateUnavailableError | None = None
        host: HostState | None = None
        if given:  # (no fallback: see above)
            host = gather_given(leaves, state_step, proxy.dead, runtime.layer)
        try:
            if host is None:
                host = gather_state(leaves, state_step, proxy.dead, runtime.store.snapshots(),
                                    runtime.layer, live_ok=not opts.compile.donate_state,
                                    snapshots_off=runtime.store.disabled_why)
            self._statistics.corrupt_snapshots_detected += host.corrupt_snapshots
            if host.corrupt_snapshots:
                self._durability.emit("fault", step=step, classification="corrupt_snapshot",
                                      snapshots=host.corrupt_snapshots)
        except StateUnavailableError as exc:
            self._statistics.corrupt_snapshots_detected += exc.corrupt
            unavailable = exc  # last resort: the persistent tier, below
        phases["reshard"] = time.perf_counter() - t
        t, planned = time.perf_counter(), phases["plan"]
        exe, how, plan = self._compiled(runtime, plan, rules, step, phases)
        phases["compile"] = time.perf_counter() - t - (phases["plan"] - planned)
        t = time.perf_counter()
        if host is None:
            assert unavailable is not None
            host = self._persistent.host_state(step, exe.state_shardings, unavailable)
        new_leaves = [runtime.layer.put(h, s) for h, s in
                      zip(host.leaves, exe.state_shardings, strict=True)]
        jax.block_until_ready(new_leaves)
        phases["reshard"] += time.perf_counter() - t
        phases["replay"] = 0.0  # the loop adds the replayed steps and the failed step
        new_runtime = self._builder.build(plan, mesh=exe.mesh, spares=proxy.spares_after(plan),
                                          dead=proxy.dead, same_world=runtime)
        record = RecoveryRecord(
            step=step, failed_devices=tuple(sorted(failed)),
            old_mesh_shape=old_plan.shape, new_mesh_shape=plan.shape,
            new_mesh_devices=tuple(int(i) for i in plan.device_ids.flat),
            plan_kind=plan.kind, source=host.source, source_step=host.step,
            steps_lost=step - 1 - host.step, precompiled=how not in ("compiled", "cached"),
            executable=how,
            phases_s=phases, total_s=0.0,
            bytes_moved=host.bytes_read + sum(h.nbytes for h in host.leaves),
            groups_kept=plan.kept_group_count(), groups_changed=plan.changed_group_count(),
            groups=_groups_of(plan), examples_per_step=plan.examples_per_step,
            math_changed=plan.math_changed)
        log.warning("mnemojax: step %d: continuing on mesh %s (%s, state from %s)",
                    step, plan.shape, _KIND_SAID.get(plan.kind, plan.kind), host.source)
        return Resumed(new_runtime, new_leaves, host.step, record)


    def _compiled(self, runtime: Runtime, plan: MeshPlan, rules: ShapeRules, step: int,
                  phases: dict[str, float]
                  ) -> tuple[Executable, str, MeshPlan]:
        """The step compiled for ``plan``; where it cannot be (`StepCompileError`: its
        trace fails for that shape, e.g. micro-batches computed from the data axis's
        width), the next plan around the shapes refused so far (kept in the step's facts,
        so later plans pass them over too), until one compiles or none is left (the first
        error is raised). Adds the re-plans to ``phases["plan"]``. In one process (across
        processes, `ProcessRecovery.recover` plans around it once every process failed
        alike)."""
        facts = runtime.compiler.facts
        first: StepCompileError | None = None
        tried: list[dict[str, int]] = []
        while True:
            try:
                with compiling_for(plan, self._durability, step):
                    exe, how = runtime.compiler.get(
                        plan, batch_struct(self._batches.last, plan.examples_per_step))
                return exe, how, plan
            except StepCompileError as e:
                if plan.kind == "spare_swap" or jax.process_count() > 1:
                    raise  # (a spare swap keeps the shape the step compiled for)
                first = first or e
                tried.append(plan.shape)
                if len(tried) >= _MAX_REFUSED:
                    break
                rules = _refused(facts, plan, rules, step)
                t = time.perf_counter()
                try:
                    plan = self._plan(runtime, rules)
                except MeshTooSmallError:
                    break
                finally:
                    phases["plan"] += time.perf_counter() - t
        raise _tried_too(first, tried)


# Where each process of a new world goes on (`ProcessRecovery.recover`'s ``position``:
# ``step:<s>`` or ``guard:<s>:<n>``, then ``@<worker id>``), in that world's store.
POSITIONS = "mnemojax/resume-position"

# The meshes a recovery tries to compile the step for before it raises
# (`DeviceRecovery._compiled`, `ProcessRecovery.recover`): each try traces the step on
# the recovery's path (across processes, with an agreement round per idle process).
_MAX_REFUSED = 3
# How the log says a plan's kind (`topology.PlanKind`): a user trial took "spare_swap" for
# spares it never reserved (the healthy devices an earlier shrink left idle).
_KIND_SAID = {"spare_swap": "spare_swap: spare or idle devices, left by an earlier "
                            "shrink, in place of the lost"}


def _tried_too(first: StepCompileError, tried: Sequence[dict[str, int]]) -> StepCompileError:
    """The first mesh's `StepCompileError` (its cause kept), naming the meshes tried after
    it."""
    if len(tried) > 1:
        first.args = (f"{first.args[0]}; nor for meshes {list(tried[1:])}",)
    return first


def _refused(facts: StepFacts, plan: MeshPlan, rules: ShapeRules, step: int) -> ShapeRules:
    """``rules`` with ``plan``'s shape refused (the step could not be compiled for it),
    kept in the step's facts for later plans (`ResilientStep._rules`)."""
    facts.refused_shapes.add(tuple(int(n) for n in plan.device_ids.shape))
    log.warning("mnemojax: step %d: the step cannot be compiled for mesh %s; planning "
                "around it", step, plan.shape)
    return dataclasses.replace(rules, refused_shapes=tuple(sorted(facts.refused_shapes)))


def _replanned(plan: MeshPlan, places: Mapping[int, Place], previous_members: Sequence[int],
               survivors: Sequence[int], new_devices: Mapping[int, Sequence[int]],
               rules: ShapeRules, spares: Sequence[int]) -> MeshPlan:
    """`plan`, in a past world's device ids, on this world's devices: the ``survivors``
    of ``previous_members`` keep their devices' places (`topology.renumber_devices`),
    and the planner shrinks the mesh over the places no one holds
    (`topology.plan_after_process_loss`)."""
    renumbering = renumber_devices(places, previous_members, survivors, new_devices)
    return plan_after_process_loss(plan.device_ids, plan.axis_names, renumbering, rules,
                                   spares=spares)


def _idle_processes(plan: MeshPlan, devices: Mapping[int, Sequence[int]]) -> list[int]:
    """The processes of the new world that hold no device of ``plan`` (e.g. a model
    replica spans two processes and an odd number survive). Such a process cannot run the
    step (nothing of its outputs is addressable to it): it leaves the job. Every process
    plans alike, so each finds the same ones."""
    used = {int(d) for d in plan.device_ids.flat}
    return sorted(p for p, ids in devices.items() if not used & set(ids))


class ProcessRecovery:
    """Recovers from the loss of peer processes (see module docstring).

    Args:
        options: the options in force.
        builder: builds the new world's runtime.
        durability: the persistent tier (reopened for the new world) and the event log.
        statistics: the step's statistics.
        batches: the kept batches (the oldest replayable step goes to the agreement).
        session: this worker's `DistributedSession`.
        leaf_keys: per state leaf, its key (to checkpoint the agreed state).
        origin: this process's first mesh and its devices' places: the layout a world
            that grows back to its first size returns to (`recover`).
    """

    def __init__(self, options: ResilienceOptions, builder: RuntimeBuilder,
                 durability: Durability, statistics: Statistics, batches: ReplayBuffer,
                 session: DistributedSession, leaf_keys: Sequence[tuple[str, ...]],
                 origin: tuple[MeshPlan, Mapping[int, Place]]):
        self._options = options
        self._builder = builder
        self._durability = durability
        self._statistics = statistics
        self._batches = batches
        self._session = session
        self._leaf_keys = list(leaf_keys)
        self._persistent = _PersistentFallback(durability, batches, builder.leaf_structs)
        self.built: Runtime | None = None  # the new world's runtime, once built
        self._origin = origin

    def recover(self, old_plan: MeshPlan, places: Mapping[int, Place], *, step: int,
                last_step: int, reason: str, t_fault: float, rules: ShapeRules,
                spares: Sequence[int], close_s: float = 0.0,
                position: str | None = None, regrow: bool = False) -> Resumed:
        """Agrees with the survivors, joins their world, plans its mesh, compiles and
        restores the agreed state.

        The caller must hold no array or executable of the old world (see
        `recover_world`): it has closed the old runtime. If a peer dies once the new
        world's runtime is built, `built` is that runtime: the world that failed next.

        Args:
            old_plan: the mesh of the world that failed, in its device ids.
            places: (process index, local rank) of each device of the old world.
            step: the step that failed.
            last_step: the newest step this process completed and published.
            reason: what was seen (logged by the coordinator).
            t_fault: when the failure surfaced (perf_counter).
            rules: the planner's rules.
            spares: old ids of the old world's spare devices (idle survivors can swap in).
            close_s: of the time since ``t_fault``, how long closing the old worlds'
                runtimes took, over every round so far (the first waits for a background
                compile that is running), with the held copy handed to the agent before:
                the ``close`` phase, apart from ``detect``.
            position: where this process goes on, posted under `POSITIONS` in the store
                of every world it forms, as soon as it is formed (before the compile
                barrier, which a joining spare reaches only after reading them).

        A process the new mesh gives no device (a model replica that spans processes,
        with an odd number left) leaves the job, and the others agree again without it
        (`_without_idle`).

        Raises:
            MeshTooSmallError: no mesh fits the survivors' devices, or it would have
                fewer than ``min_devices`` (the agreed state is checkpointed first when a
                persistent tier is configured).
            LeftJobExit: in a process the new mesh gives no device: it left the job.
            StateUnavailableError: no copy of the agreed state survives anywhere.
            jax.errors.JaxRuntimeError: a peer failed during the recovery.
        """
        session = self._session
        self.built = None
        t0 = time.perf_counter()
        before = session.world
        if regrow:  # (announced: no failure)
            log.warning("mnemojax: step %d: the world re-forms larger (spares are ready to "
                        "fill it back to its first size)", step)
        else:
            log.warning("mnemojax: step %d: a peer process failed (%s); recovering the "
                        "world", step, reason[:200])
        rec = session.recover(last_step=last_step, reason=reason,
                              first_replayable=self._batches.first_step)
        if position is not None:
            coordination.post_value(f"{POSITIONS}/{rec.world.generation}", position)
        plan_s, left = 0.0, []
        first: StepCompileError | None = None  # (every process failed this mesh too)
        tried: list[dict[str, int]] = []
        while True:  # (again when every process failed to compile the planned mesh)
            while True:
                t = time.perf_counter()
                agreement = rec.agreement
                new_devices: dict[int, list[int]] = {}
                for d in jax.devices():
                    new_devices.setdefault(d.process_index, []).append(d.id)
                # A world grown back to world 0's size (`book.AgreementBook.decide`): more
                # processes than the world it was decided from.
                grown = agreement.num_processes > len(agreement.previous_members)
                try:
                    if grown:
                        plan = self._grown_plan(agreement.num_processes, new_devices, rules)
                    else:
                        # A joiner (a spare) takes a dead member's rank: its devices take
                        # that member's places in the mesh, which keeps its size.
                        as_old = [rec.replaces.get(w, w) for w in agreement.survivors]
                        plan = _replanned(old_plan, places, rec.members, as_old,
                                          new_devices, rules, spares)
                except MeshTooSmallError as exc:
                    self._persist_agreed_state(rec, exc)
                plan_s += time.perf_counter() - t
                idle = _idle_processes(plan, new_devices)
                if not idle:
                    break
                leaving = [rec.agreement.survivors[p] for p in idle]
                rec = self._without_idle(rec, idle, leaving, plan, step=step,
                                         last_step=last_step)
                if position is not None:
                    coordination.post_value(f"{POSITIONS}/{rec.world.generation}", position)
                left += leaving
            phases = {"detect": t0 - t_fault - close_s, "close": close_s,
                      "agree": rec.phases["detach"] + rec.phases["agree"], "plan": plan_s}
            t = time.perf_counter()
            runtime = self.built = self._builder.build(plan, spares=plan.idle)
            self._durability.reopen_tier(runtime.layer)
            outcome = (f"mnemojax/compile-outcome/{rec.world.generation}/"
                       + "x".join(str(n) for n in plan.device_ids.shape))
            try:
                with compiling_for(plan, self._durability, step):
                    exe, compiled_now = compile_for_world(
                        session, runtime, self._batches.last, plan.examples_per_step,
                        timeout_s=compiled_barrier_s(self._builder))
            except StepCompileError as e:
                if not self._every_process_failed(outcome):
                    raise
                first = first or e
                tried.append(plan.shape)
                if len(tried) >= _MAX_REFUSED:  # (as in one process; the cause kept)
                    raise _tried_too(first, tried) from first.__cause__
                rules = _refused(runtime.compiler.facts, plan, rules, step)
                self.built = None
                runtime.close()
                continue
            coordination.post_value(outcome, "ok")  # (a peer that failed waits for it)
            break
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        shardings = exe.state_shardings
        if agreement.resume_step < 0:
            session.compiled(timeout_s=compiled_barrier_s(self._builder))
            compile_s += time.perf_counter() - t
            t = time.perf_counter()
            resume, leaves = self._from_persistent(step, agreement.why, runtime, shardings)
            source = "persistent"
            restore_s = time.perf_counter() - t
        else:  # the agreement chose a step every survivor can replay from
            # Fetched and placed before the barrier: no collective runs in either, so
            # while the slowest peer still compiles, the others restore (on one host a
            # compile with no cached entry is one process's, the others wait inside
            # `compile_for_world`: then they restore after it).
            resume = agreement.resume_step
            leaves = session.restore(rec, shardings, put=runtime.layer.put)
            source = "agent_snapshots"
            restore_s = time.perf_counter() - t
            t = time.perf_counter()
            # The barrier evicts a member still missing this long after another arrived:
            # room for a peer's fetch of the whole state at the replication's floor rate.
            session.compiled(timeout_s=compiled_barrier_s(self._builder))
            compile_s += time.perf_counter() - t  # (the barrier's wait)
        phases["compile"] = compile_s
        phases["restore"] = rec.phases["attach"] + rec.phases["fetch"] + restore_s
        phases["replay"] = 0.0
        dead = tuple(sorted(set(rec.members) - set(agreement.survivors) - set(left)))
        # (a joiner of a round whose world never formed is not one of this world's)
        joined = tuple(sorted(set(rec.replaces) & set(agreement.survivors)))
        record = RecoveryRecord(
            step=step, failed_devices=(), old_mesh_shape=old_plan.shape,
            new_mesh_shape=plan.shape,
            new_mesh_devices=tuple(int(i) for i in plan.device_ids.flat),
            plan_kind="grow_back" if grown else "process_loss", source=source,
            source_step=resume,
            steps_lost=step - 1 - resume, precompiled=not compiled_now,
            executable="compiled" if compiled_now else "cached",
            phases_s=phases, total_s=0.0, bytes_moved=rec.state.fetched_bytes,
            groups_kept=plan.kept_group_count(), groups_changed=plan.changed_group_count(),
            groups=_groups_of(plan), examples_per_step=plan.examples_per_step,
            math_changed=plan.math_changed, failed_processes=dead,
            generation=rec.world.generation, fetched_from=dict(rec.state.fetched_from),
            left_processes=tuple(sorted(left)), agreement_rounds=rec.rounds,
            from_export=exe.exported, joined_processes=joined,
            cause=reason[:500])
        change = ", ".join(filter(None, [
            f"processes {list(dead)} lost" if dead else "",
            f"processes {sorted(left)} left the job" if left else "",
            f"processes {list(joined)} joined" if joined else ""])) or "re-formed"
        log.warning("mnemojax: world %d -> %d: %s; %d process(es), mesh %s, "
                    "ready to resume from step %d after %.2f s (%s; executable %s): %d "
                    "step(s) to replay before step %d (the recovery's total, logged once "
                    "step %d has run, counts them and that step's run)",
                    before.generation, rec.world.generation, change,
                    rec.world.num_processes, plan.shape, resume, sum(phases.values()),
                    ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if v >= 0.005),
                    record.executable, record.steps_lost, step, step)
        return Resumed(runtime, leaves, resume, record, publish_replayed=True)

    def _every_process_failed(self, outcome: str) -> bool:
        """After this process failed to compile the planned mesh: whether every process
        of the new world did (each posts its outcome under ``outcome``; a trace that fails
        for a shape fails alike everywhere). Only then do they plan around it together;
        a process that compiled goes on to the compile barrier, and this one raises (the
        job ends, as before the planning around). Waits as long as the compile barrier,
        ended by a peer's death."""
        coordination.post_value(outcome, "failed")
        found = coordination.posted_values(
            outcome, jax.process_count(), timeout_s=compiled_barrier_s(self._builder),
            stop=lambda: peer_watch.known_death() is not None)
        return found is not None and set(found.values()) == {"failed"}

    def _without_idle(self, rec: WorldRecovery, idle: Sequence[int], workers: Sequence[int],
                      plan: MeshPlan, *, step: int, last_step: int) -> WorldRecovery:
        """The new world's mesh ``plan`` leaves processes ``idle`` (``workers``) with no
        device: they leave the job (`DistributedSession.leave`, raising `LeftJobExit`
        there), and the others agree again over the world they formed, without them. The
        result continues ``rec`` (`WorldRecovery.then`): planned from the same world that
        failed."""
        session = self._session
        why = (f"the new mesh {plan.shape} leaves processes {list(idle)} (workers "
               f"{list(workers)}) of world {rec.world.generation} with no device")
        if rec.world.process_id in idle:
            self._durability.emit("fault", step=step, classification="left_job", detail=why)
            session.leave(step=step, reason=why)
        log.warning("mnemojax: step %d: %s: they leave the job; agreeing again without them",
                    step, why)
        again = session.recover(last_step=last_step, reason=why,
                                first_replayable=self._batches.first_step)
        return rec.then(again)

    def _grown_plan(self, processes: int, new_devices: Mapping[int, Sequence[int]],
                    rules: ShapeRules) -> MeshPlan:
        """The mesh of a world that grew back to this process's first size: its first
        layout, each rank's devices in the places of that rank's devices then (the
        launcher gives every member its first-world rank, `book.AgreementBook.decide`).

        Raises:
            DistributedError: this process's first world had another size (it joined a
                shrunk world), so it does not know the full layout.
        """
        plan, places = self._origin
        first = len({p for p, _ in places.values()})
        if first != processes:
            raise DistributedError(
                f"the world grew back to {processes} processes, but this process's first "
                f"world had {first}: it cannot rebuild the full mesh (a process that first "
                "joined a shrunk world)")
        ranks = list(range(processes))  # every member is at its first-world rank
        return _replanned(plan, places, ranks, ranks, new_devices, rules, spares=())

    def _from_persistent(self, step: int, why: str, runtime: Runtime,
                         shardings: Sequence[Any]) -> tuple[int, list]:
        """No step's state survives in memory (`Agreement.lost`): every survivor restores
        the newest Orbax checkpoint onto the new world's mesh, else a typed error."""
        unavailable = StateUnavailableError(f"step {step}: {why}")
        if not self._options.persistent.directory:
            raise StateUnavailableError(
                f"{unavailable}, and no persistent tier is configured "
                "(PersistentOptions(directory=...))")
        host = self._persistent.host_state(step, shardings, unavailable)
        # Orbax restores each leaf onto its sharding already: one that spans other
        # processes' devices cannot be read back to the host to be placed again.
        leaves = [h if isinstance(h, jax.Array) and h.sharding.is_equivalent_to(s, h.ndim)
                  else runtime.layer.put(h, s)
                  for h, s in zip(host.leaves, shardings, strict=True)]
        return host.step, leaves

    def _checkpointed_barrier(self, rec: WorldRecovery, step: int) -> None:
        """Every survivor waits until process 0 has checkpointed the agreed step (or died,
        or failed: it arrives either way)."""
        coordinator = self._session.coordinator
        if coordinator is None:  # (a recovery across processes always has one)
            return
        failed = coordinator.barrier(generation=rec.world.generation,
                                     name=f"mnemojax-checkpointed-{step}",
                                     timeout_s=CHECKPOINT_BARRIER_S)
        if failed:
            log.warning("mnemojax: workers %s died before the agreed step %d was "
                        "checkpointed", list(failed), step)

    def _persist_agreed_state(self, rec: WorldRecovery, exc: MeshTooSmallError) -> NoReturn:
        """No mesh fits the survivors (or not ``min_devices``): the agreed state (every shard of
        it, from the agents) goes to the persistent tier before the typed error. Rank 0
        leaves the distributed world first, so Orbax runs as a single process; the others
        wait for it at the launcher's barrier before they raise (the launcher ends the job
        a few seconds after the first of them exits, which would cut the save short)."""
        step = rec.agreement.resume_step
        directory = self._options.persistent.directory
        where = "no persistent tier is configured (PersistentOptions(directory=...))"
        if step < 0:
            where = (f"no copy of the shards of workers {list(rec.agreement.lost)} survives, "
                     "so there is no state to checkpoint")
        elif directory:
            where = f"process 0 of the survivors checkpoints step {step} in {directory}"
            try:
                if rec.world.process_id == 0:
                    leaves = state_transfer.assemble_agreed(rec.state, len(self._leaf_keys))
                    coordination.detach_worker()
                    tier = PersistentTier(os.fspath(directory), keys=self._leaf_keys,
                                          max_to_keep=self._options.persistent.max_to_keep)
                    tier.save(step, leaves, wait=True)
                    tier.close()
                    where = f"step {step} is checkpointed in {tier.directory}"
            finally:
                self._checkpointed_barrier(rec, step)
        raise MeshTooSmallError(f"{exc}; {where}", healthy_devices=exc.healthy_devices,
                                required=exc.required) from exc
