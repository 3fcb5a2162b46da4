"""Interruption streams: a Poisson process per accelerator-hour, or a trace file.

A stream is a few sorted numpy arrays (time, category, planned flag, thinning draw), built
once per (scale, MTBF, run) and shared by every strategy, so strategies are compared on the
same failures (common random numbers).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import pathlib
from collections.abc import Iterable, Mapping

import numpy as np

from mnemojax._src.simulator.config import FailureCategory, FailureOptions, SimulationConfigError

logger = logging.getLogger("mnemojax")

PLANNED = "planned"


@dataclasses.dataclass(frozen=True)
class InterruptionStream:
    """Interruptions of one job, sorted by time.

    Attributes:
        times_s: when each interruption happens (seconds from the job start).
        category: index into ``categories`` (ignored for planned events).
        planned: True for a planned, job-wide maintenance stop.
        thin_u: uniform draw in [0, 1); an unexpected event whose host is already out of the
            job (probability ``hosts_out / hosts``) is dropped. Trace events use 1.0: a
            recorded failure always hit the job.
        categories: the root-cause categories.
        mtbf_s: mean time between unexpected interruptions of the job.
    """

    times_s: np.ndarray
    category: np.ndarray
    planned: np.ndarray
    thin_u: np.ndarray
    categories: tuple[FailureCategory, ...]
    mtbf_s: float

    def __len__(self) -> int:
        return len(self.times_s)


def _merge_planned(
    rng: np.random.Generator, stream: InterruptionStream, planned_per_day: float, horizon_s: float
) -> InterruptionStream:
    if planned_per_day <= 0:
        return stream
    period = 86400.0 / planned_per_day
    planned_t = np.arange(rng.uniform(0.0, period), horizon_s, period)
    times = np.concatenate([stream.times_s, planned_t])
    order = np.argsort(times, kind="stable")
    n = len(planned_t)
    return dataclasses.replace(
        stream,
        times_s=times[order],
        category=np.concatenate([stream.category, np.zeros(n, np.int64)])[order],
        planned=np.concatenate([stream.planned, np.ones(n, bool)])[order],
        thin_u=np.concatenate([stream.thin_u, np.ones(n)])[order],
    )


def poisson_stream(
    rng: np.random.Generator, *, accelerators: int, failures: FailureOptions, horizon_s: float
) -> InterruptionStream:
    """Exponential inter-arrival times at ``accelerators / MTBF`` per job, plus planned stops.

    Args:
        rng: the run's generator (``numpy.random.Generator(PCG64(seed))``).
        accelerators: accelerators in the job.
        failures: the failure model.
        horizon_s: length of the simulated job.

    Returns:
        The job's interruption stream.
    """
    mtbf_s = failures.mtbf_accelerator_hours * 3600.0 / accelerators
    n = int(rng.poisson(horizon_s / mtbf_s))
    # Given their count, the arrivals of a Poisson process are uniform order statistics.
    times = np.sort(rng.uniform(0.0, horizon_s, n))
    probs = np.array([c.fraction for c in failures.categories], dtype=float)
    category = rng.choice(len(probs), size=n, p=probs / probs.sum())
    stream = InterruptionStream(
        times_s=times,
        category=category.astype(np.int64),
        planned=np.zeros(n, bool),
        thin_u=rng.random(n),
        categories=failures.categories,
        mtbf_s=mtbf_s,
    )
    return _merge_planned(rng, stream, failures.planned_per_day, horizon_s)


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One recorded interruption: ``time_hours`` from the job start, optional host, category."""

    time_hours: float
    category: str
    host: int | None = None


