"""`mnemojax.resilient`: the decorator and the `ResilientStep` it returns.

The step owns the call path and the loop that runs one step: place the batch, run, and on
a failure hand over to a recovery collaborator (`recovery.DeviceRecovery` for devices of
this process, `recovery.ProcessRecovery` for peer processes), which returns a new runtime
and a state; the loop then replays the steps since that state and runs the failed step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from mnemojax._src import checksum as checksums
from mnemojax._src import ownership, persistent
from mnemojax._src import sharding as shd
from mnemojax._src.compiler import (
    Executable,
    ExportSharing,
    compiles_ahead_here,
    enable_persistent_cache,
    layout_key,
    leaf_nbytes,
)
from mnemojax._src.data import HostRows
from mnemojax._src.device_layer import put_host
from mnemojax._src.distributed import env as dist_env
from mnemojax._src.distributed import wire
from mnemojax._src.distributed.worker import coordination, peer_watch
from mnemojax._src.distributed.worker import session as dist_session
from mnemojax._src.durability import Durability
from mnemojax._src.errors import (
    BatchSplitError,
    CheckpointLostError,
    DeviceFailureError,
    DistributedError,
    GuardSkippedError,
    InvalidOptionError,
    LeftJobExit,
    LossCheckWarning,
    MathChangedWarning,
    NonFiniteLossError,
    NonFiniteSkipWarning,
    StateUnavailableError,
    StepHangError,
    UnsupportedStateError,
)
from mnemojax._src.fault_injection import FaultInjector
from mnemojax._src.options import AUTO, RecoveryOptions, ResilienceOptions
from mnemojax._src.proxy import Verdict, host_batch, looks_local, looks_transient
from mnemojax._src.recovery import (
    POSITIONS,
    DeviceRecovery,
    ProcessRecovery,
    Resumed,
    check_budget,
    compile_for_world,
    compiled_barrier_s,
    finish_recovery,
)
from mnemojax._src.replay import ReplayBuffer, batch_struct
from mnemojax._src.runtime import Runtime, RuntimeBuilder
from mnemojax._src.snapshot import Packed, has_single_copy_shards
from mnemojax._src.statistics import JoinRecord, RecoveryRecord, Statistics
from mnemojax._src.step_forms import (
    CallInputs,
    Convention,
    NnxForm,
    StepForm,
    batch_splits,
    consume_flax_static_cache,
    example_axes,
    form_for,
    is_ready,
    listed,
)
from mnemojax._src.topology import (
    MeshPlan,
    ShapeRules,
    plans_ahead,
    single_failure_plans,
)

log = logging.getLogger("mnemojax")

# How long a process waits for its peers' checksums of a new call layout's replicated
# inputs (`ResilientStep._compare_replicated_inputs`): peers reach their first call within
# seconds of each other; past this the comparison is skipped, not the step.
REPLICATED_COMPARE_S = 60.0

P = ParamSpec("P")
R = TypeVar("R")
P2 = ParamSpec("P2")
R2 = TypeVar("R2")


class _StepBudget:
    """The budgets of one step, its replays and recoveries included, on one clock.

    The clock starts at the step's first failure. Recoveries of devices and of processes
    both count against ``RecoveryOptions.stop`` (per step) and ``run_stop`` (per run);
    transient retries against ``retry_stop``.
    """

    def __init__(self, options: RecoveryOptions, step: int, run_recoveries: list[float]):
        self._options = options
        self._step = step
        self._run = run_recoveries  # budget clock of every recovery this run
        self._t_first: float | None = None
        self.retries = 0
        self.recoveries = 0

    def start(self) -> None:
        if self._t_first is None:
            self._t_first = self._options.clock()

    def _elapsed(self, since: float | None = None) -> float:
        self.start()
        assert self._t_first is not None
        return self._options.clock() - (self._t_first if since is None else since)

    def charge_retry(self, exc: BaseException) -> int:
        """Counts a transient retry, or raises `RecoveryExhaustedError`."""
        check_budget(self._options.retry_stop, self.retries, self._elapsed(), step=self._step,
                     exc=exc, what="transient-error retries")
        self.retries += 1
        return self.retries

    def charge_recovery(self, exc: BaseException) -> None:
        """Counts a recovery attempt, or raises `RecoveryExhaustedError` (from `exc`)."""
        opts = self._options
        check_budget(opts.stop, self.recoveries, self._elapsed(), step=self._step, exc=exc,
                     what="recovery")
        run_first = self._run[0] if self._run else None
        check_budget(opts.run_stop, len(self._run), self._elapsed(run_first), step=self._step,
                     exc=exc, what="run-wide recovery")
        self.recoveries += 1
        self._run.append(opts.clock())


@dataclasses.dataclass
class _Pending:
    """A recovery whose failed step has not run again yet."""

    record: RecoveryRecord
    t_fault: float
    replay_s: float = 0.0
    closed: bool = False  # recorded (`ResilientStep._close_recovery`, once)


@dataclasses.dataclass
class _RecoveredFirst:
    """A recovery made before the step ran (`ResilientStep._placed`): `_run` goes on from
    it, within the same budget."""

    resumed: Resumed
    t_fault: float
    budget: _StepBudget


class _LostBeforeStep(Exception):
    """Placing the state met devices lost since the step's last call (`_place_state`)."""

    def __init__(self, verdict: Verdict, error: BaseException):
        super().__init__(str(error))
        self.verdict, self.error = verdict, error


