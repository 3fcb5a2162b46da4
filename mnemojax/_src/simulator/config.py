"""Options of the goodput simulator: frozen, keyword-only dataclasses validated on construction.

Every duration is in seconds (fields named ``*_s``) unless the name says otherwise. Invalid
values raise `SimulationConfigError`, whose message names the field, the value and the legal
range.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from mnemojax._src.errors import SimulationConfigError

# Llama 3 405B pre-training (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.4):
# 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs.
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_PLANNED_INTERRUPTIONS = 47
#: Mean time between unexpected interruptions per accelerator (~50,677 accelerator-hours).
LLAMA3_MTBF_ACCELERATOR_HOURS = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_UNEXPECTED_INTERRUPTIONS
#: Planned (maintenance) interruptions per day of the whole job in the same snapshot.
LLAMA3_PLANNED_PER_DAY = LLAMA3_PLANNED_INTERRUPTIONS / LLAMA3_DAYS

MnemojaxMode = Literal["auto", "hot_spare", "reduced_mesh"]
IntervalRule = Literal["young", "daly"]
_MODES = ("auto", "hot_spare", "reduced_mesh")
_RULES = ("young", "daly")


def _check(cond: bool, name: str, value: object, legal: str) -> None:
    if not cond:
        raise SimulationConfigError(f"{name}={value!r} is invalid: expected {legal}")


def _positive(name: str, value: float) -> None:
    _check(
        isinstance(value, int | float) and math.isfinite(value) and value > 0,
        name,
        value,
        "a finite number > 0",
    )


def _non_negative(name: str, value: float) -> None:
    _check(
        isinstance(value, int | float) and math.isfinite(value) and value >= 0,
        name,
        value,
        "a finite number >= 0",
    )


def _fraction(name: str, value: float, *, upper_open: bool = False) -> None:
    ok = isinstance(value, int | float) and value >= 0 and (value < 1 if upper_open else value <= 1)
    _check(ok, name, value, "a number in [0, 1)" if upper_open else "a number in [0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailureCategory:
    """One root-cause category of unexpected interruptions.

    Attributes:
        name: short identifier, also the ``category`` column of a trace file.
        fraction: share of all unexpected interruptions.
        hosts_lost: hosts the job loses (0: software fault, the hardware stays in the job;
            1: the host holding the faulty part leaves the job until replaced).
    """

    name: str
    fraction: float
    hosts_lost: int = 1

    def __post_init__(self):
        _check(bool(self.name) and "," not in self.name, "name", self.name, "a non-empty word")
        _fraction(f"{self.name}.fraction", self.fraction)
        _check(self.hosts_lost in (0, 1), f"{self.name}.hosts_lost", self.hosts_lost, "0 or 1")


def _llama3(name: str, count: int, hosts_lost: int = 1) -> FailureCategory:
    return FailureCategory(
        name=name, fraction=count / LLAMA3_UNEXPECTED_INTERRUPTIONS, hosts_lost=hosts_lost
    )


#: Llama 3 405B root causes (Table 5 of the report), grouped. Counts out of 419.
LLAMA3_CATEGORIES: tuple[FailureCategory, ...] = (
    _llama3("faulty_gpu", 148),  # 30.1 %
    _llama3("gpu_hbm", 72),  # 17.2 %
    _llama3("software", 54 + 2, hosts_lost=0),  # software bug + dependency, 13.4 %
    _llama3("network", 35),  # switch / cable, 8.4 %
    _llama3("gpu_other", 19 + 17 + 6 + 6),  # SRAM, GSP, silent data corruption, thermal
    _llama3("host_other", 32 + 7 + 7 + 3 + 3 + 2 + 2 + 2 + 2),  # maintenance, NIC, NCCL, ...
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobOptions:
    """The simulated training job and its hardware.

    Attributes:
        accelerators: accelerators in the job (a multiple of ``accelerators_per_host``).
        accelerators_per_host: accelerators per host; a failed accelerator takes its host out.
        hosts_per_replica: hosts in one data-parallel replica; a reduced mesh drops whole
            replicas, so losing one host removes ``1 / replicas`` of the throughput (or
            narrows the model axis, within ``model_shrink_headroom``).
        step_time_s: time of one training step at full size (lost work of the snapshot
            strategies is bounded by it).
        state_bytes_per_host: training state (params + optimizer) held per host; it is what
            a hot spare or a restarted job pulls from peer memory.
        host_bandwidth_bytes_per_s: per-host network bandwidth for that state transfer.
        min_replica_fraction: a reduced mesh never runs on less than this share of the full
            mesh's throughput (of its replicas, when whole replicas are dropped); below it
            the job waits for a replacement host.
        model_shrink_headroom: how many times its full-mesh share of the state a device can
            hold. Above 1, a reduced mesh may instead keep every replica on a narrower model
            axis (`capacity`): a replica of ``hosts_per_replica`` hosts that lost one goes on
            on the widest divisor of its width it still has, if the share that grows by
            (full width / new width) fits. 1 (default): only whole replicas are dropped, so
            a job whose one replica spans every host waits for a replacement.
    """

    accelerators: int
    accelerators_per_host: int = 8
    hosts_per_replica: int = 1
    step_time_s: float = 6.0
    state_bytes_per_host: float = 3.2e9
    host_bandwidth_bytes_per_s: float = 25e9
    min_replica_fraction: float = 0.5
    model_shrink_headroom: float = 1.0

    def __post_init__(self):
        _check(
            isinstance(self.accelerators_per_host, int) and self.accelerators_per_host >= 1,
            "accelerators_per_host",
            self.accelerators_per_host,
            "an int >= 1",
        )
        _check(
            isinstance(self.accelerators, int)
            and self.accelerators >= self.accelerators_per_host
            and self.accelerators % self.accelerators_per_host == 0,
            "accelerators",
            self.accelerators,
            f"a positive multiple of accelerators_per_host={self.accelerators_per_host}",
        )
        _check(
            isinstance(self.hosts_per_replica, int)
            and self.hosts_per_replica >= 1
            and self.hosts % self.hosts_per_replica == 0,
            "hosts_per_replica",
            self.hosts_per_replica,
            f"an int >= 1 that divides the {self.hosts} hosts",
        )
        _positive("step_time_s", self.step_time_s)
        _non_negative("state_bytes_per_host", self.state_bytes_per_host)
        _positive("host_bandwidth_bytes_per_s", self.host_bandwidth_bytes_per_s)
        _fraction("min_replica_fraction", self.min_replica_fraction)
        _check(
            isinstance(self.model_shrink_headroom, int | float)
            and math.isfinite(self.model_shrink_headroom)
            and self.model_shrink_headroom >= 1,
            "model_shrink_headroom",
            self.model_shrink_headroom,
            "a finite number >= 1",
        )

    @property
    def hosts(self) -> int:
        return self.accelerators // self.accelerators_per_host

    def capacity(self, down: int) -> float:
        """The share of full throughput a reduced mesh keeps with ``down`` hosts missing
        (each in a different replica while there are replicas to spread them over): the
        better of dropping the damaged replicas and, within ``model_shrink_headroom``,
        keeping every replica on a narrower model axis, as mnemojax's planner picks the
        axis that keeps the most devices."""
        replicas, width = self.replicas, self.hosts_per_replica
        if down <= 0:
            return 1.0
        best = max(replicas - down, 0) / replicas
        left = width - math.ceil(down / replicas)  # hosts of the most damaged replica
        narrowest = max(math.ceil(width / self.model_shrink_headroom), 1)
        for w in range(left, narrowest - 1, -1):  # the widest divisor that fits
            if width % w == 0:
                return max(best, w / width)
        return best

    @property
    def replicas(self) -> int:
        return self.hosts // self.hosts_per_replica

    @property
    def transfer_s(self) -> float:
        """Seconds to move one host's state over its network link."""
        return self.state_bytes_per_host / self.host_bandwidth_bytes_per_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class FailureOptions:
    """Where interruptions come from (a Poisson process per accelerator-hour).

    Attributes:
        mtbf_accelerator_hours: mean time between unexpected interruptions of one
            accelerator; the job's MTBF is this divided by the accelerator count. Default:
            the Llama 3 405B rate (~50,677 h: 419 interruptions, 54 days, 16,384 GPUs).
        categories: root-cause mix; the fractions must sum to 1.
        planned_per_day: planned, job-wide maintenance stops per day (Llama 3: 47 in 54 days,
            ~0.87); 0 disables them. Every strategy checkpoints and restarts for them.
    """

    mtbf_accelerator_hours: float = LLAMA3_MTBF_ACCELERATOR_HOURS
    categories: tuple[FailureCategory, ...] = LLAMA3_CATEGORIES
    planned_per_day: float = 0.0

    def __post_init__(self):
        _positive("mtbf_accelerator_hours", self.mtbf_accelerator_hours)
        _check(len(self.categories) > 0, "categories", self.categories, "at least one category")
        names = [c.name for c in self.categories]
        _check(len(set(names)) == len(names), "categories", names, "unique names")
        total = sum(c.fraction for c in self.categories)
        _check(abs(total - 1) < 1e-6, "sum of category fractions", total, "1.0")
        _non_negative("planned_per_day", self.planned_per_day)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpareOptions:
    """The pool of spare hosts.

    Attributes:
        spare_hosts: spare hosts ready to join; ``None`` is an unlimited pool (the
            scheduler always finds a healthy host, and a failed host is replaced at once).
        replacement_delay_s: time until a failed host is repaired or replaced and back in
            the pool (also how long a reduced mesh runs before it can grow back).
    """

    spare_hosts: int | None = None
    replacement_delay_s: float = 4 * 3600.0

    def __post_init__(self):
        _check(
            self.spare_hosts is None
            or (isinstance(self.spare_hosts, int) and self.spare_hosts >= 0),
            "spare_hosts",
            self.spare_hosts,
            "None (unlimited) or an int >= 0",
        )
        _positive("replacement_delay_s", self.replacement_delay_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestartCosts:
    """A full restart of every process of the job (classical and in-memory strategies).

    Attributes:
        detect_s: fault to the job being torn down (collective timeouts, health checks).
        startup_s: relaunch: schedule onto a healthy host set, start processes,
            initialise the distributed runtime ("program startup" badput).
        compile_s: compile the step again (persistent compilation cache warm).
    """

    detect_s: float = 60.0
    startup_s: float = 180.0
    compile_s: float = 60.0

    def __post_init__(self):
        for name in ("detect_s", "startup_s", "compile_s"):
            _non_negative(name, getattr(self, name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassicalOptions:
    """Strategy 1: periodic persistent checkpoints and a full restart from the last one.

    Attributes:
        restart: full-restart costs.
        checkpoint_save_s: training time blocked by one checkpoint save.
        checkpoint_restore_s: reading the checkpoint back after a restart.
        interval_s: compute time between checkpoints; ``None`` uses the optimum of
            ``interval_rule`` for the job's MTBF.
        interval_rule: ``"young"`` (sqrt(2 delta M), Young 1974) or ``"daly"`` (Daly 2006
            higher-order estimate).
    """

    restart: RestartCosts = RestartCosts()
    checkpoint_save_s: float = 30.0
    checkpoint_restore_s: float = 60.0
    interval_s: float | None = None
    interval_rule: IntervalRule = "young"

    def __post_init__(self):
        _positive("checkpoint_save_s", self.checkpoint_save_s)
        _non_negative("checkpoint_restore_s", self.checkpoint_restore_s)
        if self.interval_s is not None:
            _positive("interval_s", self.interval_s)
        _check(self.interval_rule in _RULES, "interval_rule", self.interval_rule, str(_RULES))


@dataclasses.dataclass(frozen=True, kw_only=True)
class InMemoryOptions:
    """Strategy 2: in-memory checkpoints in peer hosts' CPU memory plus a full restart
    (Gemini-like: Wang et al., SOSP 2023).

    Attributes:
        restart: full-restart costs.
        snapshot_every_steps: steps between in-memory checkpoints.
        snapshot_overhead_frac: steady-state share of step time spent on them.
        restore_fixed_s: fixed part of the restore (load into accelerator memory); the
            transfer of one host's state from a peer is added.
    """

    restart: RestartCosts = RestartCosts()
    snapshot_every_steps: int = 1
    snapshot_overhead_frac: float = 0.01
    restore_fixed_s: float = 10.0

    def __post_init__(self):
        _check(
            isinstance(self.snapshot_every_steps, int) and self.snapshot_every_steps >= 1,
            "snapshot_every_steps",
            self.snapshot_every_steps,
            "an int >= 1",
        )
        _fraction("snapshot_overhead_frac", self.snapshot_overhead_frac, upper_open=True)
        _non_negative("restore_fixed_s", self.restore_fixed_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MnemojaxOptions:
    """Strategy 3: mnemojax. Survivors keep running in-process on a reduced mesh or with a
    hot spare, from a host-memory snapshot (at most one step lost).

    Phase costs default to plausible at-scale values and are replaced by the measured ones
    of ``mnemojax bench`` when its JSON is given (see ``bench.py``).

    Attributes:
        detect_s: fault to every survivor knowing it (heartbeat / collective timeout).
        agree_s: survivors agree on the live set.
        plan_s: plan the reduced or repaired mesh.
        reshard_fixed_s: fixed part of resharding; moving one host's state over the
            network (``JobOptions.transfer_s``) is added.
        compile_s: fetch the executable for the new mesh (compiled ahead of time).
        process_restart_s: a software fault kills processes; they restart in place and
            restore from the host-memory copy that the per-host agent kept.
        snapshot_every_steps: steps between host-memory snapshots.
        snapshot_overhead_frac: steady-state share of step time the snapshots cost.
        mode: ``"auto"`` uses a hot spare when one is free, else a reduced mesh;
            ``"hot_spare"`` waits for a spare; ``"reduced_mesh"`` never hot-swaps and grows
            back when the failed host's replacement arrives.
    """

    detect_s: float = 10.0
    agree_s: float = 1.0
    plan_s: float = 0.5
    reshard_fixed_s: float = 1.0
    compile_s: float = 5.0
    process_restart_s: float = 60.0
    snapshot_every_steps: int = 1
    snapshot_overhead_frac: float = 0.01
    mode: MnemojaxMode = "auto"

    def __post_init__(self):
        for name in (
            "detect_s",
            "agree_s",
            "plan_s",
            "reshard_fixed_s",
            "compile_s",
            "process_restart_s",
        ):
            _non_negative(name, getattr(self, name))
        _check(
            isinstance(self.snapshot_every_steps, int) and self.snapshot_every_steps >= 1,
            "snapshot_every_steps",
            self.snapshot_every_steps,
            "an int >= 1",
        )
        _fraction("snapshot_overhead_frac", self.snapshot_overhead_frac, upper_open=True)
        _check(self.mode in _MODES, "mode", self.mode, "one of " + ", ".join(_MODES))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimulationOptions:
    """One simulated job: hardware, failures, spares, the three strategies' costs.

    Attributes:
        job: the job and its hardware.
        failures: failure process.
        spares: spare host pool.
        classical: strategy 1 costs.
        in_memory: strategy 2 costs.
        mnemojax: strategy 3 costs.
        days: simulated wall-clock length of the job.
        seed: seed of the random failure process (results are deterministic for a seed).
    """

    job: JobOptions
    failures: FailureOptions = FailureOptions()
    spares: SpareOptions = SpareOptions()
    classical: ClassicalOptions = ClassicalOptions()
    in_memory: InMemoryOptions = InMemoryOptions()
    mnemojax: MnemojaxOptions = MnemojaxOptions()
    days: float = 30.0
    seed: int = 0

    def __post_init__(self):
        _positive("days", self.days)
        _check(isinstance(self.seed, int) and self.seed >= 0, "seed", self.seed, "an int >= 0")

    @property
    def horizon_s(self) -> float:
        return self.days * 86400.0

    @property
    def job_mtbf_s(self) -> float:
        """Mean time between unexpected interruptions of the whole job."""
        return self.failures.mtbf_accelerator_hours * 3600.0 / self.job.accelerators
