"""The discrete-event loop: one strategy, one job, one interruption stream.

State: running or recovering (a queue of timed phases), hosts missing from the job
(``down``), the spare pool, and the heap of hosts coming back from repair. Events: the next
interruption, the next host return, the end of the current phase, the horizon. Each
interval between events is booked to exactly one place (a phase's category, or the
strategy's running accounting), so the categories always sum to the horizon.

Assumptions (see WORKSPACE_NOTES.md, "Goodput simulator"):
  * An accelerator failure takes its whole host out of the job.
  * Missing hosts sit in distinct data-parallel replicas (exact while few are missing); a
    reduced mesh drops the damaged replicas or, within the job's memory headroom, narrows
    the model axis of every replica (`JobOptions.capacity`).
  * A failure during a recovery restarts that recovery (Daly's model); one during a wait
    for a replacement host joins the wait.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque

import numpy as np

from mnemojax._src.simulator import strategies as st
from mnemojax._src.simulator.config import SimulationOptions
from mnemojax._src.simulator.failures import InterruptionStream

_WAIT = (st.INFRA_RECOVERY, math.inf)  # waiting for a replacement host


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What one simulated job spent its time on.

    Attributes:
        strategy: strategy name.
        horizon_s: simulated wall time.
        seconds: category -> seconds (``productive`` and the badput categories); they sum
            to ``horizon_s``.
        failures: unexpected interruptions that hit the job.
        planned: planned stops taken.
        outages_s: duration of each outage, from the interruption to running again.
        grows: times a reduced mesh grew back.
        checkpoint_interval_s: the classical strategy's compute time between checkpoints.
    """

    strategy: str
    horizon_s: float
    seconds: dict[str, float]
    failures: int
    planned: int
    outages_s: tuple[float, ...]
    grows: int
    checkpoint_interval_s: float | None = None

    @property
    def goodput(self) -> float:
        return self.seconds[st.PRODUCTIVE] / self.horizon_s

    def fraction(self, category: str) -> float:
        return self.seconds[category] / self.horizon_s

    @property
    def mean_recovery_s(self) -> float:
        return float(np.mean(self.outages_s)) if self.outages_s else 0.0


def simulate_job(
    options: SimulationOptions, strategy_name: str, stream: InterruptionStream
) -> JobResult:
    """Runs one strategy over one interruption stream.

    Args:
        options: job, spares and strategy costs.
        strategy_name: ``"classical"``, ``"in_memory"`` or ``"mnemojax"``.
        stream: the interruptions (shared by the strategies being compared).

    Returns:
        The time accounting of the job.
    """
    strategy = st.make_strategy(strategy_name, options, stream.mtbf_s)
    job, spares = options.job, options.spares
    horizon = options.horizon_s
    hosts = job.hosts
    mode = getattr(strategy, "mode", "hot_spare")
    reduces = strategy.grows_in_place and mode != "hot_spare"
    # Hosts that may be missing while the job still runs (reduced mesh); 0: must wait.
    capacity = [1.0]  # by hosts down, while the job can run so (a wait is inserted above)
    while reduces and len(capacity) < hosts and (
            (share := job.capacity(len(capacity))) >= max(job.min_replica_fraction, 1e-12)):
        capacity.append(share)
    max_down = len(capacity) - 1
    infinite_pool = spares.spare_hosts is None
    pool = 0 if spares.spare_hosts is None else spares.spare_hosts
    returns: list[float] = []  # times at which a repaired/replacement host is available
    down = 0

    ledger: dict[str, float] = dict.fromkeys(st.CATEGORIES, 0.0)
    phases: deque[list] = deque()  # [category, remaining seconds]
    outage_start: float | None = None
    outages: list[float] = []
    failures = planned = grows = 0

    times, cats, is_planned, thin = stream.times_s, stream.category, stream.planned, stream.thin_u
    hosts_lost = [c.hosts_lost for c in stream.categories]
    n_events, i, t = len(times), 0, 0.0

    def start_recovery(new: list[st.Phase]) -> None:
        phases.clear()
        phases.extend([cat, s] for cat, s in new)

    while t < horizon:
        # A wait ends as soon as enough hosts are back.
        while phases and (phases[0][1] <= 0 or (phases[0][1] == math.inf and down <= max_down)):
            phases.popleft()
        if not phases and outage_start is not None:
            outages.append(t - outage_start)
            outage_start = None
        t_event = times[i] if i < n_events else math.inf
        t_return = returns[0] if returns else math.inf
        t_phase = t + phases[0][1] if phases else math.inf
        t_next = min(t_event, t_return, t_phase, horizon)
        dt = t_next - t
        if phases:
            phases[0][1] -= dt
            ledger[phases[0][0]] += dt
        else:
            strategy.advance(dt, capacity[down], ledger)
        t = t_next
        if t >= horizon:
            break
        if t_phase == t_next:
            phases[0][1] = 0.0
            continue
        if t_return == t_next:
            heapq.heappop(returns)
            if down > 0:
                down -= 1
                if not phases and strategy.grows_in_place:
                    grows += 1
                    start_recovery(strategy.recovery_phases("grow"))
            elif not infinite_pool:
                pool += 1
            continue
        # An interruption.
        k, i = i, i + 1
        if is_planned[k]:
            if phases:  # already stopped: the maintenance is absorbed
                continue
            planned += 1
            start_recovery(strategy.planned_phases())
            continue
        lost = hosts_lost[cats[k]]
        if lost and thin[k] < down / hosts:
            continue  # the faulty part sits in a host already out of the job
        failures += 1
        strategy.interrupt(ledger)
        if outage_start is None:
            outage_start = t
        if not lost:
            start_recovery(strategy.recovery_phases("restart"))
            if down > max_down:
                phases.insert(1, list(_WAIT))
            continue
        if not infinite_pool or mode == "reduced_mesh":
            heapq.heappush(returns, t + spares.replacement_delay_s)
        spare_free = mode != "reduced_mesh" and (infinite_pool or pool > 0)
        if spare_free:
            if not infinite_pool:
                pool -= 1
            kind = "replace"
        else:
            down += 1
            kind = "reduce" if down <= max_down else "replace"
        start_recovery(strategy.recovery_phases(kind))
        if down > max_down:
            phases.insert(1, list(_WAIT))

    if outage_start is not None:
        outages.append(horizon - outage_start)
    return JobResult(
        strategy=strategy.name,
        horizon_s=horizon,
        seconds=ledger,
        failures=failures,
        planned=planned,
        outages_s=tuple(outages),
        grows=grows,
        checkpoint_interval_s=getattr(strategy, "interval_s", None),
    )