class ResilientStep(Generic[P, R]):
    """A train step that survives device loss. Built by `mnemojax.resilient`.

    Call it like the undecorated step, with ``nnx.jit``'s conventions: NNX objects anywhere
    in the arguments are the state, updated in place (``out = step(model, optimizer, rngs,
    batch, metrics, 0.1, 0)``); without them the step is pure, ``state, out = step(state,
    batch)``. The other arguments are inputs, given on the host: every input array is
    part of the global batch, split along the data axis of the current mesh; numbers, 0-d
    arrays, 0-d PRNG keys and the arguments named replicated are placed whole on every
    device.
    See `mnemojax.resilient`.

    Attributes:
        statistics: live `Statistics` (steps run, mesh, snapshots, recoveries).
        options: the `ResilienceOptions` in force. Under ``mnemojax.initialize()`` (several
            processes) background compiles and in-process snapshots are off: the agents
            hold the snapshots. `with_options` starts from the options as given.
        mesh: the current mesh (changes after a recovery).
    """

    def __init__(self, fn: Callable[P, R], *, mesh: Mesh | None = None,
                 static_argnums: int | Sequence[int] | None = None,
                 static_argnames: str | Sequence[str] | None = None,
                 donate_argnums: int | Sequence[int] | None = None,
                 donate_argnames: str | Sequence[str] | None = None,
                 replicated_argnums: int | Sequence[int] | None = None,
                 replicated_argnames: str | Sequence[str] | None = None,
                 example_axes: Mapping[int | str, int] | None = None,
                 options: ResilienceOptions | None = None,
                 fault_injector: FaultInjector | None = None,
                 spare_devices: Sequence[Any] = ()):
        if options is not None and not isinstance(options, ResilienceOptions):
            raise InvalidOptionError(
                f"options={options!r} is invalid: expected a mnemojax.ResilienceOptions")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise InvalidOptionError(f"mesh={mesh!r} is invalid: expected a jax.sharding.Mesh")
        if fault_injector is not None and not isinstance(fault_injector, FaultInjector):
            raise InvalidOptionError(f"fault_injector={fault_injector!r} is invalid: expected "
                                     "a mnemojax.testing.FaultInjector")
        self._jit_args: dict[str, Any] = dict(
            static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames,
            replicated_argnums=replicated_argnums, replicated_argnames=replicated_argnames,
            example_axes=example_axes)
        self._convention = Convention(fn, **self._jit_args)
        functools.update_wrapper(self, fn)
        self.__wrapped__ = fn
        self._fn = fn
        self._mesh_arg = mesh
        self.options = options or ResilienceOptions()  # in effect (see `_build`)
        self._given_options = self.options  # as given: what `with_options` copies
        self._injector = fault_injector
        self._spares_arg = tuple(spare_devices)
        self._statistics = Statistics()
        self._step = 0
        self._step_times: collections.deque[float] = collections.deque(maxlen=100)
        self._run_recoveries: list[float] = []  # budget clock of every recovery this run
        self._records_at_snapshot = 0  # (`_kept`: the recoveries recorded by then)
        # The shared leaves every step committed since the last snapshot returned as given
        # (`_note_kept`); None: no step since.
        self._kept_since: frozenset[int] | None = None
        snap = self.options.snapshot
        self._batches = ReplayBuffer(max(snap.every_steps, snap.unreplicated_every_steps,
                                         self.options.persistent.every_steps, 1) + 1)
        self._built: _Built | None = None
        self._warned_no_loss = False
        self._said_pure_change = False  # (`_snapshot_outside_change`: said once)
        self._guarding = False  # guarded work runs (`guard`): a guard inside runs plainly
        # The guarded work running found the objects holding the last step's state
        # (`_check_untouched`): what they hold now, it wrote (it runs again after a
        # recovery, so a recovery says nothing of it, `_recover_world`).
        self._guard_checked = False
        # (the step, how many guarded calls after it so far): where guarded work stands,
        # told to the new world at a recovery (`_check_peers_at_the_work`)
        self._guard_seq = (0, 0)
        # A process that joined a running job: the last step after which the survivors
        # run no guarded work (`_skip_what_survivors_passed`), and the step it joined at.
        self._joined_behind: int | None = None
        self._joined_at = 0
        # (the step, its recovery) after which processes joined in guarded work: the
        # guarded calls after that step do not run (`_check_no_joiners`)
        self._joiners_after: tuple[int, RecoveryRecord] | None = None

    def with_options(self, **changes: Any) -> ResilientStep[P, R]:
        """A new, unbuilt resilient step of the same function with some arguments changed
        (``mesh``, ``static_argnums``, ``static_argnames``, ``donate_argnums``,
        ``donate_argnames``, ``replicated_argnums``, ``replicated_argnames``, ``options``,
        ``fault_injector``, ``spare_devices``). A step that has run keeps its mesh and
        spare devices as they are now: after a recovery, without the devices lost."""
        mesh, spares = self._mesh_arg, self._spares_arg
        if self._built is not None:
            mesh, spares = self._built.runtime.mesh, tuple(self._built.runtime.proxy.spares)
            if "mesh" in changes and changes["mesh"] is not None:  # (its devices are no spares)
                taken = {int(d.id) for d in changes["mesh"].devices.flat}
                spares = tuple(s for s in spares if s not in taken)
        kwargs: dict[str, Any] = dict(mesh=mesh, options=self._given_options,
                                      fault_injector=self._injector,
                                      spare_devices=spares, **self._jit_args)
        unknown = set(changes) - set(kwargs)
        if unknown:
            raise InvalidOptionError(f"with_options got unknown argument(s) {sorted(unknown)}")
        kwargs.update(changes)
        return ResilientStep(self._fn, **kwargs)

    # -- public views -------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh | None:
        return self._built.runtime.mesh if self._built is not None else self._mesh_arg

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def statistics(self) -> Statistics:
        s = self._statistics
        if self._built is not None:
            b = self._built
            rt = b.runtime
            s.mesh_shape = dict(rt.mesh.shape)
            s.mesh_devices = tuple(int(i) for i in rt.plan.device_ids.flat)
            s.spare_devices = tuple(rt.proxy.spares)
            s.dead_devices = tuple(sorted(rt.proxy.dead))
            s.compiles = rt.compiler.compiles
            s.precompiled_meshes = rt.compiler.compiled_ahead
            s.exports_taken = b.builder.exports.taken if b.builder.exports is not None else 0
            snap = rt.store.latest()
            s.snapshot_bytes = snap.nbytes if snap else 0
            s.snapshot_bytes_by_entry = snap.nbytes_by_entry() if snap else {}
            s.snapshot_copy_median_s = rt.store.median_copy_s()
            s.snapshots_taken = rt.store.taken
            s.snapshots_packed = rt.store.packed + (
                b.session.packed_publishes if b.session is not None else 0)
            if b.session is not None and b.session.agent is not None:
                # Across processes each step's snapshot is this worker's shards, published
                # to its agent (a trial read 0 bytes and 0 taken beside 60 packed).
                s.snapshots_taken += b.session.publishes
                s.snapshot_bytes = s.snapshot_bytes or b.session.published_nbytes
                s.snapshot_every_steps = 0 if b.session.publish_refused else 1
            s.snapshots_replaced = rt.store.replaced
            s.snapshot_shared_bytes = rt.store.shared_bytes if snap else 0
            s.snapshot_host_bytes = rt.store.host_bytes
            s.snapshots_given_up = rt.store.gave_up
            s.corrupt_snapshots_scrubbed = rt.store.corrupt_found
            s.snapshots_over_budget = rt.store.disabled or (
                b.session is not None and b.session.publish_refused)
            if rt.store.disabled:  # (a trial: the cadence still read 1 with snapshots off)
                s.snapshot_every_steps = 0
            s.jit_checkpoints = b.durability.jit_checkpoints
            grads = rt.grads_store.latest() if rt.grads_store is not None else None
            s.grads_snapshot_step = grads.step if grads else None
            s.grads_snapshot_bytes = grads.nbytes if grads else 0
        return s

    def wait_precompiled(self, timeout_s: float | None = None) -> bool:
        """Blocks until the fallback executables queued so far are compiled; in a process
        that only keeps their exports (`CompileOptions.ahead_compilers`), until it has
        them (taken from process 0, which may still be compiling, or traced here when
        none came: `coordination.EXPORT_WAIT_S` at most in all)."""
        return self._built is None or self._built.runtime.compiler.wait_precompiled(timeout_s)

    def wait_snapshots(self, timeout_s: float | None = None) -> bool:
        """Blocks until the snapshot copy in flight (if any) is complete: in this process,
        or, under several processes, into this worker's agent."""
        if self._built is None:
            return True
        rt = self._built.runtime
        session = self._built.session
        return all(store.wait_idle(timeout_s) for store in (rt.store, rt.grads_store)
                   if store is not None) and (session is None
                                              or session.publish_idle(timeout_s))

    def close(self) -> None:
        """Stops the background threads (snapshot copiers, compiler) and waits for the
        checkpoint save in flight.

        Raises:
            CheckpointSaveError: a checkpoint failed and no call has raised it yet (once,
                after everything is closed). A call raises it at its start, before it does
                anything, so calling again with the same arguments continues the run.
        """
        ownership.release(self)
        if self._built is not None:
            if self._built.session is not None:  # the agent holds the last step's copy
                self._built.session.settle(quiet=True)
            self._built.runtime.close()
            self._built.durability.emit("run_end", step=self._step, steps=self._step)
            self._built.durability.close()

    # -- calling --------------------------------------------------------------------------
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        # Under `mnemojax launch` the agent's hang watchdog judges only the time inside
        # these calls: between them the user's own code runs (an eval, a save).
        if self._built is not None and self._built.session is not None:
            self._built.session.in_step(True)
        try:
            return self._call(args, kwargs)
        finally:
            if self._built is not None and self._built.session is not None:
                self._built.session.in_step(False)

    def _call(self, args: tuple, kwargs: dict[str, Any]) -> R:
        t_call = time.perf_counter()
        consume_flax_static_cache()
        b = self._built if self._built is not None else self._build(args, kwargs)
        if (left := b.session.left if b.session is not None else None) is not None:
            # This process left the job (the exit was caught, then the step called again).
            raise LeftJobExit(left.message, step=left.step, generation=left.generation)
        if b.session is not None and b.session.resume is not None:
            # It cannot run the job's steps from the wrong place: it leaves (the others
            # go on, and the launcher takes no more spares) rather than ending the job.
            why = (f"this process joined a running job (world {b.session.world.generation}, "
                   f"at step {b.session.resume.agreement.resume_step}), and its first call "
                   "came before step.restore(...): call it with the state before the first "
                   "step, and start the loop at the step it returns")
            log.error("mnemojax: %s; this process leaves the job", why)
            b.session.leave(step=self._step, reason=wire.Leave.NO_RESTORE + why)
        if isinstance(b.form, NnxForm):
            self._follow_in_place_change(b, b.form)
        try:
            state_args, user_batch = b.form.split_call(args, kwargs)
        except UnsupportedStateError:
            if (adopted := self._adopt_new_objects(b, args, kwargs)) is None:
                raise
            state_args, user_batch = adopted
        if b.superseded is not None:
            state_args = self._recovered_state_args(b, state_args)
        b.durability.check_preemption(self._step, b.last_written)
        leaves = b.form.state_of(state_args)
        _refuse_arrays_of_other_processes(user_batch)
        if b.session is not None and b.session.world.generation > 0:
            _say_inputs_of_ended_worlds(b, user_batch)
        elif b.runtime.proxy.dead:
            _say_inputs_on_lost_devices(b, user_batch)
        batch = host_batch(user_batch)
        self._check_batch(b, batch)
        self._compare_replicated_inputs(b, batch)
        step = self._step + 1
        if self.options.compile.ahead_layouts > 1:
            self._note_layout(b, batch)
        batch = self._batches.append(step, batch)  # our own copy, kept for replay
        try:
            leaves, recovered = self._placed(b, step, leaves)
            self._snapshot_outside_change(b, leaves)
            if b.session is not None and self._step == 0:
                # Before the first compile: a peer lost in it, or in step 1, needs it.
                self._publish(0, leaves)
            if b.snapshot_every is None and b.session is None:
                self._share_forwarded(b, batch)
                self._snapshot_initial(b, leaves)  # (after `_placed`'s recovery: of step - 1)
            barrier = b.session if b.session is not None and b.exe is None else None
            if barrier is not None:  # `_run` waits at its barrier (a peer lost: recovered)
                compile_for_world(barrier, b.runtime, batch, b.examples,
                                  timeout_s=compiled_barrier_s(b.builder))
            new_leaves, metrics, finite, ran_on, packed = self._run(step, leaves, batch,
                                                                    barrier, first=recovered)
            try:
                accepted = self._accept(step, metrics, finite)
            except BaseException:  # (a NaN raised, a bad loss_key)
                if ran_on is not leaves or recovered is not None:  # recovered: the caller
                    self._write_back(ran_on)  # gets step - 1's state back, on the new mesh
                raise
        except BaseException:
            self._batches.pop()  # a call that raised leaves no trace for a later replay
            raise
        if not accepted:  # nonfinite="skip_batch"
            self._batches.pop()
            # ``ran_on`` is the state of step - 1: the recovered one, if a recovery ran.
            b.last_written, b.superseded = ran_on, None
            return b.form.result(state_args, ran_on, metrics)
        self._commit(step, new_leaves, metrics, packed)
        b.durability.emit("step", step=step, duration_s=time.perf_counter() - t_call)
        self._after_commit(step, new_leaves)
        result = b.form.result(state_args, new_leaves, metrics)
        b.superseded = None  # the caller holds the new state
        if b.precompile_due:
            # Last, once the step is fully committed: background lowering and compiling
            # contend with the training thread (GIL, compile locks) and would otherwise
            # delay the replayed step's commit (see bench/micro.py, item 3). This call's
            # references to the states go first: each array freed while the compile
            # thread holds the GIL waits a switch interval for it (~0.6 s for the tiny
            # GPT's old state after a recovery, measured; the pure form's caller still
            # holds its state: there `background_switch_interval_s` is what helps).
            b.precompile_due = False
            del leaves, ran_on, new_leaves, batch
            self._schedule_precompile()
        elif b.session is None and self.options.compile.warm_fallbacks:
            # (`CompileOptions.warm_fallbacks`) never over a dead device; bounded like a step
            proxy, timeout_s = b.runtime.proxy, self._hang_timeout_s()
            b.runtime.compiler.warm_one(dead=proxy.dead, wait=lambda out: proxy.await_outputs(
                out, timeout_s=timeout_s, step=self._step))
        return result

    def guard(self, fn: Callable[P2, R2]) -> Callable[P2, R2]:
        """`fn` (JAX work on the training state beside this step: an eval step, a metrics
        gather) made to survive what this step survives.

        ``eval_step = train_step.guard(eval_step)`` (or ``@train_step.guard`` over
        ``@nnx.jit``) calls `fn` with the same arguments and waits for every array in its
        result. When that fails because devices or a peer process were lost, the
        training state is recovered as for a failed step (the same budgets; under
        ``mnemojax launch`` together with the other survivors, wherever each met the
        failure), written back into this step's NNX objects on the new mesh (`mesh`), and
        `fn` runs again with the same arguments. Any other error is raised as it is. A pure
        step's state is the caller's: there `fn` runs again with the recovered arrays in
        place of the caller's state's (passed whole or in parts), and until the step hands
        out a new state, the caller's old one stands for the recovered one in its calls.

        `fn` starts from the last step's state and may run more than once: it resets what
        it shares with the step (metrics) itself, makes the NNX objects the step does not
        carry (an eval's own metrics) itself, and places its batches on `mesh` at each call
        with `place` (across processes ``jax.device_put`` of host data is a collective,
        which a peer's death blocks; a guard inside guarded work runs plainly). Its results are
        waited for without a hang timeout (an eval may take many step-times); a peer's
        death heard of ends the wait at once, so return arrays rather than reading them
        inside `fn`. Before this step's first commit, or after a `restore` and before the
        next step, it runs unguarded.

        Raises:
            UnsupportedStateError: the state the step carries changed since its last call,
                outside it (a recovery would lose that change), naming the leaves.
            GuardSkippedError: the work met a failure and the new world has processes that
                joined it (they start at the next step), or survivors that had passed the
                work (they met the failure in the next step): the state is recovered, the
                work is not run again.
            LeftJobExit: this process left the job.
        """

        checked: list[bool] = []  # its objects were looked at (`_warn_uncarried`, once)

        @functools.wraps(fn)
        def guarded(*args: P2.args, **kwargs: P2.kwargs) -> R2:
            return self._guarded(fn, args, kwargs, checked)

        return guarded

    def place(self, batch: Any) -> Any:
        """`batch` (host arrays: numpy, or `mnemojax.data.HostRows`) on the current mesh
        (`mesh`), as this step places its own: each array split along the data axis over
        its leading dimension, 0-d ones whole on every device. Across processes each
        process puts only the rows its devices hold, with no collective: use it in guarded
        work, where ``jax.device_put`` of host data would check the value across the
        processes (a collective, which a peer's death blocks until gloo gives up, ~30 s).

        Raises:
            BatchSplitError: an array's leading dimension does not split evenly over the
                data axis (naming it).
            InvalidOptionError: the step has no mesh yet (give ``mesh=``), or the mesh
                lacks the data axis.
        """
        mesh = self.mesh
        if mesh is None:
            raise InvalidOptionError("place() needs the step's mesh: give "
                                     "mnemojax.resilient(mesh=...), or call the step first")
        axes = self.options.batch_axes_of(mesh.axis_names)
        width = math.prod(mesh.shape[a] for a in axes)
        put = self._built.runtime.layer.put if self._built is not None else put_host
        host = host_batch(batch)

        def place(path, x, split):
            spec = shd.batch_spec(mesh, axes, len(x.shape) if split else 0)
            if spec and x.shape[0] % width:
                raise BatchSplitError(
                    f"{jax.tree_util.keystr(path) or 'the array'} has {x.shape[0]} rows, "
                    f"which the data axis {axes} of width {width} cannot split evenly")
            return put(x, NamedSharding(mesh, spec))

        return jax.tree_util.tree_map_with_path(place, host, batch_splits(host))

    def _guarded(self, fn: Callable[..., R2], args: tuple, kwargs: dict[str, Any],
                 checked: list[bool]) -> R2:
        b = self._built
        if self._joined_behind is not None and not self._guarding:
            self._skip_what_survivors_passed()
        if (joiners := self._joiners_after) is not None and not self._guarding:
            if joiners[0] == self._step:  # processes joined before the next step
                self._check_no_joiners(joiners[1], self._step)
            self._joiners_after = None
        if (b is None or b.last_written is None  # no committed state on the devices yet
                or not len(self._batches)  # (restored: no batch to compile a new mesh for)
                or self._guarding):  # inside guarded work: the outer guard recovers
            # (Orbax's barriers wait as in guarded work: a spare's call before its first
            # step meets the survivors' guarded one)
            with persistent.syncs_through_the_store() if b is not None \
                    and b.session is not None else contextlib.nullcontext():
                return fn(*args, **kwargs)
        if (left := b.session.left if b.session is not None else None) is not None:
            raise LeftJobExit(left.message, step=left.step, generation=left.generation)
        if isinstance(b.form, NnxForm):  # the objects in the arguments hold the state
            # (variables replaced since the step are carried, then refused as any change
            # made between the step and its guarded work: `_check_untouched`)
            self._follow_in_place_change(b, b.form)
            if not checked:
                checked.append(True)
                self._warn_uncarried(fn, (args, kwargs), b.form)
            work = functools.partial(self._on_carried_state, b.form, fn, args, kwargs)
        else:
            work = functools.partial(self._on_recovered_state, fn, args, kwargs)
        after, calls = self._guard_seq
        self._guard_seq = (self._step, calls + 1 if after == self._step else 1)
        self._guarding, self._guard_checked = True, False
        try:
            return self._run(self._step + 1, b.last_written, None, beside=work)[1]
        finally:
            self._guarding = self._guard_checked = False

    def _adopt_new_objects(self, b: _Built, args: tuple, kwargs: dict[str, Any]
                           ) -> tuple[tuple[Any, ...], CallInputs] | None:
        """A call that passes other NNX objects of the same structure than the step
        carries (a model loaded from a checkpoint, or resharded between steps: ``nnx.jit``
        takes any) makes the step carry them from now on, their values the state (as a
        change made between steps: in one process snapshotted before the step). Returns
        the call split (`StepForm.split_call`), or None when the call's objects are not
        such (it is refused as before); on any error the step carries the objects before.

        Raises:
            UnsupportedStateError: another live step carries one of the new objects, or
                the objects `restore()` filled have not run a step yet.
        """
        form = b.form
        if not isinstance(form, NnxForm) or (new := form.replacements(args, kwargs)) is None:
            return None
        replaced = [name for name, a, o in zip(form.object_names, new, form.objects,
                                               strict=True) if a is not o]
        if b.restored_unrun:
            raise UnsupportedStateError(
                f"restore() filled the objects it was given; this call passes others in "
                f"place of {', '.join(replaced)}: pass the restored objects to the step")
        old = form.objects
        try:
            form.adopt(new)
            ownership.check_unclaimed(self, form)
            split = form.split_call(args, kwargs)
        except BaseException:
            form.adopt(old)
            raise
        self._carry_from_now_on(b, form, "the call passes other objects of the same "
                                "structure in place of " + ", ".join(replaced))
        return split

    def _carry_from_now_on(self, b: _Built, form: NnxForm, what: str) -> None:
        """The step carries what `form` is bound to now (other objects, or variables that
        replaced those before): ownership moves to them, and the log says `what`
        happened (across processes a warning: the agents' copies lack their values until
        this step has run)."""
        ownership.release(self, session=False)
        ownership.claim(self, form)
        if b.session is not None:
            log.warning(
                "mnemojax: step %d: %s: the step carries them from now on; across processes "
                "their values are not in the agents' copies until this step has run, so a "
                "process lost in it restores the step before's state (README: known "
                "limits)", self._step + 1, what)
        else:
            log.info("mnemojax: step %d: %s: the step carries them from now on",
                     self._step + 1, what)

    def _follow_in_place_change(self, b: _Built, form: NnxForm) -> None:
        """The carried objects' graph changed between steps (model surgery: a submodule or
        Variable replaced by a new one of the same structure, as ``nnx.jit`` takes): the
        step carries the Variables they hold now, their values the state (a change made
        between steps: in one process snapshotted before the step). Was silently ignored:
        the step kept training the Variables it was built with (a user trial).

        Raises:
            UnsupportedStateError: the structure changed (`NnxForm.changed_in_place`),
                another live step carries a new Variable, or `restore()` filled the objects
                and no step has run since; the step carries what it did before.
        """
        if (replaced := form.changed_in_place()) is None:
            return
        if b.restored_unrun:
            raise UnsupportedStateError(
                "restore() filled the objects' variables; since then the objects hold others "
                f"({listed(replaced)}): make the change before restore(), or after the "
                "first step")
        undo = form.rebind(replaced)
        try:
            ownership.check_unclaimed(self, form)
        except BaseException:
            undo()
            raise
        self._carry_from_now_on(b, form, "the objects hold other variables than at the "
                                f"last step ({listed(replaced)}: replaced between steps)")

    def _say_undone_change(self, restored_step: int, paths: list[str]) -> None:
        """Across processes the agents' copies are those the steps published: a change to
        the objects' state made since the last step, outside it (a metrics reset between
        steps: the leaves at `paths`, `NnxForm.replaced_since_written`), is not in them,
        and the recovery that restored `restored_step` undid it. Said, naming the leaves (a
        user trial's loss metric silently covered 8 steps instead of 4 after a kill)."""
        if not paths:
            return
        log.warning(
            "mnemojax: the recovery restored the state of step %d from the agents' copies; "
            "since step %d, %s changed outside the step (a metrics reset, a hyperparameter "
            "set between steps?): "
            "across processes a change made between steps is not in the copies, and this "
            "recovery has most likely undone it. Make such a change inside the step "
            "(README: known limits)", restored_step, self._step, listed(paths))

    def _snapshot_outside_change(self, b: _Built, leaves: list) -> None:
        """One process: the state changed since the last step, outside it (the NNX
        objects' metrics reset between steps; in the pure form, a state the caller changed
        or another step returned). A recovery in this step that restores the host snapshot
        (a shard with no live replica, a donated state) would restore the last step's
        state without that change and replay this step's batches from there: the snapshot
        is taken again, now, of the state given (a user trial: two pure steps of a GAN
        with donation each rolled back over the other's updates, silently). (Across
        processes the agents' copies are the last step's; a change there stays
        uncovered, see the README.)"""
        form = b.form
        if b.session is not None or b.last_written is None or not b.snapshot_every:
            return
        if isinstance(form, NnxForm):
            changed = self._changed_leaves(b, form, leaves)
            if not changed:
                return
            form.mark_written()  # (the step's state now: snapshotted below)
            same = set(range(len(leaves))) - set(changed)
        elif not _replaced(leaves, b.last_written):
            return
        else:
            same = {i for i, (x, y) in enumerate(zip(leaves, b.last_written, strict=True))
                    if x is y}
            if not self._said_pure_change:
                self._said_pure_change = True
                log.warning("mnemojax: step %d: the state given is not what the step "
                            "returned (the caller changed it, or another step returned "
                            "it): it is copied to host memory before the step, so that a "
                            "recovery keeps the change, at each such call (said once)",
                            self._step + 1)
        b.last_written = leaves
        rt = b.runtime
        self._wait_snapshot(rt, self._step)
        # The shared leaves not changed keep their copy (review 32: a change to one leaf
        # copied every shared leaf again, and gave up the older snapshot under a tight
        # budget).
        rt.store.submit(self._step, leaves, kept=self._kept(b) & same)
        rt.store.wait_idle()  # (the step may donate these buffers, or lose a device)

    def _on_carried_state(self, form: NnxForm, fn: Callable[..., R2], args: tuple,
                          kwargs: dict[str, Any]) -> R2:
        """The NNX form's guarded work: `_check_untouched`, then `fn` (both inside the
        work's failure handling: the comparison is a collective across processes)."""
        self._check_untouched(self._require_built(), form)
        self._guard_checked = True
        return fn(*args, **kwargs)

    def _check_untouched(self, b: _Built, form: NnxForm) -> None:
        """After a recovery guarded work runs again on the state of the last step: the
        objects must hold it still. A change made since, outside the step (a shared
        metrics object reset before the guarded eval), would be lost: refused. Equal
        values (a jitted call on the model writes back copies) become the reference.

        Raises:
            UnsupportedStateError: naming the state leaves that changed.
        """
        changed = [form.leaf_paths[i] for i in self._changed_leaves(b, form)]
        if not changed:
            return
        raise UnsupportedStateError(
            f"the state this step carries changed since step {self._step}, outside the "
            f"step ({listed(changed)}; before this call, or in guarded work "
            f"before it): guarded work runs again on step {self._step}'s state after a "
            "recovery, which would lose that change. Make the change inside the guarded "
            "function (guard the whole eval: reset, loop and compute), after it, or in the "
            "step")

    def _changed_leaves(self, b: _Built, form: NnxForm, leaves: list | None = None
                        ) -> list[int]:
        """The state leaves whose values the objects hold (`leaves`: them, placed) differ
        from the last step's, compared on device (`_leaves_equal`) only when the objects
        no longer hold what the step wrote (`NnxForm.untouched`). Equal values become the
        reference, so each replacement is compared once."""
        if form.untouched():
            return []
        if leaves is None:
            leaves = self._place_state(b, form.state_of(form.objects))
        same = np.asarray(_leaves_equal(leaves, b.last_written))
        if same.all():  # (a jitted call on the model writes back equal copies)
            b.last_written = leaves
            form.mark_written()
        return np.flatnonzero(~same).tolist()

    def _warn_uncarried(self, fn: Callable, call: Any, form: NnxForm) -> None:
        """Warns of the NNX objects a guarded function is given, or reaches through its
        closure, whose variables the step does not carry: after a recovery they keep the
        arrays of the mesh before, on which the work fails when it runs again."""
        if names := form.uncarried_objects(call, fn):
            log.warning("mnemojax: guarded %s uses %s (given to it, or reachable through "
                        "its closure, perhaps only in a branch it does not take), whose "
                        "arrays this step does not carry: after a recovery they stay on the "
                        "mesh before, and the work fails when it uses them again; create "
                        "them inside the guarded function",
                        getattr(fn, "__name__", fn), ", ".join(sorted(set(names))))

    def _on_recovered_state(self, fn: Callable[..., R2], args: tuple,
                            kwargs: dict[str, Any]) -> R2:
        """The pure form's guarded work: after a recovery in guarded work, the leaves of
        the caller's state (and of its parts) in the arguments are the recovered ones."""
        b = self._require_built()
        old = b.superseded
        if old is None:
            return fn(*args, **kwargs)
        new = dict(zip(map(id, old), jax.tree.leaves(b.form.last_state), strict=True))
        current = functools.partial(_substitute, new)
        return fn(*jax.tree.map(current, args), **jax.tree.map(current, kwargs))

    def _run_step(self, exe: Executable, leaves: list, batch: Any, step: int,
                  barrier: dist_session.DistributedSession | None) -> tuple[Any, float]:
        """Runs `step` on `leaves` and waits for it (`_run`); first, with ``barrier``, at
        that session's compile barrier. Returns its outputs and when it was launched."""
        b = self._require_built()
        if barrier is not None:
            barrier.compiled(timeout_s=compiled_barrier_s(b.builder))
        device_batch = b.runtime.proxy.place_batch(batch, exe.batch_shardings, b.examples)
        t_run = time.perf_counter()
        return b.runtime.proxy.run(exe.compiled, leaves, device_batch, step,
                                   timeout_s=self._hang_timeout_s()), t_run

    def _run_beside(self, work: Callable[[], Any], after_step: int, *,
                    recovered: RecoveryRecord | None = None) -> tuple[Any, float]:
        """Runs guarded work after step `after_step` and waits for the arrays of its
        result (`guard`), unbounded (an eval may take many step-times) but ended by a
        peer's death; a death already heard of fails it before it starts (a collective
        started in that world could read a dead peer's leftovers, `known_death`).
        ``recovered``: it runs again after that recovery, if no survivor is past it
        (`_check_peers_at_the_work`). Returns its result and when it started."""
        b = self._require_built()
        if recovered is not None:
            self._check_peers_at_the_work(recovered, after_step)
        if (error := peer_watch.known_death()) is not None:
            raise error
        t_run = time.perf_counter()
        # (Orbax's barriers in a save there wait in the store: a death ends them at once)
        with persistent.syncs_through_the_store() if b.session is not None \
                else contextlib.nullcontext():
            out = work()
        arrays = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
        try:
            if arrays:
                b.runtime.proxy.await_beside(arrays, after_step=after_step)
        except jax.errors.JaxRuntimeError as exc:
            # The news of a death that came after the work was done everywhere (its
            # results are ready): the peers that saw it done go on to the next step.
            if not (getattr(exc, "mnemojax_peer_watch", False)
                    and all(is_ready(x) for x in arrays)):
                raise
            jax.block_until_ready(arrays)  # (ready: raises at once if one failed)
        return out, t_run

    def _check_no_joiners(self, record: RecoveryRecord, after_step: int) -> None:
        """Guarded work runs again only if every process of the new world is at it: the
        processes that joined it (spares, a world grown back) start at the next step.

        Raises:
            GuardSkippedError: the new world has joiners (the state is recovered).
        """
        if record.joined_processes:
            log.warning("mnemojax: workers %s joined world %d at step %d: the guarded work "
                        "after step %d does not run again (GuardSkippedError), nor any "
                        "after it before step %d", list(record.joined_processes),
                        record.generation, after_step + 1, after_step, after_step + 1)
            self._joiners_after = (after_step, record)  # (the calls after it: skipped too)
            raise GuardSkippedError(
                f"guarded work after step {after_step} met a failure; the state is "
                f"recovered, but workers {list(record.joined_processes)} joined world "
                f"{record.generation} and start at step {after_step + 1}: the work does not "
                "run again (its collectives would meet theirs); catch "
                "mnemojax.errors.GuardSkippedError to skip it", after_step=after_step,
                joined=record.joined_processes)

    def _skip_what_survivors_passed(self) -> None:
        """In a process that joined a running job: the survivors run no guarded work after
        the step they were at, before their next one (guarded work with joiners,
        `_check_no_joiners`), and where the agreed state is older than that step (a dead
        worker's copy of it was incomplete) they replayed the steps in between inside the
        call that met the failure, without the guarded work the user's code calls between
        them (which they had run before the failure). This process runs that code from
        the agreed step on: its guarded calls up to the survivors' step do not run (those
        before its first step too).

        Raises:
            GuardSkippedError: this call comes at or before the survivors' step.
        """
        behind = self._joined_behind
        assert behind is not None
        if self._step > behind:
            self._joined_behind = None  # caught up
            return
        log.warning("mnemojax: this process joined at step %d; its guarded work after step "
                    "%d does not run: the survivors run none there (GuardSkippedError)",
                    self._joined_at, self._step)
        raise GuardSkippedError(
            f"this process joined the job at step {self._joined_at}; the survivors run no "
            f"guarded work after step {self._step} (they ran it before the failure, or "
            "skip it with this process in the world): it does not run here (its "
            "collectives would meet their next step's); catch "
            "mnemojax.errors.GuardSkippedError to skip it", after_step=self._step, joined=())

    @staticmethod
    def _survivors_position(generation: int, posters: int) -> int | None:
        """For a process that joined world `generation` (read at `restore`): the last step
        after which the survivors run no guarded work (`_position`), from what the
        ``posters`` processes of the world posted as it formed (`ProcessRecovery.recover`,
        before its compile barrier: no wait on this process); None where no survivor is
        (every process fresh) or none is known (logged: its guarded work then runs as
        called)."""
        if posters <= 0:
            return None
        positions = coordination.posted_values(
            f"{POSITIONS}/{generation}", posters, timeout_s=60.0,
            stop=lambda: peer_watch.known_death() is not None)
        if positions is None:
            why = ("a death was heard of first" if peer_watch.known_death() is not None
                   else "they did not say within 60 s")
            log.warning("mnemojax: this process joined world %d, but where its survivors go "
                        "on is not known (%s): its guarded work runs as called",
                        generation, why)
            return None
        return max((step for where in positions.values()
                    if (step := _position(where.rpartition("@")[0])) is not None),
                   default=None)

    def _check_peers_at_the_work(self, record: RecoveryRecord, after_step: int) -> None:
        """Guarded work runs again only if no survivor is past it: one that met the failure
        in the next step (it had passed the work, whose collectives then, if any, were
        none: an Orbax save of a step it does not keep) replays that step, and the work
        run again here alone would wait in its collectives for it (the README's own
        checkpoints: a new world's `CheckpointManager` starts with a collective; a user
        trial's job ran out of recoveries). Each survivor says where it goes on in the
        new world's store (`_recover_world`).

        Raises:
            GuardSkippedError: a survivor is past the work, or did not say (in 60 s).
            jax.errors.JaxRuntimeError: a peer's death heard of meanwhile (the recovery
                runs again; so it does when the store fails).
        """
        if record.plan_kind not in _WORLD_RECOVERIES:  # (one process: nobody else)
            return
        positions = coordination.posted_values(
            f"{POSITIONS}/{record.generation}", jax.process_count(), timeout_s=60.0,
            stop=lambda: peer_watch.known_death() is not None)
        if positions is None and (death := peer_watch.known_death()) is not None:
            raise death
        mine = self._guard_seq[1]
        ahead = None if positions is None else sorted(
            int(where.rpartition("@")[2]) for where in positions.values()
            if _past(where.rpartition("@")[0], after_step, mine))
        if ahead == []:
            return
        why = ("they did not say where they go on" if ahead is None else
               f"workers {ahead} met it past the work (in step {after_step + 1}, or in "
               "guarded work after it)")
        log.warning("mnemojax: world %d: the guarded work after step %d does not run again "
                    "(GuardSkippedError): %s", record.generation, after_step, why)
        raise GuardSkippedError(
            f"guarded work after step {after_step} met a failure; the state is recovered, "
            f"but {why}: the work does not run again (its collectives would meet theirs); "
            "catch mnemojax.errors.GuardSkippedError to skip it", after_step=after_step,
            joined=())

    def _write_back(self, leaves: list) -> None:
        """After a recovery in guarded work (or one whose step then raised, so that the
        caller keeps the recovered state): the state goes back into the step's objects,
        and the new mesh's step is the current one (as after a step's own recovery: no
        compile barrier at the next call, which peers that recovered in their step do not
        reach)."""
        b = self._require_built()
        if not isinstance(b.form, NnxForm) and b.superseded is None:
            b.superseded = jax.tree.leaves(b.form.last_state)  # what the caller holds
        b.form.write_back(leaves)
        b.last_written = leaves
        b.precompile_due = True
        self._executable_now()

    def restore(self, *args: Any, **kwargs: Any) -> Any:
        """Restores the newest persistent checkpoint (e.g. after a preemption) and sets
        the step counter to its step. In a process that ``mnemojax launch`` restarted into
        a running job (its previous process died with its world's coordination service),
        restores the step the job agreed on from the agents' in-memory copies instead.

        Call it before the first step with the step's state, as the step takes it: the
        NNX objects it carries, positionally as a prefix of the step's arguments or by
        parameter name (``step.restore(model, optimizer, rngs=rngs, metrics=metrics) ->
        int``: updates them in place, returns the step restored, 0 if there is no
        checkpoint), or a whole call's arguments; pure: ``state, k = step.restore(state)``.
        Restores onto the current mesh, whatever mesh saved it.

        Raises:
            CheckpointMismatchError: the checkpoint belongs to another model.
            CheckpointCorruptError: there are checkpoints and none can be read (an
                unreadable newest one falls back to the one before it).
            LeftJobExit: a process that joined a running job could not fetch the agreed
                state (no holder of a copy answered with a good one: they died since it
                joined, or their copies fail their checks): it left the job, which goes on
                without it (status 0 unless caught).
        """
        b = self._built if self._built is not None else self._build(args, kwargs,
                                                                    restoring=True)
        if self._step:
            raise UnsupportedStateError(
                f"restore() must come before the first step; {self._step} steps have run")
        state_args = b.form.split_restore(args, kwargs)
        leaves = b.form.state_of(state_args)
        shardings = shd.named(b.runtime.mesh, b.form.specs)
        joined = b.session.resume if b.session is not None else None
        b.durability.continues_the_directory()  # (whatever restores: the job's own steps)
        restored = b.session.take_resume(shardings, put=b.runtime.layer.put) \
            if b.session is not None else None
        if restored is None:
            restored = b.durability.restore_latest(shardings, b.builder.leaf_structs)
        if joined is not None and b.session is not None:
            b.session.resume = None  # taken (from memory or from the checkpoint)
            a = joined.agreement
            self._statistics.joined = JoinRecord(
                how="spare" if dist_session.started_as_spare() else "restart",
                generation=a.generation, resume_step=a.resume_step,
                previous_members=tuple(a.previous_members), members=tuple(a.survivors))
            if restored is None:
                raise StateUnavailableError(
                    "this process joined a running job, but no copy of the job's state "
                    f"survives in memory ({joined.agreement.why}) and there is no checkpoint")
            # (its guarded calls up to where the survivors were: `_skip_what_survivors_passed`;
            # every process of the new world posts, a fresh one too, which passed nothing)
            coordination.post_value(f"{POSITIONS}/{a.generation}",
                                    f"fresh:{restored[0]}@{_worker_id(b.session)}")
            self._joined_behind = self._survivors_position(a.generation, a.num_processes)
            self._joined_at = restored[0] + 1
        if restored is not None:
            self._step, leaves = restored
            self._statistics.steps_run = self._step
            b.last_written = b.superseded = None
            # A restored run's first step is not step 1: the candidate worlds compile after
            # it. A process that joined a running job needs this too: it may be the new
            # world's process 0, which exports the candidates for the others
            # (`_schedule_precompile`).
            b.precompile_due = True
        b.restored_unrun = True
        return b.form.restored(state_args, leaves, self._step)

    # -- building -------------------------------------------------------------------------
    def _build(self, args: tuple, kwargs: dict[str, Any], *, restoring: bool = False
               ) -> _Built:
        form = form_for(self._fn, args, kwargs, self._convention, restoring=restoring)
        ownership.check_unclaimed(self, form)  # before anything is built that needs closing
        if form.donates_state and not self.options.compile.donate_state:
            try:  # donate_argnames naming state: the runtime donates all of the state
                self.options = dataclasses.replace(self.options, compile=dataclasses.replace(
                    self.options.compile, donate_state=True))
            except InvalidOptionError as exc:
                raise InvalidOptionError(
                    f"donate_argnums/donate_argnames donate the step's state: {exc}") from None
        opts = self.options
        session = dist_session.current()
        if session is not None:
            ownership.claim_session(self)  # (one live step per process: before building)
            # The agent holds the snapshots, outside this process: in-process snapshots
            # would only get in the way. (Background compiles stay: they prepare the
            # worlds a process loss forms, `_schedule_precompile`.)
            opts = self.options = dataclasses.replace(
                opts, snapshot=dataclasses.replace(opts.snapshot, every_steps=0,
                                                   unreplicated_every_steps=0))
        all_devices = {d.id for d in jax.devices()}
        spares = [int(getattr(d, "id", d)) for d in self._spares_arg]
        bad = [s for s in spares if s not in all_devices]
        if bad:
            raise InvalidOptionError(f"spare_devices={bad!r}: no such device ids")
        mesh = self._mesh_arg
        if mesh is None:
            devices = [d for d in jax.devices() if d.id not in spares]
            name = "data" if opts.data_axis == AUTO else (opts.batch_axes or ("data",))[0]
            mesh = jax.make_mesh((len(devices),), (name,), devices=devices,
                                 axis_types=(jax.sharding.AxisType.Auto,))
        axes = opts.batch_axes_of(mesh.axis_names)  # "auto" resolved on this mesh
        if opts.data_axis == AUTO:
            opts = self.options = dataclasses.replace(
                opts, data_axis=axes[0] if len(axes) == 1 else axes)
            if len(axes) > 1:  # a program that splits its batch otherwise adds in another order
                log.info("mnemojax: the batch is split over the mesh axes %s (data_axis="
                         "'auto'); pass data_axis=... to split it as your program does",
                         list(axes))
        ids = shd.device_ids(mesh)
        overlap = sorted(set(spares) & {int(i) for i in ids.flat})
        if overlap:
            raise InvalidOptionError(f"spare_devices={overlap!r} are already in the mesh")
        values = form.state_of(form.split_restore(args, kwargs))
        shapes = [tuple(np.shape(v)) for v in values]
        shd.validate_specs(form.specs, shapes, form.leaf_paths, dict(mesh.shape))
        enable_persistent_cache(opts.compile.cache_dir)
        number = next(_build_numbers)  # the same in every process of a job
        durability = Durability(
            opts, keys=form.leaf_keys,
            agree_stop=functools.partial(session.agree_stop, f"step{number}")
            if session is not None else None)
        builder = RuntimeBuilder(
            opts, pure=form.pure, traced_as=form.fn, specs=form.specs,
            leaf_structs=[(s, np.asarray(v).dtype if not hasattr(v, "dtype") else v.dtype)
                          for s, v in zip(shapes, values, strict=True)],
            leaf_entries=form.leaf_entries, leaf_names=form.leaf_paths,
            wrap_layer=self._injector.wrap if self._injector is not None else None,
            axis_types=shd.axis_types_of(mesh),
            export_steps=session is not None and opts.compile.export_ahead,
            publishes=session is not None and session.agent is not None,
            on_corrupt=lambda s: durability.emit("fault", step=s,
                                                 classification="corrupt_snapshot"))
        runtime = builder.build(MeshPlan(ids, tuple(mesh.axis_names), "unchanged"), mesh=mesh,
                                spares=spares)
        if opts.compile.precompile and opts.compile.max_precompiled and (
                session is None or compiles_ahead_here(opts.compile.ahead_compilers,
                                                       one_host=dist_env.one_host())):
            # Its start-up (importing JAX, ~2 s) overlaps the first step's compile, not
            # the first compile ahead (a kill in step 12 found it unfinished: 2.6-4.2 s to
            # the next good step, 0.8 s with the compile on a thread).
            runtime.compiler.start_child()
        durability.layer = runtime.layer
        durability.emit("run_start", config={
            "mesh": dict(mesh.shape), "form": form.kind, "leaves": len(values),
            "spares": spares})
        ownership.claim(self, form)
        ownership.enter(self)
        process_recovery = ProcessRecovery(
            opts, builder, durability, self._statistics, self._batches, session,
            form.leaf_keys, origin=(runtime.plan, runtime.proxy.device_places())) \
            if session is not None else None
        self._built = _Built(
            form=form, builder=builder, runtime=runtime, durability=durability,
            meshes=[runtime.mesh],
            session=session, sharded_dims=shd.sharded_dims(form.specs, shapes), number=number,
            device_recovery=DeviceRecovery(
                opts, builder, durability, self._statistics, self._batches,
                others=ownership.weak_method(self, "_other_steps_plans", default=())),
            process_recovery=process_recovery)
        # No cycle through durability: an unreferenced step is freed at once, with its claim.
        durability.committed = ownership.weak_method(self, "_committed", default=(0, None))
        return self._built

    def _other_steps_plans(self) -> list[MeshPlan]:
        """The meshes the other live steps of this process run on (a recovery takes the
        device order of one over the same devices)."""
        return [other._built.runtime.plan for other in ownership.others(self)
                if isinstance(other, ResilientStep) and other._built is not None
                and other._built.session is None]

    def _committed(self) -> tuple[int, list | None]:
        """The last complete step and its state leaves (None when not on the devices)."""
        return self._step, self._built.last_written if self._built is not None else None

    # -- one step -------------------------------------------------------------------------
    def _run(self, step: int, leaves: list, batch: Any,
             barrier: dist_session.DistributedSession | None = None, *,
             beside: Callable[[], Any] | None = None, first: _RecoveredFirst | None = None
             ) -> tuple[list, Any, Any, list, Packed | None]:
        """Runs `step` on `leaves` (the state of step - 1) and returns (new leaves,
        metrics, finiteness flags, the state it finally ran on, the new leaves packed for
        the snapshot's copy or None, `snapshot.Packed`). ``barrier``: first wait
        at that session's compile barrier (after the first compile), in the same
        failure handling as the step: a peer that died before it passed is recovered.

        On a failure, a recovery returns a runtime and an older or equal state; the loop
        replays the steps since with their kept batches, then runs `step` again. Transient
        errors are retried in place. One `_StepBudget` bounds all of it, replays included.

        ``beside`` (`guard`): at `step`, run this instead of a training step, on the
        committed state of step - 1 (`leaves`, which the step's NNX objects hold); after
        a recovery (and the replays up to step - 1) that state is written back into the
        objects before it runs again. Returns (that state, its result, None, that state,
        None).

        ``first``: a recovery made before the step ran (`_placed`); the loop goes on from
        its state (replaying the steps since, if it is older) within its budget.
        """
        b = self._require_built()
        budget = _StepBudget(self.options.recovery, step, self._run_recoveries)
        state_step = step - 1
        pending: _Pending | None = None  # the recovery whose failed step has not run yet
        publish_replayed = False
        if first is not None:
            budget, resumed = first.budget, first.resumed
            leaves, state_step = resumed.leaves, resumed.state_step
            publish_replayed = resumed.publish_replayed
            pending = _Pending(resumed.record, first.t_fault)
        try:
            while True:
                run_step = state_step + 1
                at_work = beside is not None and run_step == step  # guarded work's turn
                if beside is not None and at_work:
                    if pending is not None:  # recovered: the objects get the new state
                        self._write_back(leaves)
                        self._check_no_joiners(pending.record, step - 1)
                    run = functools.partial(
                        self._run_beside, beside, step - 1,
                        recovered=pending.record if pending is not None else None)
                else:
                    run_batch = batch if run_step == step else self._batches.batch(run_step)
                    run = functools.partial(self._run_step, self._executable_now(run_batch),
                                            leaves, run_batch, run_step, barrier)
                    barrier = None  # (waited at once, failed or not)
                t_started = time.perf_counter()
                try:
                    out, t_run = run()
                except Exception as exc:
                    t_fault = time.perf_counter()
                    budget.start()
                    del run
                    resumed = self._recover_after(exc, t_fault, step, state_step, leaves,
                                                  pending, budget, guarded=at_work)
                    del exc  # hold nothing of the old world (see recover_world)
                    if resumed is not None:  # (None: retried in place)
                        leaves, state_step = resumed.leaves, resumed.state_step
                        publish_replayed = resumed.publish_replayed
                        resumed.record.waited_s = t_fault - t_started
                        pending = _Pending(resumed.record, t_fault)
                    continue
                if at_work:
                    t_end = time.perf_counter()
                    self._close_recovery(pending, t_end, failed_step_s=t_end - t_run, ran=True)
                    return leaves, out, None, leaves, None
                t_end = time.perf_counter()
                if run_step < step or pending is None:  # not a first run on a new mesh
                    self._step_times.append(t_end - t_run)
                if run_step < step:  # a step replayed after a recovery
                    if pending is not None:
                        pending.replay_s += t_end - t_run
                    leaves, state_step = out[0], run_step
                    if publish_replayed:
                        self._publish(run_step, leaves)
                        self._step = run_step
                    continue
                if pending is not None:
                    self._close_recovery(pending, t_end, failed_step_s=t_end - t_run, ran=True)
                    pending = None
                    b.precompile_due = True
                new_leaves, metrics, finite, packs = out
                members = b.exe.pack_members if b.exe is not None else ()  # (it ran)
                packed = Packed(packs, members) if members else None
                return new_leaves, metrics, finite, leaves, packed
        except BaseException:
            self._close_recovery(pending, time.perf_counter())  # recorded as it stands
            raise

    def _recover_after(self, exc: BaseException, t_fault: float, step: int, state_step: int,
                       leaves: list, pending: _Pending | None, budget: _StepBudget, *,
                       guarded: bool = False) -> Resumed | None:
        """`_run`'s answer to ``exc``, raised by the run after `state_step` (whose state is
        `leaves`) on its way to `step` (``guarded``: by guarded work after `state_step`):
        re-raises an error of the user's, retries a transient one in place (returns None),
        or records the recovery in progress (`pending`), recovers and continues on the new
        runtime (returns its `Resumed`)."""
        b = self._require_built()
        run_step = state_step + 1
        where = f"in guarded work after step {state_step}: " if guarded else ""
        if self._is_peer_failure(exc):
            reason = f"{where}{type(exc).__name__}: {exc}"
            regrow = bool(getattr(exc, "mnemojax_regrow", False))
            _drop_frames(exc)  # hold nothing of the old world (see recover_world)
            del exc
            self._close_recovery(pending, t_fault, failed_in_replay=run_step < step)
            resumed = self._recover_world(
                step, reason, t_fault, budget, charge=not regrow,
                live=None if regrow else (state_step, leaves))
        else:
            verdict = b.runtime.proxy.classify(exc)
            if verdict.kind == "user":
                raise exc
            if verdict.kind == "transient":
                self._retry_transient(run_step, exc, budget)
                return None
            self._close_recovery(pending, t_fault, failed_in_replay=run_step < step)
            resumed = self._recover_devices(step, state_step, leaves, verdict, exc, budget,
                                            where=where)
        resumed.record.guarded = guarded
        self._adopt(resumed)
        return resumed

    def _close_recovery(self, pending: _Pending | None, t_end: float, *,
                        failed_in_replay: bool = False, failed_step_s: float = 0.0,
                        ran: bool = False) -> None:
        """Records the recovery in progress, if any: when its failed step has run again
        (in `failed_step_s`; ``ran``), or when a failure or an error ends it early. Its
        replay phase is the replayed steps plus the failed step's run."""
        if pending is None or pending.closed:
            return
        pending.closed = True
        b = self._require_built()
        record = pending.record
        self._statistics.faults_during_recovery += int(failed_in_replay)
        record.phases_s["replay"] = pending.replay_s + failed_step_s
        if record.steps_lost:
            b.durability.emit("wasted_progress", step=record.step, steps=record.steps_lost,
                              duration_s=pending.replay_s)
        finish_recovery(record, t_fault=pending.t_fault, t_end=t_end,
                        statistics=self._statistics, durability=b.durability)
        if ran and record.plan_kind in ("process_loss", "grow_back"):  # (across processes)
            waited = (f"; before it, the step waited {record.waited_s:.1f} s for the failure "
                      "to surface" if record.waited_s >= 1.0 else "")
            log.warning("mnemojax: step %d ran in world %d: the recovery took %.2f s in all "
                        "(replay %.2f s%s)", record.step, record.generation, record.total_s,
                        record.phases_s["replay"], waited)

    def _retry_transient(self, run_step: int, exc: BaseException, budget: _StepBudget) -> None:
        b = self._require_built()
        rec = self.options.recovery
        retries = budget.charge_retry(exc)
        self._statistics.transient_retries += 1
        b.durability.emit("fault", step=run_step, classification="transient",
                          detail=str(exc)[:200], retry=retries)
        log.warning("mnemojax: step %d: transient error, retry %d: %s", run_step, retries, exc)
        rec.sleep(rec.retry_backoff(retries))

    def _recover_devices(self, step: int, state_step: int, leaves: list, verdict: Verdict,
                         exc: BaseException, budget: _StepBudget, *, where: str = "",
                         given: bool = False) -> Resumed:
        """`DeviceRecovery.recover` within the budgets; a device failure during the
        recovery itself starts it again, over every device lost so far. ``given``: no step
        ran on `leaves` (`DeviceRecovery.recover`)."""
        b = self._require_built()
        failed = set(verdict.failed)
        first = exc
        while True:
            last = DeviceFailureError(
                f"step {step}: devices {sorted(failed)} failed ({exc})",
                failed_devices=sorted(failed), step=step)
            last.__cause__ = exc
            budget.charge_recovery(last)
            log.warning("mnemojax: step %d: %sdevices %s failed; recovering", step, where,
                        sorted(failed))
            try:
                resumed = b.device_recovery.recover(
                    b.runtime, step=step, state_step=state_step, leaves=leaves,
                    failed=failed, detect_s=verdict.detect_s, rules=self._rules(),
                    given=given)
                resumed.record.hang = isinstance(first, StepHangError)
                return resumed
            except jax.errors.JaxRuntimeError as again:
                exc = again
                verdict = b.runtime.proxy.classify(exc)
                if verdict.kind != "device_failure":
                    raise
                failed |= set(verdict.failed)
                self._statistics.faults_during_recovery += 1
                log.warning("mnemojax: step %d: devices %s failed during the recovery; "
                            "starting it again", step, list(verdict.failed))

    def _recover_world(self, step: int, reason: str, t_fault: float,
                       budget: _StepBudget, *, charge: bool = True,
                       live: tuple[int, list] | None = None) -> Resumed:
        """A collective failed: forget the old world, then `ProcessRecovery.recover`;
        again whenever a peer dies while it runs (each time over the world that failed),
        within the budgets. ``charge=False``: the first round was announced as a regrow
        (the world re-forms larger) and is not charged to the budgets, unless the world it
        forms did not only grow (no grow-back, or a member died); later rounds are.
        ``live``: (its step, the state leaves) still on this process's devices: their
        replicas go to its agent first (`_hold_live`)."""
        b = self._require_built()
        assert b.process_recovery is not None
        uncharged = not charge
        # (read before the old world's arrays are dropped: `_say_undone_change`; not of
        # what guarded work wrote, which runs again: a user trial's eval, killed in its
        # collective, left 14 leaves not computed, all named as changed)
        replaced = b.form.replaced_since_written() if isinstance(b.form, NnxForm) \
            and not self._guard_checked else []
        self._guard_checked = False  # (a round after this one is the recovery's own)
        close_s = 0.0  # every round's close of its old runtime (the first waits longest)
        if b.session is not None:  # the publish in flight reads the arrays about to go
            b.session.settle(quiet=True)
        if live is not None:
            t_hold = time.perf_counter()
            self._hold_live(*live)
            close_s += time.perf_counter() - t_hold
            del live
        while True:
            if charge:
                budget.charge_recovery(DistributedError(f"step {step}: {reason}"))
            proxy = b.runtime.proxy
            old_plan, places, spares = proxy.plan, proxy.device_places(), list(proxy.spares)
            t_close = time.perf_counter()
            self._forget_world()  # waits for a background compile that is running
            close_s += time.perf_counter() - t_close
            # Where this process goes on (guarded work, or a step), told to each world it
            # forms: a process at the guarded work runs it again only if no peer is already
            # past it (`_check_peers_at_the_work`), and a spare that joins skips what the
            # survivors passed (`_skip_what_survivors_passed`).
            where = (f"guard:{step}:{self._guard_seq[1]}" if self._guarding
                     else f"step:{step}")
            try:
                resumed = b.process_recovery.recover(
                    old_plan, places, step=step, last_step=self._step, reason=reason,
                    t_fault=t_fault, rules=self._rules(), spares=spares, close_s=close_s,
                    position=f"{where}@{_worker_id(b.session)}", regrow=not charge)
                record = resumed.record
                if uncharged and (record.plan_kind != "grow_back" or record.failed_processes):
                    # Told of a regrow, but the world did not only grow (a joiner left, or
                    # a member died meanwhile): a failure after all. (The new runtime is
                    # the step's now, so closing the step closes it if the budget ends it.)
                    b.runtime = resumed.runtime
                    budget.charge_recovery(DistributedError(
                        f"step {step}: {reason}; the world re-formed as {record.plan_kind}"))
                self._say_undone_change(resumed.state_step, replaced)
                return resumed
            except jax.errors.JaxRuntimeError as again:
                if b.process_recovery.built is not None:  # the new world formed, then failed
                    b.runtime = b.process_recovery.built
                if not self._is_peer_failure(again):
                    raise
                reason = f"during the recovery: {type(again).__name__}: {again}"
            charge, uncharged = True, False
            self._statistics.faults_during_recovery += 1  # the exception is gone here
            log.warning("mnemojax: step %d: a peer failed during the recovery; recovering "
                        "the world again", step)

    def _hold_live(self, state_step: int, leaves: list) -> None:
        """Hands this worker's agent the replicas its devices hold of the state after
        ``state_step`` (`DistributedSession.hold`), unless switched off
        (``SnapshotOptions.hold_live_replicas``) or the arrays are gone (donated to the
        step that failed). Best effort: a failure here is logged, never raised."""
        b = self._require_built()
        if b.session is None or not self.options.snapshot.hold_live_replicas:
            return
        try:
            if any(leaf.is_deleted() for leaf in leaves):
                return
            held = b.session.hold(state_step, leaves,
                                  budget_bytes=self.options.snapshot.host_memory_budget_bytes)
        except Exception as exc:  # noqa: BLE001 - never in the way of the recovery
            log.warning("mnemojax: step %d: could not hand the agent this worker's "
                        "replicas: %s: %s", state_step, type(exc).__name__, exc)
            return
        if held:
            log.info("mnemojax: the agent holds %d bytes of this worker's replicas of step "
                     "%d", held, state_step)

    def _forget_world(self) -> None:
        """Drops every array and executable of the old world before it is torn down."""
        b = self._require_built()
        b.last_written = None
        b.exe = b.exe_sig = None
        b.runtime.close(leave_compiles=True)  # (not a second loss's world: `close`)
        b.form.forget_arrays(b.builder.leaf_structs)

    def _adopt(self, resumed: Resumed) -> None:
        """Continues on a recovery's runtime, from the state of ``resumed.state_step``."""
        b = self._require_built()
        self._say_mapped_axes_narrowed(b.runtime.mesh, resumed.runtime.mesh,
                                       resumed.record.step)
        shd.follow_ambient_mesh(b.meshes, resumed.runtime.mesh)
        b.meshes.append(resumed.runtime.mesh)
        b.runtime = resumed.runtime
        b.durability.layer = resumed.runtime.layer
        b.snapshot_every = None  # re-chosen for the new mesh at the next commit
        b.memory_room = None  # and the devices' memory headroom at its first plan
        b.examples = resumed.record.examples_per_step
        b.last_written = None
        if resumed.publish_replayed:  # the agents hold this step now; replays publish on
            self._step = resumed.state_step
        record = resumed.record
        if record.math_changed:
            self._statistics.math_changed = True
            warnings.warn(
                f"mnemojax: step {record.step}: batch_policy='truncate_batch' continues with "
                f"{record.examples_per_step} of {b.batch_size} examples per step; the run no "
                "longer computes what a failure-free run computes", MathChangedWarning,
                stacklevel=5)

    def _rules(self) -> ShapeRules:
        b = self._require_built()
        rec = self.options.recovery
        mapped = b.builder.facts.shard_map_axes or frozenset()
        names = b.runtime.mesh.axis_names
        batch_axes = self.options.batch_axes_of(names)
        fixed = () if rec.shrink_shard_map_axes else tuple(
            a for a in names if a in mapped and a not in batch_axes)
        return ShapeRules(data_axis=self.options.data_axis, sharded_dims=b.sharded_dims,
                          batch_size=b.batch_size, batch_policy=rec.batch_policy,
                          min_devices=rec.min_devices,
                          max_model_shrink=self._max_model_shrink(), fixed_axes=fixed,
                          refused_shapes=tuple(sorted(b.builder.facts.refused_shapes)))

    def _say_mapped_axes_narrowed(self, old: jax.sharding.Mesh, new: jax.sharding.Mesh,
                                  step: int) -> None:
        """With ``RecoveryOptions.shrink_shard_map_axes``, a recovery that narrows an axis
        a ``jax.shard_map`` in the step maps over says so: the user vouched that the body
        computes the same at any width, which nothing here checks (a user trial: a
        pipeline narrowed under the option applied some stages only, and nothing said)."""
        b = self._require_built()
        mapped = b.builder.facts.shard_map_axes or frozenset()
        if not self.options.recovery.shrink_shard_map_axes or not mapped:
            return
        batch_axes = self.options.batch_axes_of(old.axis_names)
        narrowed = [f"'{a}' {old.shape[a]} -> {new.shape.get(a, 1)}"
                    for a in old.axis_names if a in mapped and a not in batch_axes
                    and new.shape.get(a, 1) < old.shape[a]]
        if narrowed:
            log.warning("mnemojax: step %d: the recovery narrows mesh axes a jax.shard_map "
                        "in the step maps over (%s), as RecoveryOptions.shrink_shard_map_"
                        "axes allows: the run computes what a failure-free run computes "
                        "only if the map's body gives the same result at any width of "
                        "them", step, ", ".join(narrowed))

    def _max_model_shrink(self) -> float | None:
        """`RecoveryOptions.model_shrink_headroom`, and in one process also the least
        (memory limit / peak use) of the live mesh devices that report their memory,
        taken once per mesh at its first plan, so the plans compiled ahead and the
        recovery that uses them agree, and the fallbacks' warm-ups on this mesh do not
        move it. The peak is the process's since it started: after a recovery it also
        holds the old mesh's warm-ups and the recovery's own, a tighter bound than the
        state alone needs."""
        b = self._require_built()
        bound = self.options.recovery.model_shrink_headroom
        if b.session is not None or jax.process_count() > 1:
            return bound  # every process must plan alike: the option only
        if b.memory_room is None:
            rt = b.runtime
            b.memory_room = [fits for d in rt.mesh.devices.flat if d.id not in rt.proxy.dead
                             if (fits := rt.layer.memory_headroom(d)) is not None]
        return min([x for x in (bound, *b.memory_room) if x is not None], default=None)

    def _hang_timeout_s(self) -> float:
        rec = self.options.recovery
        if rec.hang_timeout_s is not None:
            return rec.hang_timeout_s
        if not self._step_times:
            return rec.hang_floor_s
        return max(rec.hang_floor_s, rec.hang_factor * statistics.median(self._step_times))

    def _is_peer_failure(self, exc: BaseException) -> bool:
        """Under a session, a runtime error is a peer failure unless it is a retryable
        status of this process (then it is retried in place: the peers wait for it in the
        collective, up to the collective timeout) or its own error (out of memory, an
        invalid argument: raised as it is, `looks_local`). So is a checkpoint given up at
        its barrier (`checkpoint_barrier`, raised in guarded work by an Orbax save's first
        barrier) while a death in this world is known."""
        session = self._require_built().session
        if session is None or not session.can_recover:
            return False
        if isinstance(exc, CheckpointLostError):
            return peer_watch.known_death() is not None
        return (isinstance(exc, jax.errors.JaxRuntimeError) and not looks_transient(exc)
                and not looks_local(exc))

    # -- around the step ------------------------------------------------------------------
    def _require_built(self) -> _Built:
        if self._built is None:
            raise RuntimeError("the resilient step is not built yet")  # internal misuse
        return self._built

    def _check_batch(self, b: _Built, batch: Any) -> None:
        self._check_host_rows(batch)
        sizes = {x.shape[axis] for x, split, axis in zip(
            jax.tree.leaves(batch), jax.tree.leaves(batch_splits(batch)),
            jax.tree.leaves(example_axes(batch)), strict=True) if split}
        if len(sizes) > 1:
            raise BatchSplitError(
                f"the batch leaves have different example sizes {sorted(sizes)}")
        size = sizes.pop() if sizes else None
        if b.batch_size is not None and size != b.batch_size:
            raise BatchSplitError(
                f"the global batch has {size} examples, the first one had {b.batch_size}: "
                "the global batch size is fixed by the first call (a recovery keeps the "
                "math of that size); pad or drop a short last batch")
        width = b.runtime.proxy.data_width()
        used = b.examples if b.batch_size is not None else size
        if size is not None and used is not None and used % width:
            default = (" (no mesh given: the default mesh puts the devices on one data "
                       "axis)" if self._mesh_arg is None else "")
            raise BatchSplitError(
                f"the global batch has {size} examples, which the batch axes "
                f"{self.options.batch_axes} of width {width}{default} cannot split evenly: "
                "give a batch that the width divides, a mesh whose batch axes divide it "
                "(mnemojax.resilient(mesh=...)), or, for an input every device should take "
                "whole (a key, a table, not examples), name it in replicated_argnames. The "
                "examples are along each input's leading axis unless example_axes names "
                "another (a stack of micro-batches (K, B, ...): example_axes={name: 1})")
        if b.batch_size is None:
            b.batch_size = b.examples = size

    def _compare_replicated_inputs(self, b: _Built, batch: Any) -> None:
        """Across processes: the replicated inputs of each new call layout (its first call)
        must be the same in every process, or the "replicated" devices would hold different
        values and the replicas of the state drift apart, silently. Compared by checksum
        through the coordination service (no collective, nothing to compile), in the
        job's first world only: every process started with it and calls in lockstep (a
        process that joined a later world never saw the layouts its peers compared); a
        peer's death heard of meanwhile, or no answer within `REPLICATED_COMPARE_S`, skips
        the comparison (logged).

        Raises:
            BatchSplitError: a replicated input differs between processes.
        """
        if (b.session is None or b.session.world.generation != 0
                or jax.process_count() == 1 or not isinstance(batch, CallInputs)):
            return
        layout = batch.layout
        if layout in b.compared_layouts:
            return
        b.compared_layouts.add(layout)
        b.comparisons += 1  # alike in every process: each compares the same calls
        mine = {name: (f"{np.dtype(x.dtype).str}{list(np.shape(x))}:"
                       f"{checksums.checksum(np.ascontiguousarray(x))}")
                for name, x, whole in zip(layout.names, batch.leaves, layout.replicated,
                                          strict=True) if whole}
        if not mine:
            return
        # The step about to run and the comparison's number: the same in every process of
        # world 0 (lockstep).
        prefix = f"mnemojax/replicated/{b.number}/{self._step + 1}/{b.comparisons}"
        found = coordination.gather_values(
            prefix, json.dumps(mine), jax.process_count(), timeout_s=REPLICATED_COMPARE_S,
            stop=lambda: peer_watch.known_death() is not None)
        if found is None:
            log.warning("mnemojax: the replicated inputs %s were not compared across "
                        "processes (a peer is gone or late)", sorted(mine))
            return
        for process, text in sorted(found.items()):
            theirs = json.loads(text)
            differ = sorted(n for n in mine if theirs.get(n) != mine[n])
            if differ:
                b.compared_layouts.discard(layout)  # a call with other values compares again
                raise BatchSplitError(
                    f"the replicated input {differ[0]} differs between process "
                    f"{jax.process_index()} and process {process}: every process must pass "
                    "the same value (a PRNG key from one seed, not one per process), or "
                    "the devices' copies of it, and then the replicas of the state, would "
                    "differ. Split a per-process value with the batch instead")

    def _check_host_rows(self, batch: Any) -> None:
        """Per-host batches (`mnemojax.data`) index their records by step: the batch must be
        this step's, or processes (a restarted one, a survivor replaying) read rows of
        different steps into one global batch."""
        steps = {x.step for x in jax.tree.leaves(batch) if isinstance(x, HostRows)}
        if not steps:
            return
        if self.options.nonfinite == "skip_batch":
            raise InvalidOptionError(
                "nonfinite='skip_batch' cannot be used with per-host batches "
                "(mnemojax.data): a skipped batch moves the loader but not the step, and "
                "the steps index the records; use 'raise' or 'ignore'")
        if steps != {self._step + 1}:
            raise BatchSplitError(
                f"the per-host batch is of step {sorted(steps)}, the step about to run is "
                f"{self._step + 1}: start the loader at the step restore() returned "
                "(HostBatches(..., start=step.restore(...)))")

    @staticmethod
    def _recovered_state_args(b: _Built, state_args: Sequence[Any]) -> Sequence[Any]:
        """The pure form after a recovery in guarded work: the state the caller held
        before it (every leaf the same object) stands for the recovered one (`guard`)."""
        given, old = jax.tree.leaves(state_args[0]), b.superseded
        if old is not None and len(given) == len(old) and all(
                x is y for x, y in zip(given, old, strict=True)):
            return (b.form.last_state,)
        return state_args

    def _placed(self, b: _Built, step: int, leaves: list) -> tuple[list, _RecoveredFirst | None]:
        """`_place_state`, and a recovery first when that meets devices lost since the
        step's last call: another step of this process met their loss and recovered, and
        returned this step's state on its new mesh (a trial's GAN ended with a raw
        ``JaxRuntimeError``), or they died between the calls. The step then recovers onto
        a mesh without them from the state given, read whole from its live copies: it is
        not the state the step last wrote (that one is never placed again), so no snapshot
        of the step's holds it (`DeviceRecovery.recover`, ``given``). So the recovered
        state is always of step - 1, or the call raises `StateUnavailableError`."""
        try:
            return self._place_state(b, leaves, recover_first=True), None
        except _LostBeforeStep as lost:
            t_fault = time.perf_counter()
            budget = _StepBudget(self.options.recovery, step, self._run_recoveries)
            budget.start()
            resumed = self._recover_devices(step, step - 1, leaves, lost.verdict, lost.error,
                                            budget, where="while its state was placed: ",
                                            given=True)
            self._adopt(resumed)
            return resumed.leaves, _RecoveredFirst(resumed, t_fault, budget)

    def _place_state(self, b: _Built, leaves: list, *, recover_first: bool = False) -> list:
        """``leaves`` on the step's mesh. ``recover_first`` (`_placed`): a put that fails on
        a device of the mesh lost since the last call raises `_LostBeforeStep`."""
        last = b.last_written
        if last is not None and len(leaves) == len(last) and all(
                x is y for x, y in zip(leaves, last, strict=True)):
            return leaves
        # The shardings the step is compiled with (`StepCompiler`), without compiling it:
        # under a session the initial state is placed and published before the first compile.
        mesh = b.runtime.mesh
        shardings = shd.named(mesh, b.form.specs)
        placed = []
        for i, (x, s) in enumerate(zip(leaves, shardings, strict=True)):
            if isinstance(x, jax.Array) and x.sharding == s:
                placed.append(x)
                continue
            try:
                placed.append(b.runtime.layer.put(x, s))
            except Exception as e:
                if recover_first and b.session is None:  # (across processes: a collective)
                    # Classified first: the state given may sit on another step's new mesh,
                    # a spare of this one included (a review: blamed on the caller).
                    verdict = b.runtime.proxy.classify(e)
                    if verdict.kind == "device_failure":  # lost since the last call
                        raise _LostBeforeStep(verdict, e) from e
                on_mesh = set(mesh.devices.flat)
                outside = sorted(d.id for d in getattr(x, "sharding", s).device_set
                                 if d not in on_mesh)
                if not outside:
                    raise
                # An array the caller put on devices the step lost (e.g. a checkpoint
                # restored with the shardings of the mesh before a recovery).
                raise UnsupportedStateError(
                    f"state {b.form.leaf_paths[i]} is given on devices {outside}, which "
                    f"are not in the step's mesh {dict(mesh.shape)} (left by a recovery?), "
                    f"and could not be moved onto it ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200]}): place what you put into the objects "
                    "on step.mesh (e.g. restore a checkpoint with shardings of step.mesh)"
                ) from e
        return placed

    def _executable_now(self, batch: Any = None) -> Executable:
        """The executable for the current mesh and this batch's shapes (cached per call
        signature: the steady-state path does no lookups)."""
        b = self._require_built()
        batch = batch if batch is not None else self._batches.last
        sig = (b.runtime.plan.key, b.examples, jax.tree.structure(batch),
               tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch)))
        if b.exe_sig != sig or b.exe is None:
            b.exe, _ = b.runtime.compiler.get(b.runtime.plan, batch_struct(batch, b.examples))
            b.exe_sig = sig
        return b.exe

    def _accept(self, step: int, metrics: Any, finite: Any) -> bool:
        """The non-finite policy: False means skip this batch (the state is unchanged)."""
        opts = self.options
        if opts.nonfinite == "ignore":
            return True
        if callable(opts.loss_key):
            try:
                loss = opts.loss_key(metrics)
            except Exception as exc:
                raise InvalidOptionError(
                    f"loss_key={opts.loss_key!r} raised {type(exc).__name__}: {exc} on the "
                    f"step's return value (a {type(metrics).__name__})") from exc
        else:
            loss = metrics.get(opts.loss_key) if isinstance(metrics, dict) else metrics
        scalar = isinstance(loss, int | float | np.number) or (
            loss is not None and hasattr(loss, "dtype") and np.size(loss) == 1)
        # A loss per example or per device (a pmap-style step's): checked whole, on the
        # host, where this process holds all of it (each process reaches the same verdict).
        dtype = getattr(loss, "dtype", None)
        local = getattr(loss, "is_fully_addressable", True)
        vector: Any = loss if (not scalar and dtype is not None and local
                               and jnp.issubdtype(dtype, jnp.inexact)) else None
        # A step that returns no value (or its state alone) has no loss to check: its new
        # state is checked, and nothing would make the warning go away.
        if not scalar and vector is None and not self._warned_no_loss and (
                metrics is not None or callable(opts.loss_key)):
            self._warned_no_loss = True
            if callable(opts.loss_key):
                found = f"loss_key={opts.loss_key!r} returned a {type(loss).__name__}"
            elif isinstance(metrics, dict) and opts.loss_key in metrics:
                what = f"an array of {dtype}" if dtype is not None else f"a {type(loss).__name__}"
                if not local:
                    what = "an array over other processes' devices (one value per device?)"
                found = f"the metrics' {opts.loss_key!r} is {what}, not a number or floats"
            elif isinstance(metrics, dict):
                found = (f"the metrics have no key {opts.loss_key!r} (keys: "
                         f"{sorted(map(str, metrics))})")
            else:
                found = (f"the step returned a {type(metrics).__name__}, not a scalar loss "
                         "or a dict of metrics")
            warnings.warn(f"mnemojax: {found}: the loss is not checked for NaN/Inf, only the "
                          "new state; set ResilienceOptions(loss_key=...) to the loss's key, "
                          "or nonfinite='ignore'", LossCheckWarning, stacklevel=3)
        value = float(np.asarray(loss)) if scalar else 0.0
        if vector is not None and not np.isfinite(flat := np.asarray(vector).ravel()).all():
            value = float(flat[~np.isfinite(flat)][0])
        if np.isfinite(value) and _all_true(finite):
            return True
        what = (f"{'loss' if callable(opts.loss_key) else opts.loss_key}={value}"
                if not np.isfinite(value)
                else "the new state (from the gradients) has NaN/Inf")
        if opts.nonfinite == "raise":
            raise NonFiniteLossError(
                f"step {step}: {what}; the state of step {step - 1} is kept "
                "(nonfinite='raise')", step=step, value=value)
        self._statistics.skipped_batches.append(step)
        self._require_built().durability.emit("fault", step=step, classification="nonfinite",
                                              detail=what)
        warnings.warn(f"mnemojax: step {step}: {what}; batch skipped, the state of step "
                      f"{step - 1} is kept (nonfinite='skip_batch')", NonFiniteSkipWarning,
                      stacklevel=3)
        return False

    def _commit(self, step: int, new_leaves: list, metrics: Any,
                packed: Packed | None = None) -> None:
        b = self._require_built()
        opts = self.options
        if b.session is not None:
            self._publish(step, new_leaves, packed)
        self._step = step
        b.last_written = new_leaves
        b.restored_unrun = False
        self._statistics.steps_run = step
        if b.snapshot_every is None:
            b.snapshot_every = self._snapshot_cadence(new_leaves)
        rt = b.runtime
        self._note_kept(b)
        if b.snapshot_every and step % b.snapshot_every == 0:
            self._wait_snapshot(rt, step)
            rt.store.submit(step, new_leaves, packed, kept=self._kept(b))
            if opts.compile.donate_state:
                rt.store.wait_idle()  # the next step donates these buffers
        grads_every = opts.snapshot.grads_every_steps
        if grads_every and isinstance(metrics, dict) and "grads" in metrics \
                and step % grads_every == 0:
            grads = jax.tree.leaves(metrics["grads"])
            if rt.grads_store is None:
                rt.grads_store = b.builder.snapshot_store(rt.layer, ["grads"] * len(grads),
                                                          name="grads")
            rt.grads_store.submit(step, grads)
        if step == 1:
            b.precompile_due = True

    def _after_commit(self, step: int, new_leaves: list) -> None:
        """Checkpoints and triggers. Under a session, a peer failure inside a checkpoint's
        collective loses only that checkpoint: the step is committed and published, and the
        next step's collective fails the same way and recovers the world."""
        b = self._require_built()
        try:
            b.durability.after_commit(step, new_leaves, b.runtime.mesh.devices.flat)
        except jax.errors.JaxRuntimeError as exc:
            if not self._is_peer_failure(exc):
                raise
            log.warning("mnemojax: step %d: the checkpoint failed, a peer process failed "
                        "(%s); the next step recovers", step, str(exc)[:200])
            b.durability.emit("fault", step=step, classification="checkpoint_failed",
                              detail=str(exc)[:200])

    def _publish(self, step: int, leaves: list, packed: Packed | None = None) -> None:
        """Multi-process: this worker's shards of the state after `step` to its agent (read
        from ``packed`` where the step packed them)."""
        b = self._require_built()
        session = b.session
        assert session is not None
        refused = session.publish_refused
        # The copy may run while the next step does (`SnapshotOptions.overlap_publish`),
        # unless that step donates these arrays.
        snapshot = self.options.snapshot
        session.publish(step, leaves, packed=packed,
                        budget_bytes=snapshot.host_memory_budget_bytes,
                        background=snapshot.overlap_publish
                        and not self.options.compile.donate_state,
                        in_series=snapshot.replicate_in_series)
        if session.publish_refused and not refused:
            b.durability.emit("fault", step=step, classification="snapshot_budget")

    def _share_forwarded(self, b: _Built, batch: Any) -> None:
        """One process, first call: the step is traced before the first snapshot, so that
        the leaves it returns as given (a frozen base) are known and copied once
        (`SnapshotStore.share`), and the budget counts them once (a user trial's LoRA
        fine-tune: 81 % of each snapshot was the frozen base, copied every time)."""
        rt = b.runtime
        rt.compiler.trace_first(rt.plan, batch_struct(batch, b.examples))
        shared = rt.compiler.shared_leaves()
        if rt.store.share(shared) and shared:
            nbytes = leaf_nbytes(b.builder.leaf_structs)
            log.info("mnemojax: the step returns %d of its %d state leaves as given (%d of "
                     "%d bytes, e.g. %s): their host snapshot is copied once, and again only "
                     "when they change (SnapshotOptions.share_unchanged_leaves)", len(shared),
                     len(nbytes), sum(nbytes[i] for i in shared), sum(nbytes),
                     b.form.leaf_paths[min(shared)])

    def _kept(self, b: _Built) -> frozenset[int]:
        """The shared leaves whose snapshot copy stays (`SnapshotStore.submit`): those that
        every step committed since the last snapshot returned as given (`_note_kept`: with
        a snapshot every N steps, another batch layout's executable in between may change
        them: review 31); all of them if no step was. None after a recovery that rolled
        the state back (steps lost, or the persistent tier: an older value); one that
        replayed what it restored gives every leaf the value it had (review 32: copying
        them again after every recovery gave up the snapshot it had just used, under a
        tight budget). A change made between steps is snapshotted before the step
        (`_snapshot_outside_change`), as a new value."""
        records = self._statistics.recoveries
        rolled_back = any(r.steps_lost or r.source == "persistent"
                          for r in records[self._records_at_snapshot:])
        kept = frozenset() if rolled_back else (
            self._kept_since if self._kept_since is not None
            else b.runtime.compiler.shared_leaves())
        self._records_at_snapshot = len(records)
        self._kept_since = None
        return kept

    def _note_kept(self, b: _Built) -> None:
        """A step committed: the shared leaves still unchanged since the last snapshot are
        those its executable returned as given too (`_kept`)."""
        kept = b.exe.kept if b.exe is not None else frozenset()
        self._kept_since = kept if self._kept_since is None else self._kept_since & kept

    def _snapshot_initial(self, b: _Built, leaves: list) -> None:
        """The snapshot of the state the first call starts from. Complete before it runs
        where a recovery may find no live copy of some shard: single-copy shards (a device
        lost in either of the first two steps then costs at most one step too, see
        `_wait_snapshot`), or a donated state (a step that fails after donating leaves no
        live copy at all). Taken in the background for a replicated state: the first
        snapshot at the cadence comes only at step ``every_steps``, and until then a loss
        of every replica of one shard (two devices, one after the other) had nothing to
        roll back to (a user trial's run ended with `StateUnavailableError`)."""
        b.snapshot_every = self._snapshot_cadence(leaves)
        if not b.snapshot_every:
            return
        b.runtime.store.submit(self._step, leaves)
        if self.options.compile.donate_state:
            b.runtime.store.wait_idle()  # the first step donates these buffers
        elif self._statistics.unreplicated_state:
            self._wait_snapshot(b.runtime, self._step + 1)

    def _wait_snapshot(self, rt: Runtime, step: int) -> None:
        """Backpressure: the snapshot in flight completes before `step`'s is queued (it
        copies while the step computes, so this rarely waits). A device lost during step
        k + 1 can take the copy of step k with it; the copy of step k - 1 is then complete,
        so at most one step is lost. Bounded by the hang timeout's floor: a copy from a
        hung device is the watchdog's business."""
        bound = self.options.recovery.hang_timeout_s or self.options.recovery.hang_floor_s
        if not rt.store.wait_idle(timeout_s=bound):
            log.warning("mnemojax: step %d: the previous snapshot's copy is still running "
                        "after %.0f s; not waiting for it", step, bound)

    def _snapshot_cadence(self, leaves: list) -> int:
        """Snapshots are the only second copy of single-copy shards: take them more often.
        (A donated replicated state keeps the rare cadence: a loss replays the steps since
        the last snapshot, cheaper than waiting for a host copy every step.)"""
        snap = self.options.snapshot
        self._statistics.unreplicated_state = has_single_copy_shards(leaves)
        every = snap.unreplicated_every_steps if self._statistics.unreplicated_state \
            else snap.every_steps
        self._statistics.snapshot_every_steps = every
        return every

    def _note_layout(self, b: _Built, batch: Any) -> None:
        """Keeps the newest `CompileOptions.ahead_layouts` batch layouts; a new one after
        the first step schedules the compiles ahead for it."""
        key = layout_key(batch)
        known = key in b.layouts
        b.layouts[key] = b.layouts.pop(key, None) or batch_struct(batch, None)
        while len(b.layouts) > self.options.compile.ahead_layouts:
            b.layouts.pop(next(iter(b.layouts)))
        if not known and self._step >= 1:
            b.precompile_due = True

    def _schedule_precompile(self) -> None:
        b = self._require_built()
        copts = self.options.compile
        if not copts.precompile or copts.max_precompiled == 0:
            return
        proxy = b.runtime.proxy
        rules = self._rules()
        export_only, sharing, leavable = False, None, set()
        if b.session is not None and b.builder.facts.host_callbacks:
            if not b.skipped_precompile:
                b.skipped_precompile = True
                log.info("mnemojax: the step calls back to the host, so JAX writes no "
                         "compilation cache entry for it and a new world cannot load one: "
                         "no candidate world is compiled ahead across processes (a "
                         "recovery compiles the step on its path)")
            return
        if b.session is not None:
            # The worlds one process's loss forms (and a second's: `ahead_losses`): compiled
            # over this world's devices of the ids they will have, by `ahead_compilers` of
            # the processes (the others keep the step's export); each writes its
            # persistent-cache entry under a key every process shares, and the new world's
            # compile loads it (`compiler`, `jax_private`). Process 0 (always a compiler)
            # traces and exports the step and the others take its export
            # (`coordination.SharedExports`).
            first, second = plans_ahead(
                proxy.plan.device_ids, proxy.plan.axis_names, proxy.device_places(), rules,
                losses=copts.ahead_losses)
            plans = [*first, *second]
            # A second loss's worlds: this world's end does not wait for their compile (a
            # single loss, the likely case, does not need them: `StepCompiler.close`).
            leavable = {plan.key for plan in second}
            export_only = not compiles_ahead_here(copts.ahead_compilers,
                                                  one_host=dist_env.one_host())
            if b.builder.exports is not None:
                sharing = ExportSharing(coordination.SharedExports(
                    f"mnemojax/exports/{b.number}/{b.session.world.generation}",
                    stop=lambda: peer_watch.known_death() is not None),
                    publish=jax.process_index() == 0)
        else:
            plans = single_failure_plans(proxy.plan.device_ids, proxy.plan.axis_names,
                                         spares=proxy.spares, **rules.as_kwargs())
        # The newest batch's layout first, then the others kept, newest first.
        batches = [self._batches.last, *reversed(list(b.layouts.values())[:-1])]
        for batch in batches:
            for plan in plans[:copts.max_precompiled]:
                b.runtime.compiler.precompile(
                    [plan], batch_struct(batch, plan.examples_per_step),
                    export_only=export_only, sharing=sharing, leavable=plan.key in leavable)