def load_trace(path: str | pathlib.Path) -> list[TraceEvent]:
    """Reads a failure trace.

    CSV: a header row with ``time_hours`` and ``category`` and optionally ``host`` or
    ``accelerator`` (a host is ``accelerator // accelerators_per_host``; the simulator
    resolves it). JSON: a list of objects with the same keys, or ``{"events": [...]}``.
    Categories are the names of `FailureOptions.categories` or ``"planned"``.

    Raises:
        SimulationConfigError: unreadable file, missing column, or a bad value (the message
            names the row).
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SimulationConfigError(f"trace={str(path)!r} is invalid: cannot read it ({e})") from e
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SimulationConfigError(f"trace={str(path)!r} is not valid JSON: {e}") from e
        rows = data.get("events") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise SimulationConfigError(
                f"trace={str(path)!r} is invalid: expected a list of events or {{'events': [...]}}"
            )
    else:
        rows = list(csv.DictReader(text.splitlines()))
    return [_parse_row(i, row) for i, row in enumerate(rows, start=1)]


def _parse_row(i: int, row: object) -> TraceEvent:
    if not isinstance(row, Mapping):
        raise SimulationConfigError(f"trace event {i}={row!r} is invalid: expected an object")
    row = {str(k).strip(): v for k, v in row.items()}
    for key in ("time_hours", "category"):
        if row.get(key) in (None, ""):
            raise SimulationConfigError(f"trace event {i} has no {key!r}: {row!r}")
    try:
        t = float(row["time_hours"])
    except (TypeError, ValueError):
        t = math.nan
    if not (math.isfinite(t) and t >= 0):
        raise SimulationConfigError(
            f"trace event {i}: time_hours={row['time_hours']!r} is invalid: expected a number >= 0"
        )
    host = None
    for key, per in (("host", 1), ("accelerator", 8)):
        if row.get(key) not in (None, ""):
            try:
                value = int(row[key])
            except (TypeError, ValueError):
                value = -1
            if value < 0:
                raise SimulationConfigError(
                    f"trace event {i}: {key}={row[key]!r} is invalid: expected an int >= 0"
                )
            # Accelerators are resolved with the default 8 per host here; `trace_stream`
            # checks the host against the job size.
            host = value // per
            break
    return TraceEvent(time_hours=t, category=str(row["category"]).strip(), host=host)


def trace_stream(
    events: Iterable[TraceEvent],
    *,
    hosts: int,
    categories: tuple[FailureCategory, ...],
    horizon_s: float,
) -> InterruptionStream:
    """Turns trace events into an interruption stream for a job of ``hosts`` hosts.

    Raises:
        SimulationConfigError: a host outside ``[0, hosts)`` or an unknown category.
    """
    events = list(events)
    index = {c.name: i for i, c in enumerate(categories)}
    times, cats, planned = [], [], []
    for i, ev in enumerate(events, start=1):
        if ev.category != PLANNED and ev.category not in index:
            raise SimulationConfigError(
                f"trace event {i}: category={ev.category!r} is invalid: expected one of "
                + ", ".join([*index, PLANNED])
            )
        if ev.host is not None and ev.host >= hosts:
            raise SimulationConfigError(
                f"trace event {i}: host={ev.host} is invalid: expected 0 <= host < {hosts}"
            )
        t = ev.time_hours * 3600.0
        if t >= horizon_s:
            continue
        times.append(t)
        cats.append(index.get(ev.category, 0))
        planned.append(ev.category == PLANNED)
    order = np.argsort(np.asarray(times, float), kind="stable")
    times_a = np.asarray(times, float)[order]
    planned_a = np.asarray(planned, bool)[order]
    n_unexpected = int((~planned_a).sum())
    if len(times_a) < len(events):
        logger.info(
            "trace: %d events fall after the %.1f-day horizon and are ignored",
            len(events) - len(times_a),
            horizon_s / 86400,
        )
    return InterruptionStream(
        times_s=times_a,
        category=np.asarray(cats, np.int64)[order],
        planned=planned_a,
        thin_u=np.ones(len(times_a)),
        categories=categories,
        mtbf_s=horizon_s / n_unexpected if n_unexpected else math.inf,
    )
