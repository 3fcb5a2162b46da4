"""Tables (markdown), JSON and the PNG plot of a grid run."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from mnemojax._src.simulator import strategies as st
from mnemojax._src.simulator.grid import GridPoint

_SHORT = {
    st.STARTUP: "startup",
    st.CHECKPOINT_SAVE: "ckpt save",
    st.CHECKPOINT_RESTORE: "restore",
    st.LOST_WORK: "lost work",
    st.INFRA_RECOVERY: "infra",
    st.SNAPSHOT_OVERHEAD: "snapshot",
    st.DEGRADED: "degraded",
}


def _scale(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _mtbf(p: GridPoint) -> str:
    return "trace" if p.mtbf_accelerator_hours is None else f"{p.mtbf_accelerator_hours:,.0f}"


def goodput_table(points: Sequence[GridPoint]) -> str:
    """Goodput % per (scale, MTBF) row and strategy column, with each strategy's mean
    recovery time."""
    strategies = list(dict.fromkeys(p.strategy for p in points))
    rows: dict[tuple[int, str], dict[str, GridPoint]] = {}
    for p in points:
        rows.setdefault((p.accelerators, _mtbf(p)), {})[p.strategy] = p
    head = ["accelerators", "MTBF/accel (h)", "job MTBF (h)", "failures/day"]
    head += [f"{s} goodput %" for s in strategies] + [f"{s} recovery (s)" for s in strategies]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for (n, mtbf), cells in rows.items():
        any_p = next(iter(cells.values()))
        row = [_scale(n), mtbf, f"{any_p.job_mtbf_h:.2f}", f"{any_p.failures_per_day:.1f}"]
        row += [f"{cells[s].goodput * 100:.1f}" if s in cells else "" for s in strategies]
        row += [f"{cells[s].mean_recovery_s:.0f}" if s in cells else "" for s in strategies]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def badput_table(points: Sequence[GridPoint]) -> str:
    """One row per cell: goodput, badput by category (% of wall time), recovery, lost work."""
    head = ["accelerators", "MTBF/accel (h)", "strategy", "goodput %"]
    head += [f"{_SHORT[c]} %" for c in st.BADPUT_CATEGORIES]
    head += ["mean recovery (s)", "lost work (h/day)", "ckpt interval (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for p in points:
        row = [_scale(p.accelerators), _mtbf(p), p.strategy, f"{p.goodput * 100:.2f}"]
        row += [f"{p.badput[c] * 100:.2f}" for c in st.BADPUT_CATEGORIES]
        row += [
            f"{p.mean_recovery_s:.0f}",
            f"{p.lost_work_h_per_day:.2f}",
            f"{p.checkpoint_interval_s:.0f}" if p.checkpoint_interval_s else "-",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def to_json(points: Sequence[GridPoint], *, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": "mnemojax.simulate/1",
        "config": config,
        "results": [dataclasses.asdict(p) for p in points],
    }


def write_json(path: pathlib.Path, points: Sequence[GridPoint], *, config: dict[str, Any]) -> None:
    path.write_text(json.dumps(to_json(points, config=config), indent=2) + "\n")


_COLORS = {"classical": "tab:red", "in_memory": "tab:orange", "mnemojax": "tab:blue"}
# Colorbrewer Set2: distinct from the strategy line colors.
_STACK_COLORS = ("#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#b3b3b3")


def plot(points: Sequence[GridPoint], path: pathlib.Path, *, title: str = "") -> None:
    """Left: goodput against scale, one line per strategy and MTBF. Right: badput by
    category at the middle MTBF, one bar per scale and strategy."""
    # A bare Figure renders with Agg and leaves pyplot's global backend state alone.
    from matplotlib.figure import Figure

    strategies = list(dict.fromkeys(p.strategy for p in points))
    mtbfs = list(dict.fromkeys(p.mtbf_accelerator_hours for p in points))
    scales = sorted({p.accelerators for p in points})
    styles = ("--", "-", ":", "-.")
    fig = Figure(figsize=(12, 4.6), dpi=90)
    ax1, ax2 = fig.subplots(1, 2)
    for s in strategies:
        for j, m in enumerate(mtbfs):
            pts = sorted(
                (p for p in points if p.strategy == s and p.mtbf_accelerator_hours == m),
                key=lambda p: p.accelerators,
            )
            label = f"{s}, MTBF/accel {m:,.0f} h" if m is not None else f"{s}, trace"
            ax1.plot(
                [p.accelerators for p in pts],
                [100 * p.goodput for p in pts],
                styles[j % len(styles)],
                marker="o",
                ms=3,
                color=_COLORS.get(s),
                label=label,
            )
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(scales, [_scale(n) for n in scales])
    ax1.set_xlabel("accelerators")
    ax1.set_ylabel("goodput (% of wall time)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax1.set_title("goodput")

    mid = mtbfs[len(mtbfs) // 2]
    width = 0.8 / len(strategies)
    top = 0.0
    for k, s in enumerate(strategies):
        pts = {
            p.accelerators: p for p in points if p.strategy == s and p.mtbf_accelerator_hours == mid
        }
        bottom = [0.0] * len(scales)
        for c, color in zip(st.BADPUT_CATEGORIES, _STACK_COLORS, strict=True):
            vals = [100 * pts[n].badput[c] if n in pts else 0.0 for n in scales]
            xs = [i + (k - (len(strategies) - 1) / 2) * width for i in range(len(scales))]
            ax2.bar(
                xs,
                vals,
                width * 0.95,
                bottom=bottom,
                color=color,
                label=_SHORT[c] if k == 0 else None,
                edgecolor=_COLORS.get(s),
                linewidth=0.8,
            )
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        top = max([top, *bottom])
    ax2.set_ylim(0, top * 1.1 or 1.0)
    ax2.set_xticks(range(len(scales)), [_scale(n) for n in scales])
    ax2.set_xlabel("accelerators (bars: " + " | ".join(strategies) + ")")
    ax2.set_ylabel("badput (% of wall time)")
    ax2.set_title(f"badput by category, MTBF/accel {mid:,.0f} h" if mid else "badput by category")
    ax2.legend(fontsize=7)
    ax2.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