_build_numbers = itertools.count()


def _worker_id(session: dist_session.DistributedSession | None) -> int:
    """This process's worker id (its slot at launch, kept across worlds), for messages."""
    world = session.world if session is not None else None
    if world is None:
        return jax.process_index()
    return world.worker_id if world.worker_id is not None else world.process_id


def _position(where: str) -> int | None:
    """A post (`_recover_world`, `restore`) as the last step after which a joining spare
    runs no guarded work: a survivor in step s, or in guarded work after s - 1 (which,
    with joiners, skips every guarded call before step s: `_check_no_joiners`): s - 1. A
    fresh process (restored, it passed nothing): None."""
    kind, step, *_ = where.split(":")
    return None if kind == "fresh" else int(step) - 1


def _past(where: str, after_step: int, calls: int) -> bool:
    """Whether a survivor that goes on at ``where`` (`_recover_world`'s post) has passed
    the ``calls``-th guarded call after step ``after_step``: it is in a later step, or in
    a later guarded call after that step."""
    kind, step, *rest = where.split(":")
    if kind == "fresh":  # (restored: it passed nothing)
        return False
    if kind == "step":
        return int(step) > after_step
    return int(step) > after_step + 1 or (int(step) == after_step + 1
                                          and int(rest[0]) > calls)


