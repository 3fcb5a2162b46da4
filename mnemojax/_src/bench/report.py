"""Offline goodput accounting of a JSONL event log (`mnemojax._src.events` schema).

Pure Python: no JAX import, so ``mnemojax report`` renders any run's log anywhere.

Per run (events grouped by their ``run`` field), wall time runs from ``run_start`` (or
the start of the earliest event) to the last event. Every event with a duration is booked
to one category:

====================  ==========================================================
category              events
====================  ==========================================================
productive            ``step`` (not ``replay``)
wasted_progress       ``step`` with ``replay: true``, ``wasted_progress``
startup               ``startup`` (imports, init, compile)
checkpoint_save       ``checkpoint_save`` (its blocking part)
checkpoint_restore    ``checkpoint_restore``
infra_recovery        ``recovery_phase`` (detect, plan, reshard, compile)
restart               ``restart`` (detection and relaunch of a whole job)
snapshot              ``snapshot`` with ``blocking: true`` (background copies are free)
other                 the rest of the wall time (unaccounted: waits, Python, I/O)
====================  ==========================================================

Goodput % = productive / wall; each badput % = its seconds / wall; they sum to 100 %
unless booked events overlap (then ``other`` is 0 and ``overlap_s`` says by how much).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from mnemojax._src.events import read_events

BADPUT = ("startup", "checkpoint_save", "checkpoint_restore", "infra_recovery",
          "wasted_progress", "restart", "snapshot", "other")


@dataclasses.dataclass
class RunAccount:
    """Goodput accounting of one run.

    Attributes:
        run: the run id.
        start / end: unix seconds of the run's first and last instant.
        productive_s: seconds of productive (non-replay) steps.
        badput_s: seconds per badput category (`BADPUT`).
        steps: the highest step reached.
        faults: number of ``fault`` events.
        overlap_s: booked seconds beyond the wall time (0 for a consistent log).
        timeline: (seconds since start, step) per step event.
        faults_at: (seconds since start, step or None) per fault event.
    """

    run: str
    start: float
    end: float
    productive_s: float = 0.0
    badput_s: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(BADPUT, 0.0))
    steps: int = 0
    faults: int = 0
    overlap_s: float = 0.0
    timeline: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    faults_at: list[tuple[float, int | None]] = dataclasses.field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def goodput_pct(self) -> float:
        return 100.0 * self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def badput_pct(self) -> dict[str, float]:
        w = self.wall_s
        return {k: (100.0 * v / w if w > 0 else 0.0) for k, v in self.badput_s.items()}

    def as_dict(self) -> dict:
        return {"run": self.run, "wall_s": self.wall_s, "productive_s": self.productive_s,
                "goodput_pct": self.goodput_pct, "badput_s": dict(self.badput_s),
                "badput_pct": self.badput_pct, "steps": self.steps, "faults": self.faults,
                "overlap_s": self.overlap_s}


def group_by_run(events: Iterable[dict]) -> dict[str, list[dict]]:
    """Events per run id, in time order (first-seen order of runs)."""
    runs: dict[str, list[dict]] = {}
    for e in events:
        runs.setdefault(str(e.get("run", "")), []).append(e)
    return {k: sorted(v, key=lambda e: e.get("time", 0.0)) for k, v in runs.items()}


def _category(e: dict) -> str | None:
    kind = e.get("kind")
    if kind == "step":
        return "wasted_progress" if e.get("replay") else "productive"
    if kind == "recovery_phase":
        return "infra_recovery"
    if kind == "snapshot":
        return "snapshot" if e.get("blocking") else None
    if kind == "checkpoint_save":
        return "checkpoint_save" if e.get("blocking", True) else None
    if kind in ("startup", "checkpoint_restore", "wasted_progress", "restart"):
        return kind
    return None  # run_start, run_end, fault, recovery (a summary), preemption


def account(events: list[dict]) -> RunAccount:
    """Books one run's events (all of the same run) into goodput and badput seconds."""
    if not events:
        raise ValueError("events=[] is invalid: expected the events of one run")
    starts = [e["time"] for e in events if e.get("kind") == "run_start"]
    start = min(starts) if starts else min(e["time"] - (e.get("duration_s") or 0.0)
                                           for e in events)
    acc = RunAccount(run=str(events[0].get("run", "")), start=start,
                     end=max(e["time"] for e in events))
    for e in events:
        if e.get("kind") == "step" and e.get("step") is not None:
            acc.steps = max(acc.steps, int(e["step"]))
            acc.timeline.append((e["time"] - start, int(e["step"])))
        if e.get("kind") == "fault":
            acc.faults += 1
            acc.faults_at.append((e["time"] - start, e.get("step")))
        cat = _category(e)
        seconds = float(e.get("duration_s") or 0.0)
        if cat == "productive":
            acc.productive_s += seconds
        elif cat is not None:
            acc.badput_s[cat] += seconds
    booked = acc.productive_s + sum(acc.badput_s.values())
    acc.badput_s["other"] = max(0.0, acc.wall_s - booked)
    acc.overlap_s = max(0.0, booked - acc.wall_s)
    return acc


def account_log(path: str | os.PathLike) -> list[RunAccount]:
    """Accounts every run of a JSONL event log (a torn last line is skipped)."""
    return [account(evs) for evs in group_by_run(read_events(path)).values()]


def format_table(accounts: list[RunAccount]) -> str:
    """Wall time, goodput and badput percentages per run, one row each."""
    short = {"startup": "startup", "checkpoint_save": "ckpt save",
             "checkpoint_restore": "ckpt rest", "infra_recovery": "infra rec",
             "wasted_progress": "wasted", "restart": "restart", "snapshot": "snapshot",
             "other": "other"}
    head = (f"{'run':<22}{'wall s':>9}{'steps':>6}{'faults':>7}{'goodput%':>9}"
            + "".join(f"{short[k]:>10}" for k in BADPUT))
    lines = [head, "-" * len(head)]
    for a in accounts:
        pct = a.badput_pct
        lines.append(f"{a.run[:21]:<22}{a.wall_s:>9.2f}{a.steps:>6}{a.faults:>7}"
                     f"{a.goodput_pct:>9.1f}" + "".join(f"{pct[k]:>10.1f}" for k in BADPUT))
        if a.overlap_s > 1e-6:
            lines.append(f"  (booked events overlap by {a.overlap_s:.3f} s)")
    lines.append("badput columns in % of wall time; goodput = productive (non-replay) steps")
    return "\n".join(lines)
