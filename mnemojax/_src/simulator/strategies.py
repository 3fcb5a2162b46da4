"""Cost model of each recovery strategy, and the Young/Daly checkpoint-interval formulas.

A strategy does two things for the engine:
  * accounts running time: how much of it is productive, spent saving checkpoints or
    snapshots, or lost to a reduced mesh, and how much progress is not yet saved;
  * lists the timed phases of a recovery (or of a planned stop, or of growing a reduced
    mesh back), each booked to one badput category.

Categories follow the goodput vocabulary of ml-goodput-measurement.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

from mnemojax._src.simulator.config import SimulationConfigError, SimulationOptions

PRODUCTIVE = "productive"
STARTUP = "startup"  # program startup / restart
CHECKPOINT_SAVE = "checkpoint_save"
CHECKPOINT_RESTORE = "checkpoint_restore"
LOST_WORK = "lost_work"  # wasted progress from disruption
INFRA_RECOVERY = "infra_recovery"  # detection, reconfiguration, compile, waiting for a host
SNAPSHOT_OVERHEAD = "snapshot_overhead"  # steady-state in-memory snapshot cost
DEGRADED = "degraded"  # capacity missing while running on a reduced mesh
BADPUT_CATEGORIES = (
    STARTUP,
    CHECKPOINT_SAVE,
    CHECKPOINT_RESTORE,
    LOST_WORK,
    INFRA_RECOVERY,
    SNAPSHOT_OVERHEAD,
    DEGRADED,
)
CATEGORIES = (PRODUCTIVE, *BADPUT_CATEGORIES)

#: What a recovery must do: restart processes on the same hosts (software fault), bring
#: in a replacement host, continue on a reduced mesh, or grow a reduced mesh back.
RecoveryKind = Literal["restart", "replace", "reduce", "grow"]
Phase = tuple[str, float]  # (badput category, seconds)

STRATEGY_NAMES = ("classical", "in_memory", "mnemojax")


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974) optimum compute time between checkpoints: sqrt(2 delta M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum (his eq. 37); M when delta >= 2M."""
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def first_order_waste(
    interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """Young's first-order wasted fraction: delta/tau + tau/(2M) + R/M."""
    return checkpoint_s / interval_s + interval_s / (2.0 * mtbf_s) + restart_s / mtbf_s


def exponential_waste(
    interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """Exact expected wasted fraction for exponential failures (Daly 2006, eq. 13).

    Expected wall time per ``tau`` of work is ``M e^{R/M} (e^{(tau+delta)/M} - 1)``, with
    failures allowed during the save and during the restart (which then starts over).
    """
    wall = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + checkpoint_s) / mtbf_s)
    return 1.0 - interval_s / wall


class Strategy(Protocol):
    """What the engine needs from a strategy. ``ledger`` maps category -> seconds."""

    name: str
    grows_in_place: bool  # can continue on a reduced mesh and grow back

    def advance(self, dt: float, capacity: float, ledger: dict[str, float]) -> None: ...

    def interrupt(self, ledger: dict[str, float]) -> None: ...

    def recovery_phases(self, kind: RecoveryKind) -> list[Phase]: ...

    def planned_phases(self) -> list[Phase]: ...


class _Base:
    def __init__(self, options: SimulationOptions):
        c = options.classical
        # A planned stop is a checkpointed full restart for every strategy (firmware
        # updates reboot hosts, so host memory does not survive it).
        self._planned = [
            (CHECKPOINT_SAVE, c.checkpoint_save_s),
            (STARTUP, c.restart.startup_s),
            (INFRA_RECOVERY, c.restart.compile_s),
            (CHECKPOINT_RESTORE, c.checkpoint_restore_s),
        ]
        self.uncommitted = 0.0  # progress since the last saved state (productive seconds)

    def interrupt(self, ledger: dict[str, float]) -> None:
        ledger[PRODUCTIVE] -= self.uncommitted
        ledger[LOST_WORK] += self.uncommitted
        self._reset()

    def planned_phases(self) -> list[Phase]:
        self._reset()  # the stop checkpoints first: nothing is lost
        return list(self._planned)

    def _reset(self) -> None:
        self.uncommitted = 0.0


