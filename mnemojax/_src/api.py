"""`mnemojax.resilient`: the decorator and the `ResilientStep` it returns."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import numpy as np
from jax.sharding import Mesh

from mnemojax._src import sharding as shd
from mnemojax._src.compiler import StepCompiler, enable_persistent_cache
from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.distributed import session as dist_session
from mnemojax._src.durability import Durability
from mnemojax._src.errors import (
    BatchSplitError,
    InvalidOptionError,
    NonFiniteLossError,
    NonFiniteSkipWarning,
    UnsupportedStateError,
)
from mnemojax._src.options import ResilienceOptions
from mnemojax._src.proxy import DeviceProxy, host_batch
from mnemojax._src.recovery import RecoveryMixin
from mnemojax._src.snapshot import SnapshotStore, has_single_copy_shards
from mnemojax._src.statistics import RecoveryRecord, Statistics
from mnemojax._src.step_forms import NnxForm, PytreeForm, StepForm, form_for
from mnemojax._src.topology import MeshPlan, single_failure_plans

log = logging.getLogger("mnemojax")

P = ParamSpec("P")
R = TypeVar("R")


class ResilientStep(RecoveryMixin, Generic[P, R]):
    """A train step that survives device loss. Built by `mnemojax.resilient`.

    Call it like the undecorated step: ``metrics = step(model, optimizer, batch)`` (Flax
    NNX, updates both in place) or ``state, metrics = step(state, batch)`` (pure). `batch`
    is the global batch as host arrays; it is split along the data axis of the current mesh.

    Attributes:
        statistics: live `Statistics` (steps run, mesh, snapshots, recoveries).
        options: the `ResilienceOptions` in force. Under ``mnemojax.initialize()`` (several
            processes) background compiles and in-process snapshots are off: the agents
            hold the snapshots. `with_options` starts from the options as given.
        mesh: the current mesh (changes after a recovery).
    """

    def __init__(self, fn: Callable[P, R], *, mesh: Mesh | None = None,
                 options: ResilienceOptions | None = None, fault_injector=None,
                 spare_devices: Sequence[Any] = ()):
        if options is not None and not isinstance(options, ResilienceOptions):
            raise InvalidOptionError(
                f"options={options!r} is invalid: expected a mnemojax.ResilienceOptions")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise InvalidOptionError(f"mesh={mesh!r} is invalid: expected a jax.sharding.Mesh")
        functools.update_wrapper(self, fn)
        self.__wrapped__ = fn
        self._fn = fn
        self._mesh_arg = mesh
        self.options = options or ResilienceOptions()  # in effect (see `_build`)
        self._given_options = self.options  # as given: what `with_options` copies
        self._injector = fault_injector
        self._spares_arg = tuple(spare_devices)
        self._statistics = Statistics()
        self._form: StepForm | None = None
        self._last_written: list | None = None
        self._step = 0
        self._step_times: collections.deque = collections.deque(maxlen=100)
        self._run_recoveries: list[float] = []  # budget clock of every recovery this run
        self._batches: collections.deque = collections.deque(
            maxlen=max(self.options.snapshot.every_steps,
                       self.options.snapshot.unreplicated_every_steps,
                       self.options.persistent.every_steps, 1) + 1)

    def with_options(self, **changes) -> ResilientStep[P, R]:
        """A new, unbuilt resilient step of the same function with some arguments changed
        (``mesh``, ``options``, ``fault_injector``, ``spare_devices``)."""
        kwargs = dict(mesh=self._mesh_arg, options=self._given_options,
                      fault_injector=self._injector, spare_devices=self._spares_arg)
        unknown = set(changes) - set(kwargs)
        if unknown:
            raise InvalidOptionError(f"with_options got unknown argument(s) {sorted(unknown)}")
        kwargs.update(changes)
        return ResilientStep(self._fn, **kwargs)

    # -- public views -------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh | None:
        return self._proxy.mesh if self._form is not None else self._mesh_arg

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def statistics(self) -> Statistics:
        s = self._statistics
        if self._form is not None:
            s.mesh_shape = dict(self._proxy.mesh.shape)
            s.mesh_devices = tuple(int(i) for i in self._proxy.plan.device_ids.flat)
            s.spare_devices = tuple(self._proxy.spares)
            s.dead_devices = tuple(sorted(self._proxy.dead))
            s.compiles = self._compiler.compiles
            s.precompiled_meshes = self._compiler.compiled_ahead
            snap = self._store.latest()
            s.snapshot_bytes = snap.nbytes if snap else 0
            s.snapshot_bytes_by_entry = snap.nbytes_by_entry() if snap else {}
            s.snapshot_copy_median_s = self._store.median_copy_s()
            s.snapshots_taken = self._store.taken
            s.snapshots_replaced = self._store.replaced
            s.corrupt_snapshots_scrubbed = self._store.corrupt_found
            s.snapshots_over_budget = self._store.disabled or (
                self._session is not None and self._session.publish_refused)
            s.jit_checkpoints = self._durability.jit_checkpoints
            grads = self._grads_store.latest() if self._grads_store is not None else None
            s.grads_snapshot_step = grads.step if grads else None
            s.grads_snapshot_bytes = grads.nbytes if grads else 0
        return s

    def wait_precompiled(self, timeout_s: float | None = None) -> bool:
        """Blocks until the fallback executables queued so far are compiled."""
        return self._form is None or self._compiler.wait_precompiled(timeout_s)

    def wait_snapshots(self, timeout_s: float | None = None) -> bool:
        """Blocks until the snapshot copy in flight (if any) is complete."""
        return self._form is None or all(
            store.wait_idle(timeout_s) for store in (self._store, self._grads_store)
            if store is not None)

    def close(self) -> None:
        """Stops the background threads (snapshot copiers, compiler)."""
        if self._form is not None:
            self._compiler.close()
            for store in (self._store, self._grads_store):
                if store is not None:
                    store.close()
            self._durability.emit("run_end", step=self._step, steps=self._step)
            self._durability.close()

    # -- building -------------------------------------------------------------------------
    def _build(self, args: tuple) -> None:
        opts = self.options
        self._session = dist_session.current()
        if self._session is not None:
            # Every process compiles the same programs at the same time (barrier after
            # each); background compiles and in-process snapshots would only get in the way:
            # the agent holds the snapshots, outside this process.
            opts = self.options = dataclasses.replace(
                opts, compile=dataclasses.replace(opts.compile, precompile=False),
                snapshot=dataclasses.replace(opts.snapshot, every_steps=0,
                                             unreplicated_every_steps=0))
        form = form_for(self._fn, args)
        all_devices = {d.id: d for d in jax.devices()}
        spares = [int(getattr(d, "id", d)) for d in self._spares_arg]
        bad = [s for s in spares if s not in all_devices]
        if bad:
            raise InvalidOptionError(f"spare_devices={bad!r}: no such device ids")
        mesh = self._mesh_arg
        if mesh is None:
            devices = [d for d in jax.devices() if d.id not in spares]
            mesh = jax.make_mesh((len(devices),), (opts.data_axis,), devices=devices,
                                 axis_types=(jax.sharding.AxisType.Auto,))
        ids = shd.device_ids(mesh)
        overlap = sorted(set(spares) & {int(i) for i in ids.flat})
        if overlap:
            raise InvalidOptionError(f"spare_devices={overlap!r} are already in the mesh")
        plan = MeshPlan(ids, tuple(mesh.axis_names), "unchanged")
        values = form.read() if isinstance(form, NnxForm) else form.read_from(args[0])
        shapes = [tuple(np.shape(v)) for v in values]
        shd.validate_specs(form.specs, shapes, form.leaf_paths, dict(mesh.shape))
        layer = JaxDeviceLayer()
        if self._injector is not None:
            layer = self._injector.wrap(layer)
        enable_persistent_cache(opts.compile.cache_dir)
        self._layer = layer
        self._proxy = DeviceProxy(layer, plan, mesh, spares, data_axis=opts.data_axis,
                                  probe_timeout_s=opts.recovery.probe_timeout_s)
        self._sharded_dims = shd.sharded_dims(form.specs, shapes)
        self._compiler = StepCompiler(
            form.pure, form.specs, [(s, np.asarray(v).dtype if not hasattr(v, "dtype")
                                     else v.dtype) for s, v in zip(shapes, values, strict=True)],
            data_axis=opts.data_axis, donate=opts.compile.donate_state,
            check_state=opts.check_state and opts.nonfinite != "ignore")
        snap = opts.snapshot
        self._durability = Durability(opts, keys=form.leaf_keys, layer=layer)
        self._store = SnapshotStore(
            layer, form.leaf_entries, budget_bytes=snap.host_memory_budget_bytes,
            verify=snap.verify_checksums,
            on_corrupt=lambda s: self._durability.emit("fault", step=s,
                                                       classification="corrupt_snapshot"))
        self._snapshot_every: int | None = None  # chosen per mesh, see _snapshot_cadence
        self._durability.emit("run_start", config={
            "mesh": dict(mesh.shape), "form": form.kind, "leaves": len(values),
            "spares": spares})
        self._grads_store = None
        self._exe_sig = None
        self._exe = None
        self._precompile_due = False
        self._run_inputs: list | None = None  # the state the last `_run` ran on
        self._batch_size: int | None = None
        self._examples: int | None = None
        self._form = form

    # -- calling --------------------------------------------------------------------------
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs:
            raise UnsupportedStateError(
                f"pass the step's arguments positionally; got keywords {sorted(kwargs)}")
        t_call = time.perf_counter()
        if self._form is None:
            self._build(args)
        form = self._form
        self._durability.check_preemption(self._step, self._last_written)
        if isinstance(form, NnxForm):
            if len(args) != 3 or not form.matches(args[0], args[1]):
                raise UnsupportedStateError(
                    "this resilient step was built for another model/optimizer pair; decorate "
                    "a new step (or use step.with_options()) for a different model")
            leaves = form.read()
        else:
            if len(args) != 2:
                raise UnsupportedStateError(
                    f"the pure step form is step(state, batch); got {len(args)} arguments")
            leaves = form.read_from(args[0])
        batch = host_batch(args[-1])
        self._check_batch(batch)
        step = self._step + 1
        self._batches.append((step, batch))
        if self._session is not None and self._exe is None:
            self._compile_in_step(batch)
        leaves = self._place_state(leaves)
        if self._session is not None and self._step == 0:
            self._publish(0, leaves)  # a peer lost in the first step needs the initial state
        new_leaves, metrics, finite = self._run(step, leaves, batch)
        kept, self._run_inputs = self._run_inputs, None  # do not keep a second state alive
        if not self._accept(step, metrics, finite):  # nonfinite="skip_batch"
            self._batches.pop()
            # ``kept`` is the state of step - 1: the recovered one, if a recovery ran.
            if isinstance(form, PytreeForm):
                return form.unflatten(kept), metrics
            if kept is not leaves:
                form.write(kept)
                self._last_written = kept
            return metrics
        self._commit(step, new_leaves, metrics)
        self._durability.emit("step", step=step, duration_s=time.perf_counter() - t_call)
        self._after_commit(step, new_leaves)
        result = (form.unflatten(new_leaves), metrics) if isinstance(form, PytreeForm) \
            else metrics
        if isinstance(form, NnxForm):
            form.write(new_leaves)
        if self._precompile_due:
            # Last, once the step is fully committed: background lowering and compiling
            # contend with the training thread (GIL, compile locks) and would otherwise
            # delay the replayed step's commit (see bench/micro.py, item 3).
            self._precompile_due = False
            self._schedule_precompile()
        return result

    def _after_commit(self, step: int, new_leaves: list) -> None:
        """Checkpoints and triggers. Under a session, a peer failure inside a checkpoint's
        collective loses only that checkpoint: the step is committed and published, and the
        next step's collective fails the same way and recovers the world."""
        try:
            self._durability.after_commit(step, new_leaves, self._proxy.mesh.devices.flat)
        except jax.errors.JaxRuntimeError as exc:
            if not self._is_peer_failure(exc):
                raise
            log.warning("mnemojax: step %d: the checkpoint failed, a peer process failed "
                        "(%s); the next step recovers", step, str(exc)[:200])
            self._durability.emit("fault", step=step, classification="checkpoint_failed",
                                  detail=str(exc)[:200])

    def _check_batch(self, batch) -> None:
        sizes = {x.shape[0] for x in jax.tree.leaves(batch) if x.ndim}
        if len(sizes) > 1:
            raise BatchSplitError(
                f"the batch leaves have different leading (example) sizes {sorted(sizes)}")
        size = sizes.pop() if sizes else None
        if self._batch_size is None:
            self._batch_size = size
            self._examples = size
        width = self._proxy.data_width()
        used = size if self._examples == self._batch_size else self._examples
        if size is not None and used % width:
            raise BatchSplitError(
                f"the global batch has {size} examples, which the data axis "
                f"{self.options.data_axis!r} of width {width} cannot split evenly")

    def _place_state(self, leaves: list) -> list:
        if self._last_written is not None and len(leaves) == len(self._last_written) and all(
                a is b for a, b in zip(leaves, self._last_written, strict=True)):
            return leaves
        exe = self._executable_now()
        return [x if isinstance(x, jax.Array) and x.sharding == s else self._layer.put(x, s)
                for x, s in zip(leaves, exe.state_shardings, strict=True)]

    def _batch_struct(self, examples: int | None, batch):
        def struct(x):
            shape = x.shape if not x.ndim or examples is None else (examples, *x.shape[1:])
            return jax.ShapeDtypeStruct(shape, x.dtype)
        return jax.tree.map(struct, batch)

    def _executable_now(self, batch=None):
        """The executable for the current mesh and this batch's shapes (cached per call
        signature: the steady-state path does no lookups)."""
        batch = batch if batch is not None else self._batches[-1][1]
        sig = (self._proxy.plan.key, self._examples,
               tuple((x.shape, x.dtype) for x in jax.tree.leaves(batch)))
        if self._exe_sig != sig:
            self._exe, _ = self._compiler.get(self._proxy.plan,
                                              self._batch_struct(self._examples, batch))
            self._exe_sig = sig
        return self._exe

    def _run(self, step: int, leaves: list, batch) -> tuple[list, Any, Any]:
        """Runs `step`: recovers from device failures (a failure during a recovery starts
        it again), retries transient errors in place, within the budgets."""
        rec = self.options.recovery
        retries = recoveries = 0
        t_first: float | None = None  # budget clock at this step's first failure
        pending: tuple[RecoveryRecord, float] | None = None
        while True:
            exe = self._executable_now(batch)
            try:
                device_batch = self._proxy.place_batch(batch, exe.batch_shardings,
                                                       self._examples)
                t_run = time.perf_counter()
                out = self._proxy.run(exe.compiled, leaves, device_batch, step,
                                      timeout_s=self._hang_timeout_s())
            except Exception as exc:
                t_fault = time.perf_counter()
                if self._is_peer_failure(exc):
                    reason = f"{type(exc).__name__}: {exc}"
                    del exc  # hold nothing of the old world (see _recover_world)
                    leaves = self._recover_world_again_and_again(step, reason, t_fault)
                    continue
                verdict = self._proxy.classify(exc)
                if verdict.kind == "user":
                    raise
                t_first = rec.clock() if t_first is None else t_first
                if verdict.kind == "transient":
                    self._check_budget(rec.retry_stop, retries, t_first, step, exc,
                                       "transient-error retries")
                    retries += 1
                    self._statistics.transient_retries += 1
                    self._durability.emit("fault", step=step, classification="transient",
                                          detail=str(exc)[:200], retry=retries)
                    log.warning("mnemojax: step %d: transient error, retry %d: %s",
                                step, retries, exc)
                    rec.sleep(rec.retry_backoff(retries))
                    continue
                if pending is not None:  # a failure in the replay ended the last recovery
                    self._finish_recovery(pending[0], pending[1], t_fault)
                leaves, record, recoveries = self._recover_within_budget(
                    step, leaves, verdict, exc, t_fault, t_first, recoveries)
                pending = (record, t_fault)
                continue
            t_run_end = time.perf_counter()
            if pending is not None:
                record, t_fault = pending
                record.phases_s["replay"] += t_run_end - t_run
                self._finish_recovery(record, t_fault, t_run_end)
                self._precompile_due = True
            else:
                self._step_times.append(t_run_end - t_run)
            self._run_inputs = leaves  # what this step ran on (after any recovery)
            return out

    def _hang_timeout_s(self) -> float:
        rec = self.options.recovery
        if rec.hang_timeout_s is not None:
            return rec.hang_timeout_s
        if not self._step_times:
            return rec.hang_floor_s
        return max(rec.hang_floor_s, rec.hang_factor * statistics.median(self._step_times))

    def restore(self, *args):
        """Restores the newest persistent checkpoint (e.g. after a preemption) and sets
        the step counter to its step.

        Call it with the step's state arguments before the first step: NNX
        ``step.restore(model, optimizer) -> int`` (updates both in place, returns the
        step restored, 0 if there is no checkpoint); pure ``state, k = step.restore(state)``.
        Restores onto the current mesh, whatever mesh saved it.

        Raises:
            CheckpointMismatchError: the checkpoint belongs to another model.
        """
        if self._form is None:
            self._build((*args, None))
        if self._step:
            raise UnsupportedStateError(
                f"restore() must come before the first step; {self._step} steps have run")
        leaves = self._form.read() if isinstance(self._form, NnxForm) \
            else self._form.read_from(args[0])
        shardings = shd.named(self._proxy.mesh, self._form.specs)
        restored = self._durability.restore_latest(shardings, self._compiler.leaf_structs)
        if restored is not None:
            self._step, leaves = restored
            self._statistics.steps_run = self._step
            self._last_written = None
        if isinstance(self._form, NnxForm):
            self._form.write(leaves)
            return self._step
        return self._form.unflatten(leaves), self._step

    def _accept(self, step: int, metrics, finite) -> bool:
        """The non-finite policy: False means skip this batch (the state is unchanged)."""
        opts = self.options
        if opts.nonfinite == "ignore":
            return True
        loss = metrics.get(opts.loss_key) if isinstance(metrics, dict) else metrics
        value = float(np.asarray(loss)) if hasattr(loss, "dtype") and np.size(loss) == 1 \
            else 0.0
        if np.isfinite(value) and _all_true(finite):
            return True
        what = (f"{opts.loss_key}={value}" if not np.isfinite(value)
                else "the new state (from the gradients) has NaN/Inf")
        if opts.nonfinite == "raise":
            raise NonFiniteLossError(
                f"step {step}: {what}; the state of step {step - 1} is kept "
                "(nonfinite='raise')", step=step, value=value)
        self._statistics.skipped_batches.append(step)
        self._durability.emit("fault", step=step, classification="nonfinite", detail=what)
        warnings.warn(f"mnemojax: step {step}: {what}; batch skipped, the state of step "
                      f"{step - 1} is kept (nonfinite='skip_batch')", NonFiniteSkipWarning,
                      stacklevel=3)
        return False

    def _compile_in_step(self, batch) -> None:
        """Multi-process: compile, then wait until every process has (DESIGN §4)."""
        self._session.phase("compile")
        self._executable_now(batch)
        self._session.compiled()

    def _commit(self, step: int, new_leaves: list, metrics) -> None:
        opts = self.options
        if self._session is not None:
            self._publish(step, new_leaves)
        self._step = step
        self._last_written = new_leaves
        self._statistics.steps_run = step
        if self._snapshot_every is None:
            self._snapshot_every = self._snapshot_cadence(new_leaves)
        if self._snapshot_every and step % self._snapshot_every == 0:
            self._store.submit(step, new_leaves)
            if opts.compile.donate_state:
                self._store.wait_idle()  # the next step donates these buffers
        grads_every = opts.snapshot.grads_every_steps
        if grads_every and isinstance(metrics, dict) and "grads" in metrics \
                and step % grads_every == 0:
            if self._grads_store is None:
                n = len(jax.tree.leaves(metrics["grads"]))
                self._grads_store = SnapshotStore(
                    self._layer, ["grads"] * n, name="grads",
                    budget_bytes=opts.snapshot.host_memory_budget_bytes,
                    verify=opts.snapshot.verify_checksums)
            self._grads_store.submit(step, jax.tree.leaves(metrics["grads"]))
        if step == 1:
            self._precompile_due = True

    def _publish(self, step: int, leaves: list) -> None:
        """Multi-process: this worker's shards of the state after `step` to its agent."""
        refused = self._session.publish_refused
        self._session.publish(step, leaves,
                              budget_bytes=self.options.snapshot.host_memory_budget_bytes)
        if self._session.publish_refused and not refused:
            self._durability.emit("fault", step=step, classification="snapshot_budget")

    def _snapshot_cadence(self, leaves) -> int:
        """Snapshots are the only second copy of single-copy shards: take them more often."""
        snap = self.options.snapshot
        self._statistics.unreplicated_state = has_single_copy_shards(leaves)
        every = snap.unreplicated_every_steps if self._statistics.unreplicated_state \
            else snap.every_steps
        self._statistics.snapshot_every_steps = every
        return every

    def _schedule_precompile(self) -> None:
        copts = self.options.compile
        if not copts.precompile or copts.max_precompiled == 0:
            return
        proxy = self._proxy
        plans = single_failure_plans(
            proxy.plan.device_ids, proxy.plan.axis_names, spares=proxy.spares,
            data_axis=self.options.data_axis, sharded_dims=self._sharded_dims,
            batch_size=self._batch_size, batch_policy=self.options.recovery.batch_policy,
            min_devices=self.options.recovery.min_devices)[:copts.max_precompiled]
        batch = self._batches[-1][1]
        for plan in plans:
            self._compiler.precompile([plan], self._batch_struct(plan.examples_per_step, batch))