# The plan kinds of `_recover_world`'s recoveries (`recovery.ProcessRecovery`).
_WORLD_RECOVERIES = ("process_loss", "grow_back")


def _say_inputs_of_ended_worlds(b: _Built, inputs: CallInputs) -> None:
    """Warns, once per input, of a step input that is an array of a world a recovery
    ended (made before it, on that world's devices: a PRNG key split each step outside
    the step). Computing on such an array waits behind that world's abandoned
    collectives, up to the collective timeout (a user trial's eager `jax.random.split`
    stalled 18 s right after a recovery), and it keeps that world's client alive. It is
    still a valid input: the step copies it."""
    live_clients: dict[str, Any] = {}  # platform -> its live client, asked once per call
    for name, x in zip(inputs.layout.names, inputs.leaves, strict=True):
        if not isinstance(x, jax.Array) or name in b.old_world_inputs:
            continue
        device = next(iter(x.devices()))
        if (live := live_clients.get(device.platform)) is None:
            live = live_clients[device.platform] = jax.devices(device.platform)[0].client
        if device.client is not live:
            b.old_world_inputs.add(name)
            log.warning(
                "mnemojax: the step input %s is an array of a world that ended at a "
                "recovery (made on that world's devices: a key made or split outside the "
                "step, say). The step copies it, but a computation on it outside the step "
                "waits for that world's abandoned collectives (up to the collective "
                "timeout), and it keeps that world's client alive. Make such inputs from "
                "host values (numpy; a key as its raw data, np.asarray(jax.random.key_data("
                "key)), with replicated_argnums) or inside the step (an nnx.Rngs in the "
                "model, a key folded with the step number)", name)