class Classical(_Base):
    """Periodic blocking checkpoints every ``interval_s`` of compute; full restart."""

    name = "classical"
    grows_in_place = False

    def __init__(self, options: SimulationOptions, mtbf_s: float):
        super().__init__(options)
        c = options.classical
        self.save_s = c.checkpoint_save_s
        if c.interval_s is not None:
            self.interval_s = c.interval_s
        elif c.interval_rule == "daly":
            self.interval_s = daly_interval_s(self.save_s, mtbf_s)
        else:
            self.interval_s = young_interval_s(self.save_s, mtbf_s)
        self.pos = 0.0  # position in the current (work, save) cycle
        r = c.restart
        self._recovery = [
            (INFRA_RECOVERY, r.detect_s),
            (STARTUP, r.startup_s),
            (INFRA_RECOVERY, r.compile_s),
            (CHECKPOINT_RESTORE, c.checkpoint_restore_s),
        ]

    def _work_until(self, x: float) -> float:
        period = self.interval_s + self.save_s
        return math.floor(x / period) * self.interval_s + min(x % period, self.interval_s)

    def advance(self, dt: float, capacity: float, ledger: dict[str, float]) -> None:
        period = self.interval_s + self.save_s
        end = self.pos + dt
        work = self._work_until(end) - self._work_until(self.pos)
        ledger[PRODUCTIVE] += work
        ledger[CHECKPOINT_SAVE] += dt - work
        if end >= period:  # at least one save completed: only work after it is at risk
            self.uncommitted = min(end % period, self.interval_s)
        else:
            self.uncommitted += work
        self.pos = end % period

    def _reset(self) -> None:
        super()._reset()
        self.pos = 0.0

    def recovery_phases(self, kind: RecoveryKind) -> list[Phase]:
        return list(self._recovery)


class _Snapshotting(_Base):
    """Snapshots every k steps at a steady-state overhead; progress since the last one is lost."""

    def __init__(self, options: SimulationOptions, every_steps: int, overhead_frac: float):
        super().__init__(options)
        self.snapshot_interval = every_steps * options.job.step_time_s
        self.overhead = overhead_frac

    def advance(self, dt: float, capacity: float, ledger: dict[str, float]) -> None:
        # A reduced mesh keeps the global batch (gradient accumulation), so a step takes
        # 1/capacity longer: progress runs at `capacity`, the rest is degraded badput.
        useful = dt * capacity
        ledger[DEGRADED] += dt - useful
        ledger[SNAPSHOT_OVERHEAD] += useful * self.overhead
        work = useful * (1.0 - self.overhead)
        ledger[PRODUCTIVE] += work
        self.uncommitted = (self.uncommitted + work) % self.snapshot_interval


class InMemory(_Snapshotting):
    """Gemini-like: in-memory checkpoints in peers' CPU memory, but a full restart."""

    name = "in_memory"
    grows_in_place = False

    def __init__(self, options: SimulationOptions, mtbf_s: float):
        m = options.in_memory
        super().__init__(options, m.snapshot_every_steps, m.snapshot_overhead_frac)
        r = m.restart
        self._recovery = [
            (INFRA_RECOVERY, r.detect_s),
            (STARTUP, r.startup_s),
            (INFRA_RECOVERY, r.compile_s),
            (CHECKPOINT_RESTORE, m.restore_fixed_s + options.job.transfer_s),
        ]

    def recovery_phases(self, kind: RecoveryKind) -> list[Phase]:
        return list(self._recovery)


class Mnemojax(_Snapshotting):
    """Survivors stay up: reduced mesh or hot spare, snapshot in host memory."""

    name = "mnemojax"
    grows_in_place = True

    def __init__(self, options: SimulationOptions, mtbf_s: float):
        m = options.mnemojax
        super().__init__(options, m.snapshot_every_steps, m.snapshot_overhead_frac)
        self.mode = m.mode
        reconfigure = [
            (INFRA_RECOVERY, m.agree_s),
            (INFRA_RECOVERY, m.plan_s),
            # Moving state onto the new mesh is mnemojax's restore.
            (CHECKPOINT_RESTORE, m.reshard_fixed_s + options.job.transfer_s),
            (INFRA_RECOVERY, m.compile_s),
        ]
        self._phases: dict[str, list[Phase]] = {
            "replace": [(INFRA_RECOVERY, m.detect_s), *reconfigure],
            "reduce": [(INFRA_RECOVERY, m.detect_s), *reconfigure],
            "grow": reconfigure,
            "restart": [
                (INFRA_RECOVERY, m.detect_s),
                (STARTUP, m.process_restart_s),
                (INFRA_RECOVERY, m.compile_s),
                (CHECKPOINT_RESTORE, m.reshard_fixed_s),  # local copy from the host agent
            ],
        }

    def recovery_phases(self, kind: RecoveryKind) -> list[Phase]:
        return list(self._phases[kind])


def make_strategy(name: str, options: SimulationOptions, mtbf_s: float) -> Strategy:
    """Builds a fresh strategy (with its own accounting state) by name."""
    classes = {"classical": Classical, "in_memory": InMemory, "mnemojax": Mnemojax}
    if name not in classes:
        raise SimulationConfigError(
            f"strategy={name!r} is invalid: expected one of {', '.join(STRATEGY_NAMES)}"
        )
    return classes[name](options, mtbf_s)