def _all_true(flags) -> bool:
    """The per-device finiteness flags of this process's devices (a global flag under
    multi-process is replicated, so every process reads the same)."""
    return all(bool(np.asarray(s.data).all()) for s in flags.addressable_shards)


@overload
def resilient(fn: Callable[P, R], /) -> ResilientStep[P, R]: ...


@overload
def resilient(*, mesh: Mesh | None = None, options: ResilienceOptions | None = None,
              fault_injector=None, spare_devices: Sequence[Any] = ()
              ) -> Callable[[Callable[P, R]], ResilientStep[P, R]]: ...


def resilient(fn=None, /, *, mesh=None, options=None, fault_injector=None, spare_devices=()):
    """Makes a train step survive device loss.

    Use bare (``@mnemojax.resilient``) or with keywords
    (``@mnemojax.resilient(mesh=mesh, options=...)``). Write the step un-jitted: mnemojax
    compiles it with shardings from the model's ``nnx.with_partitioning`` annotations (or
    the state arrays' `NamedSharding`s) on `mesh`.

    Args:
        fn: ``step(model, optimizer, batch) -> metrics`` (Flax NNX, in place) or
            ``step(state, batch) -> (state, metrics)`` (any pytree of arrays).
        mesh: the mesh to train on; default: all devices but the spares on one data axis.
        options: `ResilienceOptions`.
        fault_injector: a `mnemojax.testing.FaultInjector` to rehearse failures with.
        spare_devices: devices (or ids) kept out of the mesh to swap in for failed ones.

    Returns:
        A `ResilientStep`, or a decorator that makes one.

    Example::

        @mnemojax.resilient(mesh=mesh)
        def train_step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return {"loss": loss}
    """
    if fn is not None:
        if not callable(fn):
            raise InvalidOptionError(f"resilient() got {fn!r}, which is not callable")
        return ResilientStep(fn, mesh=mesh, options=options, fault_injector=fault_injector,
                             spare_devices=spare_devices)

    def decorate(f):
        return ResilientStep(f, mesh=mesh, options=options, fault_injector=fault_injector,
                             spare_devices=spare_devices)

    return decorate
