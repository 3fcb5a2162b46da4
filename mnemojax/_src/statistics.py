"""What a resilient step reports: steady-state counters and one record per recovery."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RecoveryRecord:
    """One recovery from a device failure.

    Attributes:
        step: the step that failed (and was replayed).
        failed_devices: ids of the devices found dead.
        old_mesh_shape: mesh axis sizes before the recovery.
        new_mesh_shape: mesh axis sizes after it.
        new_mesh_devices: device ids of the new mesh, flattened in mesh order.
        plan_kind: ``spare_swap``, ``drop_replicas`` or ``shrink_model``.
        source: where the state came from: ``live_replicas``, ``live_replicas+snapshot``
            (shards with no surviving copy from the host snapshot of the same step) or
            ``host_snapshot`` (all from an older snapshot; the steps since are replayed).
        source_step: the step whose state was restored.
        steps_lost: completed steps that had to be recomputed (0 = only the failed one).
        precompiled: the executable for the new mesh was compiled ahead of time.
        executable: ``ready``, ``waited`` (ahead-of-time compile still running),
            ``cached`` (loaded from the persistent compilation cache: across processes,
            the entry the world before wrote ahead) or ``compiled`` (compiled on the
            critical path: across processes on one host, possibly by the process this
            one waited for, `coordination.OneCompile`).
        phases_s: seconds per phase (detect, plan, reshard, compile, replay).
        total_s: from the failure surfacing to the replayed step's results being ready.
        bytes_moved: bytes read from surviving devices or snapshots plus bytes placed on
            the new mesh.
        groups_kept: collective replica groups kept unchanged, over all mesh axes.
        groups_changed: collective replica groups created, over all mesh axes.
        groups: per mesh axis, the device-id groups ``kept``, ``added`` and ``removed``.
        examples_per_step: examples per step on the new mesh.
        math_changed: the new mesh computes something else than the failure-free run.
        hang: the failure was a hang noticed by the watchdog (no error was raised).
        failed_processes: multi-process recoveries (``plan_kind == "process_loss"``):
            the worker ids lost. Their phases are detect, close (the old world's runtime
            closed: a background compile that is running is waited for; and the survivor's
            held copy handed to its agent, `SnapshotOptions.hold_live_replicas`), agree,
            plan, compile, restore, replay.
        generation: multi-process: the new world's generation.
        fetched_from: multi-process: origin worker id -> the agent that served this
            process the regions of that worker's copy its own devices hold (only the
            copies that overlap them); a survivor's held copy of its replicas
            (`SnapshotOptions.hold_live_replicas`) is listed as ``-1 - worker id``.
        left_processes: multi-process: the worker ids that left the job because the new
            mesh gave their process no device (`LeftJobExit`); not in ``failed_processes``.
        agreement_rounds: multi-process: agreement rounds (2+ when a survivor died after
            a decision, or processes left the job, and the others agreed again).
        from_export: multi-process: the new world lowered the step from the `jax.export`
            made when its mesh was compiled ahead, instead of tracing it again
            (`compiler.ExportedSteps`).
        guarded: the failure surfaced in work beside the steps (`ResilientStep.guard`),
            after step ``step - 1``; the replayed "failed step" is that work.
        joined_processes: multi-process: the worker ids that joined the new world (spares
            that took a dead member's rank, or processes of a world grown back).
        waited_s: how long the failed step (or guarded work) had run when the failure
            surfaced: a collective timeout run into (a stopped or dead peer, across
            processes) shows here, before ``total_s`` starts.
        cause: multi-process: how the failure surfaced in this process (the error's
            type and text, shortened: the launcher's news of a death, a collective's
            error, a barrier given up).
    """

    step: int
    failed_devices: tuple[int, ...]
    old_mesh_shape: dict[str, int]
    new_mesh_shape: dict[str, int]
    new_mesh_devices: tuple[int, ...]
    plan_kind: str
    source: str
    source_step: int
    steps_lost: int
    precompiled: bool
    executable: str
    phases_s: dict[str, float]
    total_s: float
    bytes_moved: int
    groups_kept: int
    groups_changed: int
    groups: dict[str, dict[str, list]]
    examples_per_step: int | None
    math_changed: bool
    hang: bool = False
    failed_processes: tuple[int, ...] = ()  # multi-process: workers lost (stable ids)
    generation: int = 0  # multi-process: the world generation after the recovery
    fetched_from: dict[int, str] = dataclasses.field(default_factory=dict)
    left_processes: tuple[int, ...] = ()
    agreement_rounds: int = 0
    from_export: bool = False
    guarded: bool = False
    joined_processes: tuple[int, ...] = ()
    waited_s: float = 0.0
    cause: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class JoinRecord:
    """A process started into a running job (multi-process; `ResilientStep.restore` took
    the agreed state).

    Attributes:
        how: ``spare`` (it waited, then took a dead member's rank) or ``restart`` (a
            survivor started again after its world's coordination service was lost with
            its node).
        generation: the world it joined.
        resume_step: the step whose state it restored.
        previous_members: the worker ids of the world before.
        members: the worker ids of the world it joined, in rank order.
    """

    how: str
    generation: int
    resume_step: int
    previous_members: tuple[int, ...]
    members: tuple[int, ...]


@dataclasses.dataclass
class Statistics:
    """Live statistics of a `ResilientStep` (``step.statistics``)."""

    steps_run: int = 0
    mesh_shape: dict[str, int] = dataclasses.field(default_factory=dict)
    mesh_devices: tuple[int, ...] = ()
    spare_devices: tuple[int, ...] = ()
    dead_devices: tuple[int, ...] = ()
    # The newest snapshot's bytes and the cadence; across processes each step's snapshot
    # is this worker's shards published to its agent (with their header), every step, and
    # `snapshots_taken` counts the copies started (one in the background may still fail).
    snapshot_bytes: int = 0
    snapshot_every_steps: int = 0
    unreplicated_state: bool = False
    snapshot_bytes_by_entry: dict[str, int] = dataclasses.field(default_factory=dict)
    snapshots_taken: int = 0
    # Copies read from the packs the step wrote (`SnapshotOptions.pack_copies`): of the
    # snapshots taken in one process, or of the publishes to the agent across processes.
    snapshots_packed: int = 0
    snapshots_replaced: int = 0
    # One process: of `snapshot_bytes`, the leaves the step returns unchanged (a frozen
    # base), held once by both snapshots and copied again only when they change; and the
    # host memory the snapshots hold (each shared copy once).
    snapshot_shared_bytes: int = 0
    snapshot_host_bytes: int = 0
    # Older snapshots given up to copy changed shared leaves within a budget with room for
    # one copy of them (`SnapshotStore._give_up`).
    snapshots_given_up: int = 0
    snapshot_copy_median_s: float = 0.0
    grads_snapshot_step: int | None = None
    grads_snapshot_bytes: int = 0
    transient_retries: int = 0
    faults_during_recovery: int = 0
    corrupt_snapshots_detected: int = 0  # found corrupt when a recovery needed them
    corrupt_snapshots_scrubbed: int = 0  # found corrupt when retired (never needed)
    skipped_batches: list[int] = dataclasses.field(default_factory=list)
    snapshots_over_budget: bool = False  # host_memory_budget_bytes refused the snapshots
    jit_checkpoints: int = 0  # persistent checkpoints forced by memory pressure
    compiles: int = 0
    precompiled_meshes: int = 0  # executables compiled ahead of time so far
    # multi-process: candidate worlds' steps exported by process 0, taken here untraced
    exports_taken: int = 0
    math_changed: bool = False
    recoveries: list[RecoveryRecord] = dataclasses.field(default_factory=list)
    # multi-process: how this process came into a running job (its own ``recoveries`` are
    # the ones it ran since)
    joined: JoinRecord | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
