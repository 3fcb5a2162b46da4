"""PNG figures of the bench and the report (matplotlib, bare `Figure`s, no pyplot state)."""

from __future__ import annotations

import os
from collections.abc import Sequence

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#e7969c", "#637939", "#aec7e8")


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def steps_vs_time(ax, series: Sequence[tuple[str, list, list]]) -> None:
    """Steps against wall time per run; faults marked with an x on the run's line.

    Args:
        series: (label, [(seconds, step)], [(seconds, step) of faults]) per run.
    """
    for i, (label, timeline, faults) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        for j, segment in enumerate(_segments(timeline)):  # a restart starts a new segment
            xs, ys = zip(*segment, strict=True)
            ax.plot(xs, ys, ".-", ms=3, lw=1, color=color, label=label if j == 0 else None)
        for j, (t, step) in enumerate(faults):
            ax.axvline(t, color=color, ls=":", lw=0.8)
            ax.plot([t], [step], "x", color=color, ms=9, mew=2,
                    label=f"{label}: fault" if j == 0 else None)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _segments(timeline: list) -> list[list]:
    """Splits (time, step) points where the step does not increase (a restart)."""
    segments: list[list] = []
    for point in timeline:
        if not segments or point[1] <= segments[-1][-1][1]:
            segments.append([])
        segments[-1].append(point)
    return segments


def stacked_bars(ax, bars: dict[str, dict[str, float]], *, horizontal: bool = False,
                 unit: str = "s") -> None:
    """One stacked bar per label, one segment per phase (colours by phase name)."""
    phases: list[str] = []
    for parts in bars.values():
        phases += [p for p in parts if p not in phases]
    labels = list(bars)
    bottoms = [0.0] * len(labels)
    for k, phase in enumerate(phases):
        values = [bars[label].get(phase, 0.0) for label in labels]
        color = PALETTE[k % len(PALETTE)]
        if horizontal:
            ax.barh(labels, values, left=bottoms, color=color, label=phase)
        else:
            ax.bar(labels, values, bottom=bottoms, color=color, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for i, total in enumerate(bottoms):
        if horizontal:
            ax.text(total, i, f" {total:.2f}", va="center", fontsize=7)
        else:
            ax.text(i, total, f"{total:.2f} {unit}", ha="center", va="bottom", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="x" if horizontal else "y")


def save_steps_vs_time(path: str | os.PathLike, series, title: str) -> None:
    fig = _figure(9, 5)
    ax = fig.add_subplot()
    steps_vs_time(ax, series)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def save_recovery_phases(path: str | os.PathLike, bars: dict[str, dict[str, float]],
                         title: str) -> None:
    fig = _figure(8, 5)
    ax = fig.add_subplot()
    stacked_bars(ax, bars)
    ax.set_ylabel("seconds, fault to next good step (+ redo)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def save_report(path: str | os.PathLike, accounts, title: str) -> None:
    """Timeline of steps (faults marked) and badput bars (% of wall) per run."""
    fig = _figure(10, 4 + 0.4 * len(accounts))
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[3, 2])
    steps_vs_time(ax1, [(a.run, a.timeline, a.faults_at) for a in accounts])
    ax1.set_title(title, fontsize=10)
    bars = {a.run: {"goodput": a.goodput_pct, **a.badput_pct} for a in accounts}
    stacked_bars(ax2, bars, horizontal=True, unit="%")
    ax2.set_xlabel("% of wall time")
    fig.tight_layout()
    fig.savefig(path)