def _say_inputs_on_lost_devices(b: _Built, inputs: CallInputs) -> None:
    """Warns, once per input, of a step input that is an array on devices this step lost
    (placed on the mesh before a recovery by the user's own pipeline). A real loss leaves
    it unreadable: the call then fails in the user's code. Devices lost to a
    `mnemojax.testing.FaultInjector` still hold it, so a rehearsal ran on silently (a
    user trial's batch, put on the first 8-device mesh, fed the 4-device step)."""
    dead = b.runtime.proxy.dead
    for name, x in zip(inputs.layout.names, inputs.leaves, strict=True):
        if not isinstance(x, jax.Array) or name in b.lost_device_inputs:
            continue
        if lost := sorted(dead & {d.id for d in x.sharding.device_set}):
            b.lost_device_inputs.add(name)
            log.warning(
                "mnemojax: the step input %s is an array on devices %s, which this step "
                "lost: after a real loss it cannot be read (devices lost to "
                "mnemojax.testing.FaultInjector leave it readable, so a rehearsal runs on). "
                "Pass host arrays (numpy), or place inputs on the step's current mesh "
                "(train_step.mesh, train_step.place)", name, lost)


def _refuse_arrays_of_other_processes(inputs: Any) -> None:
    """A step input that is a `jax.Array` spanning other processes' devices (built with
    ``jax.make_array_from_process_local_data`` or ``host_local_array_to_global_array``)
    holds rows no survivor has after a loss: it can be neither replayed nor placed on a
    new mesh.

    Raises:
        BatchSplitError: naming the first such input, its shape and sharding.
    """
    def foreign(x) -> bool:
        return isinstance(x, jax.Array) and not x.is_fully_addressable

    if not any(foreign(x) for x in jax.tree.leaves(inputs)):  # every step: the cheap look
        return
    for path, x in jax.tree_util.tree_flatten_with_path(inputs)[0]:
        if foreign(x):
            raise BatchSplitError(
                f"the step input {jax.tree_util.keystr(path).lstrip('.') or 'batch'} is a "
                f"jax.Array of shape {tuple(x.shape)} over devices of other processes "
                f"({x.sharding}): "
                "its rows from other processes are lost with them, so a recovery could "
                "neither replay the step nor place the batch on a new mesh. Pass host "
                "numpy instead: the same global batch in every process, or only this "
                "process's rows through mnemojax.data.HostBatches(source, "
                "global_batch_size, start=step.restore(...)), which reads each process's "
                "rows when the step places the batch (README: Per-host data)")


