"""Runs the simulator over a grid of scales and MTBFs and averages over independent runs."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from mnemojax._src.simulator import strategies as st
from mnemojax._src.simulator.config import SimulationConfigError, SimulationOptions
from mnemojax._src.simulator.engine import JobResult, simulate_job
from mnemojax._src.simulator.failures import (
    InterruptionStream,
    TraceEvent,
    poisson_stream,
    trace_stream,
)

logger = logging.getLogger("mnemojax")

#: Default grid: 1k ... 128k accelerators (powers of two, 8 per host).
DEFAULT_SCALES = (1024, 4096, 16_384, 65_536, 131_072)


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One (scale, MTBF, strategy) cell, averaged over runs.

    Attributes:
        accelerators: job size.
        mtbf_accelerator_hours: per-accelerator MTBF (None for a trace).
        job_mtbf_h: the job's mean time between unexpected interruptions.
        strategy: strategy name.
        goodput: mean productive share of wall time.
        goodput_std: its standard deviation over runs (0 for a single run).
        badput: category -> mean share of wall time.
        mean_recovery_s: mean outage, interruption to running again.
        lost_work_h_per_day: lost progress, hours of whole-job time per day.
        failures_per_day: unexpected interruptions that hit the job, per day.
        checkpoint_interval_s: classical compute time between checkpoints.
        runs: number of runs averaged.
    """

    accelerators: int
    mtbf_accelerator_hours: float | None
    job_mtbf_h: float
    strategy: str
    goodput: float
    goodput_std: float
    badput: dict[str, float]
    mean_recovery_s: float
    lost_work_h_per_day: float
    failures_per_day: float
    checkpoint_interval_s: float | None
    runs: int


def _rng(seed: int, accelerators: int, mtbf_h: float | None, run: int) -> np.random.Generator:
    # Keyed on values, not grid positions: a cell's result does not depend on the rest of
    # the grid. PCG64 per the project's determinism rule.
    key = [seed, accelerators, round((mtbf_h or 0.0) * 1000), run]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(key)))


def _aggregate(
    results: Sequence[JobResult], accelerators: int, mtbf_h: float | None, job_mtbf_s: float
) -> GridPoint:
    days = results[0].horizon_s / 86400.0
    goodputs = np.array([r.goodput for r in results])
    outages = [o for r in results for o in r.outages_s]
    return GridPoint(
        accelerators=accelerators,
        mtbf_accelerator_hours=mtbf_h,
        job_mtbf_h=job_mtbf_s / 3600.0,
        strategy=results[0].strategy,
        goodput=float(goodputs.mean()),
        goodput_std=float(goodputs.std()),
        badput={c: float(np.mean([r.fraction(c) for r in results])) for c in st.BADPUT_CATEGORIES},
        mean_recovery_s=float(np.mean(outages)) if outages else 0.0,
        lost_work_h_per_day=float(np.mean([r.seconds[st.LOST_WORK] for r in results]))
        / 3600
        / days,
        failures_per_day=float(np.mean([r.failures for r in results])) / days,
        checkpoint_interval_s=results[0].checkpoint_interval_s,
        runs=len(results),
    )


def run_grid(
    base: SimulationOptions,
    *,
    scales: Sequence[int] = DEFAULT_SCALES,
    mtbf_accelerator_hours: Sequence[float] | None = None,
    strategies: Sequence[str] = st.STRATEGY_NAMES,
    runs: int = 1,
    trace: Sequence[TraceEvent] | None = None,
) -> list[GridPoint]:
    """Simulates every (scale, MTBF, strategy) cell.

    Args:
        base: options shared by all cells; ``job.accelerators`` and
            ``failures.mtbf_accelerator_hours`` are replaced per cell.
        scales: accelerator counts.
        mtbf_accelerator_hours: per-accelerator MTBFs; default ``base``'s. Ignored with a
            trace.
        strategies: strategy names.
        runs: independent runs (different failure streams) averaged per cell.
        trace: recorded interruptions used instead of the Poisson process.

    Returns:
        One `GridPoint` per cell, in grid order.

    Raises:
        SimulationConfigError: an invalid scale, MTBF, strategy or run count.
    """
    if not isinstance(runs, int) or runs < 1:
        raise SimulationConfigError(f"runs={runs!r} is invalid: expected an int >= 1")
    if not scales:
        raise SimulationConfigError("scales=() is invalid: expected at least one scale")
    for name in strategies:
        if name not in st.STRATEGY_NAMES:
            raise SimulationConfigError(
                f"strategy={name!r} is invalid: expected one of {', '.join(st.STRATEGY_NAMES)}"
            )
    mtbfs: list[float | None]
    if trace is not None:
        mtbfs = [None]
    else:
        mtbfs = list(mtbf_accelerator_hours or [base.failures.mtbf_accelerator_hours])
    points = []
    for n in scales:
        for mtbf_h in mtbfs:
            failures = base.failures
            if mtbf_h is not None:
                failures = dataclasses.replace(failures, mtbf_accelerator_hours=mtbf_h)
            options = dataclasses.replace(
                base, job=dataclasses.replace(base.job, accelerators=n), failures=failures
            )
            streams: list[InterruptionStream] = []
            for run in range(1 if trace is not None else runs):
                if trace is not None:
                    streams.append(
                        trace_stream(
                            trace,
                            hosts=options.job.hosts,
                            categories=failures.categories,
                            horizon_s=options.horizon_s,
                        )
                    )
                else:
                    streams.append(
                        poisson_stream(
                            _rng(base.seed, n, mtbf_h, run),
                            accelerators=n,
                            failures=failures,
                            horizon_s=options.horizon_s,
                        )
                    )
            for name in strategies:
                results = [simulate_job(options, name, s) for s in streams]
                points.append(_aggregate(results, n, mtbf_h, streams[0].mtbf_s))
                logger.debug("simulated %s at %d accelerators", name, n)
    return points
