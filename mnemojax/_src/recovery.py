"""The recovery pipeline of a resilient step: plan, source, reshard, compile, replay.

A mixin of `ResilientStep` (it works on the step's proxy, stores, compiler and
statistics); kept apart so that the call path and the recovery path each fit in one read.
Every recovery is timed by phase (detect, plan, reshard, compile, replay) and recorded.
"""

from __future__ import annotations

import logging
import time
import warnings

import jax
import numpy as np

from mnemojax._src import monitoring
from mnemojax._src import sharding as shd
from mnemojax._src.compiler import StepCompiler
from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.errors import (
    MathChangedWarning,
    MeshTooSmallError,
    RecoveryExhaustedError,
    StateUnavailableError,
    StepHangError,
)
from mnemojax._src.proxy import DeviceProxy, looks_transient
from mnemojax._src.retry import Attempts
from mnemojax._src.snapshot import SnapshotStore
from mnemojax._src.state_source import HostState, gather_state
from mnemojax._src.statistics import RecoveryRecord
from mnemojax._src.topology import MeshPlan, plan_reduced_mesh

log = logging.getLogger("mnemojax")


class RecoveryMixin:
    """Recovery methods of `ResilientStep` (see module docstring)."""

    def _check_budget(self, rule, attempts: int, t_first: float, step: int, exc, what: str):
        rec = self.options.recovery
        elapsed = rec.clock() - t_first
        if rule(Attempts(attempts, elapsed)):
            raise RecoveryExhaustedError(
                f"step {step}: {what} budget exhausted after {attempts} attempt(s) in "
                f"{elapsed:.1f} s ({rule}); last error: {exc}", attempts=attempts,
                last_error=exc) from exc

    def _recover_within_budget(self, step, leaves, verdict, exc, t_fault, t_first, recoveries):
        """Recovers; a device failure during the recovery itself starts it again."""
        rec = self.options.recovery
        failed = set(verdict.failed)
        first_exc = exc
        while True:
            self._check_budget(rec.stop, recoveries, t_first, step, exc, "recovery")
            run_first = self._run_recoveries[0] if self._run_recoveries else t_first
            self._check_budget(rec.run_stop, len(self._run_recoveries), run_first, step,
                               exc, "run-wide recovery")
            recoveries += 1
            self._run_recoveries.append(rec.clock())
            log.warning("mnemojax: step %d: devices %s failed; recovering", step,
                        sorted(failed))
            try:
                new_leaves, record = self._recover(step, leaves, failed, verdict.detect_s,
                                                   t_fault)
                record.hang = isinstance(first_exc, StepHangError)
                return new_leaves, record, recoveries
            except jax.errors.JaxRuntimeError as again:
                exc = again
                verdict = self._proxy.classify(exc)
                if verdict.kind != "device_failure":
                    raise
                failed |= set(verdict.failed)
                self._statistics.faults_during_recovery += 1
                log.warning("mnemojax: step %d: devices %s failed during the recovery; "
                            "starting it again", step, list(verdict.failed))

    def _finish_recovery(self, record: RecoveryRecord, t_fault: float, t_end: float) -> None:
        record.total_s = t_end - t_fault
        self._statistics.recoveries.append(record)
        monitoring.record_recovery(record)
        self._emit_recovery(record)

    def _recover(self, step: int, leaves: list, failed: set[int], detect_s: float,
                 t_fault: float):
        opts = self.options
        proxy = self._proxy
        old_plan = proxy.plan
        phases = {"detect": detect_s}
        t = time.perf_counter()
        plan = plan_reduced_mesh(
            old_plan.device_ids, old_plan.axis_names, proxy.dead, spares=proxy.spares,
            data_axis=opts.data_axis, sharded_dims=self._sharded_dims,
            batch_size=self._batch_size, batch_policy=opts.recovery.batch_policy,
            min_devices=opts.recovery.min_devices)
        phases["plan"] = time.perf_counter() - t
        if plan.math_changed:
            self._statistics.math_changed = True
            warnings.warn(
                f"mnemojax: step {step}: batch_policy='truncate_batch' continues with "
                f"{plan.examples_per_step} of {self._batch_size} examples per step; the run no "
                "longer computes what a failure-free run computes", MathChangedWarning,
                stacklevel=4)
        t = time.perf_counter()
        self._store.wait_idle(timeout_s=60)  # a copy in flight either completes or fails
        try:
            host = gather_state(leaves, step - 1, proxy.dead, self._store.snapshots(),
                                self._layer, live_ok=not opts.compile.donate_state)
            self._statistics.corrupt_snapshots_detected += host.corrupt_snapshots
            if host.corrupt_snapshots:
                self._durability.emit("fault", step=step, classification="corrupt_snapshot",
                                      snapshots=host.corrupt_snapshots)
        except StateUnavailableError as exc:
            self._statistics.corrupt_snapshots_detected += exc.corrupt
            host, unavailable = None, exc  # last resort: the persistent tier, below
        phases["reshard"] = time.perf_counter() - t
        t = time.perf_counter()
        batch = self._batches[-1][1]
        exe, how = self._compiler.get(plan, self._batch_struct(plan.examples_per_step, batch))
        phases["compile"] = time.perf_counter() - t
        t = time.perf_counter()
        if host is None:
            host = self._from_persistent(step, exe.state_shardings, unavailable)
        new_leaves = [self._layer.put(h, s) for h, s in
                      zip(host.leaves, exe.state_shardings, strict=True)]
        jax.block_until_ready(new_leaves)
        phases["reshard"] += time.perf_counter() - t
        proxy.adopt(plan, exe.mesh)
        self._snapshot_every = None  # re-chosen for the new mesh at the next commit
        self._examples = plan.examples_per_step
        self._last_written = None
        t = time.perf_counter()
        for s, b in self._batches:  # replay completed steps newer than the source state
            if host.step < s < step:
                new_leaves, _, _ = self._run(s, new_leaves, b)
        phases["replay"] = time.perf_counter() - t
        if step - 1 - host.step:
            self._durability.emit("wasted_progress", step=step, steps=step - 1 - host.step,
                                  duration_s=phases["replay"])
        nbytes = sum(h.nbytes for h in host.leaves)
        record = RecoveryRecord(
            step=step, failed_devices=tuple(sorted(failed)),
            old_mesh_shape=old_plan.shape, new_mesh_shape=plan.shape,
            new_mesh_devices=tuple(int(i) for i in plan.device_ids.flat),
            plan_kind=plan.kind, source=host.source, source_step=host.step,
            steps_lost=step - 1 - host.step, precompiled=how != "compiled", executable=how,
            phases_s=phases, total_s=0.0, bytes_moved=host.bytes_read + nbytes,
            groups_kept=plan.kept_group_count(), groups_changed=plan.changed_group_count(),
            groups={a: {"kept": list(c.kept), "added": list(c.added), "removed": list(c.removed)}
                    for a, c in plan.groups.items()},
            examples_per_step=plan.examples_per_step, math_changed=plan.math_changed)
        log.warning("mnemojax: step %d: continuing on mesh %s (%s, state from %s)",
                    step, plan.shape, plan.kind, host.source)
        return new_leaves, record

    def _from_persistent(self, step: int, shardings, unavailable: StateUnavailableError):
        """The newest Orbax checkpoint, if the batches since it are still kept for replay."""
        restored = self._durability.restore_latest(shardings, self._compiler.leaf_structs)
        if restored is None:
            raise unavailable
        saved_step, leaves = restored
        self._check_replayable(saved_step, step, "the newest checkpoint", unavailable)
        log.warning("mnemojax: step %d: no in-memory copy survives; restoring the persistent "
                    "checkpoint of step %d", step, saved_step)
        return HostState(list(leaves), "persistent", saved_step,
                         sum(x.nbytes for x in leaves))

    def _check_replayable(self, source_step: int, step: int, what: str, cause=None) -> None:
        """The batches of steps source_step+1 .. step-1 must still be kept for the replay."""
        kept = {s for s, _ in self._batches}
        missing = [s for s in range(source_step + 1, step) if s not in kept]
        if missing:
            raise StateUnavailableError(
                f"{what} is of step {source_step}, but the batches of steps "
                f"{missing[0]}..{missing[-1]} are no longer kept for replay") from cause

    def _emit_recovery(self, record: RecoveryRecord) -> None:
        d = self._durability
        # Emitted at the end of the recovery, stamped with when the fault surfaced.
        d.emit("fault", step=record.step, failed_devices=list(record.failed_devices),
               failed_processes=list(record.failed_processes),
               classification="device_failure", hang=record.hang,
               time_s=time.time() - record.total_s)
        for phase, seconds in record.phases_s.items():
            d.emit("recovery_phase", step=record.step, phase=phase, duration_s=seconds)
        d.emit("recovery", step=record.step, duration_s=record.total_s,
               steps_lost=record.steps_lost, source=record.source, plan=record.plan_kind,
               executable=record.executable, new_mesh=record.new_mesh_shape,
               bytes_moved=record.bytes_moved, groups_changed=record.groups_changed)

    # -- multi-process: a peer process died ----------------------------------------------
    def _is_peer_failure(self, exc: BaseException) -> bool:
        """Under a session, a runtime error is a peer failure unless it is a retryable
        status of this process (then it is retried in place: the peers wait for it in the
        collective, up to the collective timeout)."""
        return (self._session is not None and self._session.can_recover
                and isinstance(exc, jax.errors.JaxRuntimeError) and not looks_transient(exc))

    def _recover_world_again_and_again(self, step: int, reason: str, t_fault: float) -> list:
        """`_recover_world`, again whenever a peer dies while it runs (in the new world's
        compile barrier, restore or replay): each time over the world that failed, within
        the recovery budget."""
        rec = self.options.recovery
        attempts, t_first = 0, rec.clock()
        while True:
            attempts += 1
            try:
                return self._recover_world(step, reason, t_fault)
            except jax.errors.JaxRuntimeError as again:
                if not self._is_peer_failure(again):
                    raise
                self._check_budget(rec.stop, attempts, t_first, step, again, "recovery")
                reason = f"during the recovery: {type(again).__name__}: {again}"
            self._statistics.faults_during_recovery += 1  # the exception is gone here
            log.warning("mnemojax: step %d: a peer failed during the recovery; recovering "
                        "the world again", step)

    def _recover_world(self, step: int, reason: str, t_fault: float) -> list:
        """A collective failed: agree with the survivors, re-initialise into their world,
        rebuild the mesh over its devices, restore the agreed step from the agents (the
        dead host's shards from its buddy) and replay up to `step` - 1."""
        session = self._session
        t0 = time.perf_counter()
        old_plan = self._proxy.plan
        before = session.world
        self._drop_world_arrays()
        log.warning("mnemojax: step %d: a peer process failed (%s); recovering the world",
                    step, reason[:200])
        rec = session.recover(last_step=self._step, reason=reason,
                              first_replayable=self._batches[0][0] if self._batches else None)
        phases = {"detect": t0 - t_fault,
                  "agree": rec.phases["detach"] + rec.phases["agree"]}
        t = time.perf_counter()
        try:
            plan = self._plan_world(old_plan)
        except MeshTooSmallError as exc:
            self._persist_agreed_state(rec, exc)  # raises
        phases["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        self._rebuild_runtime(plan)
        self._durability.reopen_tier()
        batch = self._batches[-1][1]
        self._compile_in_step(batch)
        phases["compile"] = time.perf_counter() - t
        t = time.perf_counter()
        shardings = self._executable_now(batch).state_shardings
        if rec.agreement.resume_step < 0:
            resume, leaves = self._world_from_persistent(step, rec, shardings)
            source = "persistent"
        else:  # the agreement chose a step every survivor can replay from
            resume, leaves = rec.agreement.resume_step, session.restore(rec, shardings)
            source = "agent_snapshots"
        phases["restore"] = rec.phases["attach"] + rec.phases["fetch"] + (
            time.perf_counter() - t)
        t = time.perf_counter()
        self._step = resume
        for s, b in list(self._batches):
            if resume < s < step:
                leaves, _, _ = self._run(s, leaves, b)
                self._publish(s, leaves)
                self._step = s
        phases["replay"] = time.perf_counter() - t
        dead = sorted(set(rec.members) - set(rec.agreement.survivors))
        record = RecoveryRecord(
            step=step, failed_devices=(), old_mesh_shape=old_plan.shape,
            new_mesh_shape=plan.shape,
            new_mesh_devices=tuple(int(i) for i in plan.device_ids.flat),
            plan_kind="process_loss", source=source, source_step=resume,
            steps_lost=step - 1 - resume, precompiled=False, executable="compiled",
            phases_s=phases, total_s=time.perf_counter() - t_fault,
            bytes_moved=sum(len(p) for p in rec.payloads), groups_kept=0,
            groups_changed=len(plan.groups), groups={}, examples_per_step=self._examples,
            math_changed=False, failed_processes=tuple(dead),
            generation=rec.world.generation, fetched_from=dict(rec.fetched_from),
            agreement_rounds=rec.rounds)
        self._statistics.recoveries.append(record)
        monitoring.record_recovery(record)
        self._emit_recovery(record)
        log.warning("mnemojax: world %d -> %d: processes %s lost; %d processes, mesh %s, "
                    "resuming from step %d", before.generation, rec.world.generation, dead,
                    rec.world.num_processes, plan.shape, resume)
        return leaves

    def _world_from_persistent(self, step: int, rec, shardings) -> tuple[int, list]:
        """No step's state survives in memory (`Agreement.lost`): every survivor restores
        the newest Orbax checkpoint onto the new world's mesh, else a typed error."""
        unavailable = StateUnavailableError(f"step {step}: {rec.agreement.why}")
        if not self.options.persistent.directory:
            raise StateUnavailableError(
                f"{unavailable}, and no persistent tier is configured "
                "(PersistentOptions(directory=...))")
        host = self._from_persistent(step, shardings, unavailable)
        leaves = [self._layer.put(h, s) for h, s in zip(host.leaves, shardings, strict=True)]
        return host.step, leaves

    def _persist_agreed_state(self, rec, exc: MeshTooSmallError):
        """Too few processes survive to hold the model: the agreed state (every shard of
        it, from the agents) goes to the persistent tier before the typed error. Rank 0
        leaves the distributed world first, so Orbax runs as a single process."""
        from mnemojax._src.distributed import coordination, snapshot_codec
        from mnemojax._src.persistent import PersistentTier

        step = rec.agreement.resume_step
        directory = self.options.persistent.directory
        where = "no persistent tier is configured (PersistentOptions(directory=...))"
        if step < 0:
            where = (f"no copy of the shards of workers {list(rec.agreement.lost)} survives, "
                     "so there is no state to checkpoint")
        elif directory and rec.world.process_id == 0:
            leaves = snapshot_codec.assemble(rec.payloads, len(self._form.leaf_keys))
            coordination.detach_worker()
            tier = PersistentTier(directory, keys=self._form.leaf_keys,
                                  max_to_keep=self.options.persistent.max_to_keep)
            tier.save(step, leaves, wait=True)
            tier.close()
            where = f"step {step} is checkpointed in {tier.directory}"
        elif directory:
            where = f"process 0 of the survivors checkpoints step {step} in {directory}"
        raise MeshTooSmallError(f"{exc}; {where}", healthy_devices=exc.healthy_devices,
                                required=exc.required) from exc

    def _drop_world_arrays(self) -> None:
        """Forgets every array and executable of the old world before it is torn down."""
        self._last_written = None
        self._exe = self._exe_sig = None
        self._compiler.close()
        self._store.close()
        form = self._form
        if hasattr(form, "live_vars"):
            for var, (shape, dtype) in zip(form.live_vars, self._compiler.leaf_structs,
                                           strict=True):
                var.set_value(np.zeros(shape, dtype))

    def _plan_world(self, old_plan) -> MeshPlan:
        """The mesh over the new world's devices: model axes kept, data axis as wide as the
        devices allow and the global batch divides (the math does not change)."""
        axes = old_plan.axis_names
        data = self.options.data_axis
        others = [n for a, n in old_plan.shape.items() if a != data]
        per_replica = int(np.prod(others)) if others else 1
        devices = sorted(d.id for d in jax.devices())
        limit = len(devices) // per_replica
        width = next((w for w in range(limit, 0, -1)
                      if not self._batch_size or self._batch_size % w == 0), 0)
        if data not in axes or width == 0:
            raise MeshTooSmallError(
                f"the new world has {len(devices)} devices; a replica needs {per_replica}",
                healthy_devices=len(devices), required=per_replica)
        shape = [width if a == data else old_plan.shape[a] for a in axes]
        ids = np.array(devices[: width * per_replica])
        order = [axes.index(data)] + [i for i, a in enumerate(axes) if a != data]
        grid = ids.reshape([shape[i] for i in order]).transpose(np.argsort(order))
        return MeshPlan(grid, axes, "drop_replicas")

    def _rebuild_runtime(self, plan: MeshPlan) -> None:
        opts = self.options
        layer = JaxDeviceLayer()
        if self._injector is not None:  # rehearsed faults go on in the new world
            layer = self._injector.wrap(layer)
        self._layer = layer
        self._durability.layer = layer
        self._proxy = DeviceProxy(layer, plan, shd.mesh_from_plan(plan), [],
                                  data_axis=opts.data_axis,
                                  probe_timeout_s=opts.recovery.probe_timeout_s)
        self._compiler = StepCompiler(
            self._form.pure, self._form.specs, self._compiler.leaf_structs,
            data_axis=opts.data_axis, donate=opts.compile.donate_state,
            check_state=opts.check_state and opts.nonfinite != "ignore")
        self._store = SnapshotStore(layer, self._form.leaf_entries,
                                    budget_bytes=opts.snapshot.host_memory_budget_bytes)
        self._examples = self._batch_size