@dataclasses.dataclass(eq=False)
class _Built:
    """What a `ResilientStep` builds at its first call, and the state of its call path."""

    form: StepForm
    builder: RuntimeBuilder
    runtime: Runtime
    durability: Durability
    session: dist_session.DistributedSession | None
    sharded_dims: dict[str, set[int]]
    device_recovery: DeviceRecovery
    process_recovery: ProcessRecovery | None
    last_written: list | None = None  # the leaves the user's state holds (identity check)
    exe: Executable | None = None
    exe_sig: tuple | None = None
    # The pure form after a recovery in guarded work, until the caller has a new state: the
    # leaves of the state it held before (`guard`); that state stands for the recovered one.
    superseded: list | None = None
    batch_size: int | None = None  # examples in the global batch
    examples: int | None = None  # examples the current mesh's step uses
    snapshot_every: int | None = None  # chosen per mesh, see _snapshot_cadence
    precompile_due: bool = False
    skipped_precompile: bool = False  # (said once: a step with host callbacks)
    meshes: list[Mesh] = dataclasses.field(default_factory=list)  # every mesh run on
    memory_room: list[float] | None = None  # this mesh's devices' (`_max_model_shrink`)
    number: int = 0  # which build of the job (the same in every process)
    # Call layouts whose replicated inputs were found alike in every process, and how many
    # comparisons this build made (part of each one's key).
    compared_layouts: set = dataclasses.field(default_factory=set)
    comparisons: int = 0
    old_world_inputs: set = dataclasses.field(default_factory=set)  # (said once per input)
    lost_device_inputs: set = dataclasses.field(default_factory=set)  # (the same)
    restored_unrun: bool = False  # restore() filled the objects; no step has run since
    # Batch layout -> its shapes and dtypes, the newest last (`CompileOptions.ahead_layouts`).
    layouts: dict = dataclasses.field(default_factory=dict)


def _replaced(leaves: list, last: list) -> bool:
    """Whether the pure form's state given (placed) is other than the step last wrote:
    not the same arrays, and the last ones gone (donated to another step) or of other
    values."""
    if all(x is y for x, y in zip(leaves, last, strict=True)):
        return False
    if any(isinstance(y, jax.Array) and y.is_deleted() for y in last):
        return True
    return not bool(np.asarray(_leaves_equal(leaves, last)).all())


@jax.jit
def _leaves_equal(xs: list, ys: list) -> jax.Array:
    """Per leaf pair, whether the two arrays are equal (NaN equal to NaN)."""
    return jnp.stack([jnp.array_equal(x, y, equal_nan=True) for x, y in zip(xs, ys, strict=True)])


def _substitute(new: dict[int, Any], x: Any) -> Any:
    """``new``'s value for ``x`` (keyed by ``id``; the old objects are alive), else x."""
    return new.get(id(x), x)


def _drop_frames(exc: BaseException) -> None:
    """Lets go of the frames ``exc`` (and the exceptions it chains) keep alive: their
    locals hold arrays of a world about to be torn down."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__


def _all_true(flags: Any) -> bool:
    """The per-device finiteness flags of this process's devices (a global flag under
    multi-process is replicated, so every process reads the same)."""
    return all(bool(np.asarray(s.data).all()) for s in flags.addressable_shards)


_Argnums = int | Sequence[int] | None
_Argnames = str | Sequence[str] | None


@overload
def resilient(fn: Callable[P, R], /, *, mesh: Mesh | None = None,
              static_argnums: _Argnums = None, static_argnames: _Argnames = None,
              donate_argnums: _Argnums = None, donate_argnames: _Argnames = None,
              replicated_argnums: _Argnums = None, replicated_argnames: _Argnames = None,
              example_axes: Mapping[int | str, int] | None = None,
              options: ResilienceOptions | None = None,
              fault_injector: FaultInjector | None = None,
              spare_devices: Sequence[Any] = ()) -> ResilientStep[P, R]: ...


@overload
def resilient(*, mesh: Mesh | None = None,
              static_argnums: _Argnums = None, static_argnames: _Argnames = None,
              donate_argnums: _Argnums = None, donate_argnames: _Argnames = None,
              replicated_argnums: _Argnums = None, replicated_argnames: _Argnames = None,
              example_axes: Mapping[int | str, int] | None = None,
              options: ResilienceOptions | None = None,
              fault_injector: FaultInjector | None = None, spare_devices: Sequence[Any] = ()
              ) -> Callable[[Callable[P, R]], ResilientStep[P, R]]: ...


def resilient(fn: Callable[P, R] | None = None, /, *, mesh: Mesh | None = None,
              static_argnums: _Argnums = None, static_argnames: _Argnames = None,
              donate_argnums: _Argnums = None, donate_argnames: _Argnames = None,
              replicated_argnums: _Argnums = None, replicated_argnames: _Argnames = None,
              example_axes: Mapping[int | str, int] | None = None,
              options: ResilienceOptions | None = None,
              fault_injector: FaultInjector | None = None,
              spare_devices: Sequence[Any] = ()
              ) -> ResilientStep[P, R] | Callable[[Callable[P, R]], ResilientStep[P, R]]:
    """Makes a train step survive device loss.

    Use bare (``@mnemojax.resilient``), with keywords
    (``@mnemojax.resilient(mesh=mesh, options=...)``) or as a call
    (``mnemojax.resilient(train_step, mesh=mesh)``). Write the step un-jitted, as for
    ``nnx.jit``: mnemojax compiles it for each mesh, with shardings from the model's
    ``nnx.with_partitioning`` annotations (or the state arrays' shardings).

    The arguments follow ``nnx.jit``'s conventions:

    * NNX objects (Module, Optimizer, Rngs, Metric, Variable) anywhere in the arguments,
      positional or keyword, nested in containers, are the state: the step updates them
      in place, and mnemojax snapshots, reshards and restores them (Rngs counters too).
      A step given no NNX object is pure: ``step(state, ...) -> (state, out)`` or
      ``-> state``, its first argument a pytree of arrays (a Linen ``TrainState`` too).
    * Static arguments are passed as given (hashable; another value compiles again).
    * Every other argument is an input, given on the host (numpy). Every input array is
      part of the global batch: all have its size as leading dimension, and they are
      split along the data axis (the size is fixed by the first call). Placed whole on
      every device instead (replicated) and traced: Python numbers (weakly typed), 0-d
      arrays, 0-d typed PRNG keys (``jax.random.key``; the Flax dropout guide's
      ``train_step(state, batch, dropout_key)``), and every array in the arguments named
      in ``replicated_argnums``/``replicated_argnames`` (a raw ``jax.random.PRNGKey``, a
      table; never a per-example array: replicated inputs are not cut by
      ``batch_policy='truncate_batch'``). Across processes every process passes the same
      replicated values (compared by checksum at the first call of each argument layout:
      `BatchSplitError` if they differ). Replayed after a recovery, a step gets the same
      inputs it had.
    * The step returns what it returns (a dict of metrics, a scalar loss, any pytree);
      the NaN policy finds the loss with ``ResilienceOptions.loss_key``.
    * A step that mutates NNX objects it closes over, instead of taking them as
      arguments, raises `UnsupportedStateError` naming them (as ``nnx.jit`` would fail).

    Args:
        fn: the step, un-jitted (a ``jax.jit``/``nnx.jit`` function is refused: pass its
            ``__wrapped__`` and its static and donated arguments here).
        mesh: the mesh to train on; default: all devices but the spares on one data axis.
        static_argnums: positional arguments that are static, as in ``jax.jit``.
        static_argnames: keyword (or positional, by name) arguments that are static.
        donate_argnums: arguments whose buffers are donated, as in ``jax.jit``. Donating
            any state argument donates all of the state (`CompileOptions.donate_state`);
            inputs are mnemojax's own copies, placed per call, and are not donated.
        donate_argnames: the same, by name.
        replicated_argnums: positional arguments whose arrays every device takes whole
            instead of a slice of the batch (a raw PRNG key, a lookup table). 0-d typed
            keys, 0-d arrays and numbers are replicated without being named.
        replicated_argnames: the same, by name.
        example_axes: argument (position or name) -> the axis of its arrays that holds
            the examples, split along the data axis (default: the leading one), e.g.
            ``{"batch": 1}`` for a stack of K micro-batches ``(K, B, ...)`` that the step
            scans over. Truncation (``batch_policy='truncate_batch'``) cuts along it too.
            Per-host rows (`mnemojax.data`) keep their leading axis.
        options: `ResilienceOptions`.
        fault_injector: a `mnemojax.testing.FaultInjector` to rehearse failures with.
        spare_devices: devices (or ids) kept out of the mesh to swap in for failed ones.

    Returns:
        A `ResilientStep`, or a decorator that makes one.

    Raises:
        InvalidOptionError: `fn` is not callable or already jitted, an argument has the
            wrong type, a static, donated or replicated argument names no parameter of
            `fn`, or an argument is named both static and replicated.

    Example::

        @mnemojax.resilient(mesh=mesh, static_argnames=("pad_id",))
        def train_step(model, optimizer, rngs, batch, metrics, label_smoothing, pad_id):
            grad_fn = nnx.value_and_grad(loss_fn)
            loss, grads = grad_fn(model, batch, rngs, label_smoothing, pad_id)
            optimizer.update(model, grads)
            metrics.update(loss=loss)
            return {"loss": loss}
    """
    jit_args: dict[str, Any] = dict(
        static_argnums=static_argnums, static_argnames=static_argnames,
        donate_argnums=donate_argnums, donate_argnames=donate_argnames,
        replicated_argnums=replicated_argnums, replicated_argnames=replicated_argnames,
        example_axes=example_axes)
    if fn is not None:
        if not callable(fn):
            raise InvalidOptionError(f"resilient() got {fn!r}, which is not callable")
        return ResilientStep(fn, mesh=mesh, options=options, fault_injector=fault_injector,
                             spare_devices=spare_devices, **jit_args)

    def decorate(f: Callable[P, R]) -> ResilientStep[P, R]:
        return ResilientStep(f, mesh=mesh, options=options, fault_injector=fault_injector,
                             spare_devices=spare_devices, **jit_args)

    return decorate
