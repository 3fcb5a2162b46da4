"""``mnemojax simulate``: project recovery costs to 1k-128k accelerators.

Costs come, in order of precedence, from flags, from ``--bench-json`` (the output of
``mnemojax bench``), and from the built-in defaults documented in ``config.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mnemojax._src.simulator import report
from mnemojax._src.simulator import strategies as st
from mnemojax._src.simulator.bench import load_bench_costs
from mnemojax._src.simulator.config import (
    LLAMA3_MTBF_ACCELERATOR_HOURS,
    LLAMA3_PLANNED_PER_DAY,
    ClassicalOptions,
    FailureOptions,
    InMemoryOptions,
    JobOptions,
    MnemojaxOptions,
    RestartCosts,
    SimulationConfigError,
    SimulationOptions,
    SpareOptions,
)
from mnemojax._src.simulator.failures import load_trace
from mnemojax._src.simulator.grid import DEFAULT_SCALES, run_grid

T = TypeVar("T")

DEFAULT_MTBF_HOURS = tuple(LLAMA3_MTBF_ACCELERATOR_HOURS * f for f in (0.5, 1.0, 2.0))

# flag dest -> "<group>.<field>" of the options it sets (None: flag not given).
_COST_FLAGS = {
    "detect_s": "restart.detect_s",
    "startup_s": "restart.startup_s",
    "compile_s": "restart.compile_s",
    "checkpoint_save_s": "classical.checkpoint_save_s",
    "checkpoint_restore_s": "classical.checkpoint_restore_s",
    "checkpoint_interval_s": "classical.interval_s",
    "interval_rule": "classical.interval_rule",
    "in_memory_overhead_frac": "in_memory.snapshot_overhead_frac",
    "in_memory_every_steps": "in_memory.snapshot_every_steps",
    "in_memory_restore_s": "in_memory.restore_fixed_s",
    "mnemojax_mode": "mnemojax.mode",
    "mnemojax_detect_s": "mnemojax.detect_s",
    "mnemojax_agree_s": "mnemojax.agree_s",
    "mnemojax_plan_s": "mnemojax.plan_s",
    "mnemojax_reshard_s": "mnemojax.reshard_fixed_s",
    "mnemojax_compile_s": "mnemojax.compile_s",
    "mnemojax_process_restart_s": "mnemojax.process_restart_s",
    "snapshot_overhead_frac": "mnemojax.snapshot_overhead_frac",
    "snapshot_every_steps": "mnemojax.snapshot_every_steps",
}


def _scale(text: str) -> int:
    text = text.strip().lower()
    try:
        return int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad scale {text!r}: expected e.g. 4096 or 4k") from None


def _list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    def parse(text: str) -> list[T]:
        try:
            return [item(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _planned(text: str) -> float:
    return LLAMA3_PLANNED_PER_DAY if text == "llama3" else float(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``simulate`` flags to ``parser``."""
    parser.description = (__doc__ or "").partition("\n")[0]
    g = parser.add_argument_group("grid")
    g.add_argument(
        "--scales",
        type=_list(_scale),
        default=list(DEFAULT_SCALES),
        help="accelerator counts, e.g. 1k,4k,16k,64k,128k (default)",
    )
    g.add_argument(
        "--mtbf-hours",
        type=_list(float),
        default=list(DEFAULT_MTBF_HOURS),
        help="per-accelerator MTBF in accelerator-hours, comma-separated "
        "(default: Llama 3 405B rate x 0.5, 1, 2 = 25,339, 50,677, 101,354)",
    )
    g.add_argument("--days", type=float, default=30.0, help="simulated job length (default 30)")
    g.add_argument("--runs", type=int, default=3, help="independent runs per cell (default 3)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument(
        "--strategies",
        type=_list(str),
        default=list(st.STRATEGY_NAMES),
        help="comma-separated subset of " + ",".join(st.STRATEGY_NAMES),
    )
    g.add_argument(
        "--trace",
        type=pathlib.Path,
        default=None,
        help="failure trace (CSV or JSON: time_hours, host or accelerator, "
        "category) instead of the Poisson process",
    )
    g.add_argument(
        "--bench-json",
        type=pathlib.Path,
        default=None,
        help="JSON written by `mnemojax bench`; its measured costs replace defaults",
    )
    g.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="directory for simulate.json, simulate.md and simulate.png",
    )
    g.add_argument("--no-plot", action="store_true", help="skip the PNG")

    j = parser.add_argument_group("job and hardware")
    j.add_argument("--accelerators-per-host", type=int, default=8)
    j.add_argument("--hosts-per-replica", type=int, default=1)
    j.add_argument("--step-time-s", type=float, default=6.0)
    j.add_argument(
        "--state-gb-per-host",
        type=float,
        default=3.2,
        help="training state per host, GB (default 3.2: 405B params x 16 B / 2048)",
    )
    j.add_argument(
        "--host-bandwidth-gb-s",
        type=float,
        default=25.0,
        help="per-host network bandwidth for state transfer, GB/s (default 25)",
    )
    j.add_argument("--min-replica-fraction", type=float, default=0.5)
    j.add_argument(
        "--model-shrink-headroom",
        type=float,
        default=1.0,
        help="how many times its share of the state a device can hold: above 1 a reduced "
        "mesh may narrow the model axis instead of dropping replicas (default 1: never)",
    )
    j.add_argument(
        "--planned-per-day",
        type=_planned,
        default=0.0,
        help="planned job-wide maintenance stops per day, or 'llama3' (47/54)",
    )
    j.add_argument(
        "--spare-hosts", type=int, default=None, help="spare host pool size (default: unlimited)"
    )
    j.add_argument(
        "--replacement-delay-h",
        type=float,
        default=4.0,
        help="hours until a failed host is back in the pool (default 4)",
    )

    c = parser.add_argument_group("full-restart costs (classical and in_memory)")
    c.add_argument("--detect-s", type=float, help="default 60")
    c.add_argument("--startup-s", type=float, help="relaunch + distributed init, default 180")
    c.add_argument("--compile-s", type=float, help="default 60")
    c.add_argument("--checkpoint-save-s", type=float, help="blocking save, default 30")
    c.add_argument("--checkpoint-restore-s", type=float, help="default 60")
    c.add_argument(
        "--checkpoint-interval-s", type=float, help="fixed interval (default: Young/Daly optimum)"
    )
    c.add_argument("--interval-rule", choices=("young", "daly"), help="default young")
    c.add_argument("--in-memory-overhead-frac", type=float, help="default 0.01")
    c.add_argument("--in-memory-every-steps", type=int, help="default 1")
    c.add_argument(
        "--in-memory-restore-s",
        type=float,
        help="fixed restore part, default 10 (+ state transfer)",
    )

    m = parser.add_argument_group("mnemojax costs (default: bench JSON, else these)")
    m.add_argument(
        "--mnemojax-mode",
        choices=("auto", "hot_spare", "reduced_mesh"),
        help="default auto: hot spare when free, else reduced mesh",
    )
    m.add_argument("--mnemojax-detect-s", type=float, help="default 10")
    m.add_argument("--mnemojax-agree-s", type=float, help="default 1")
    m.add_argument("--mnemojax-plan-s", type=float, help="default 0.5")
    m.add_argument(
        "--mnemojax-reshard-s", type=float, help="fixed reshard part, default 1 (+ state transfer)"
    )
    m.add_argument("--mnemojax-compile-s", type=float, help="AOT executable fetch, default 5")
    m.add_argument(
        "--mnemojax-process-restart-s",
        type=float,
        help="software fault: in-place process restart, default 60",
    )
    m.add_argument("--snapshot-overhead-frac", type=float, help="default 0.01")
    m.add_argument("--snapshot-every-steps", type=int, help="default 1")
    parser.add_argument("-v", "--verbose", action="store_true")


def build_options(args: argparse.Namespace) -> tuple[SimulationOptions, dict[str, Any]]:
    """Options from flags over bench JSON over defaults; also returns the overrides used.

    Raises:
        SimulationConfigError: a value out of range.
    """
    # Values of several types (seconds, step counts, rule names), checked by the options'
    # own validation rather than here.
    overrides: dict[str, Any] = {}
    if args.bench_json is not None:
        overrides.update(load_bench_costs(args.bench_json))
    for dest, key in _COST_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = value

    def group(name: str) -> dict[str, Any]:
        return {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith(name + ".")}

    restart = RestartCosts(**group("restart"))
    job = JobOptions(
        accelerators=args.scales[0] if args.scales else 1024,
        accelerators_per_host=args.accelerators_per_host,
        hosts_per_replica=args.hosts_per_replica,
        step_time_s=args.step_time_s,
        state_bytes_per_host=args.state_gb_per_host * 1e9,
        host_bandwidth_bytes_per_s=args.host_bandwidth_gb_s * 1e9,
        min_replica_fraction=args.min_replica_fraction,
        model_shrink_headroom=args.model_shrink_headroom,
    )
    options = SimulationOptions(
        job=job,
        failures=FailureOptions(planned_per_day=args.planned_per_day),
        spares=SpareOptions(
            spare_hosts=args.spare_hosts, replacement_delay_s=args.replacement_delay_h * 3600
        ),
        classical=ClassicalOptions(restart=restart, **group("classical")),
        in_memory=InMemoryOptions(restart=restart, **group("in_memory")),
        mnemojax=MnemojaxOptions(**group("mnemojax")),
        days=args.days,
        seed=args.seed,
    )
    return options, overrides


def run(args: argparse.Namespace) -> int:
    """Runs the grid, prints the tables, writes JSON / markdown / PNG under ``--out``."""
    if args.verbose and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        options, overrides = build_options(args)
        trace = load_trace(args.trace) if args.trace is not None else None
        points = run_grid(
            options,
            scales=args.scales,
            mtbf_accelerator_hours=args.mtbf_hours,
            strategies=args.strategies,
            runs=args.runs,
            trace=trace,
        )
    except SimulationConfigError as e:
        print(f"mnemojax simulate: error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    source = f"trace {args.trace}" if trace is not None else "Poisson failures"
    header = (
        f"{source}; {args.days:g} days x {1 if trace is not None else args.runs} runs, "
        f"seed {args.seed}; "
        f"spares {'unlimited' if args.spare_hosts is None else args.spare_hosts}; "
        f"costs: {'bench ' + str(args.bench_json) + ' + ' if args.bench_json else ''}"
        f"flags/defaults ({elapsed:.1f} s)"
    )
    text = "\n\n".join(
        [
            header,
            "Goodput (% of wall time) and mean recovery time:",
            report.goodput_table(points),
            "Badput by category (% of wall time):",
            report.badput_table(points),
        ]
    )
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        config = {
            "options": dataclasses.asdict(options),
            "scales": list(args.scales),
            "mtbf_accelerator_hours": None if trace is not None else list(args.mtbf_hours),
            "runs": args.runs,
            "trace": str(args.trace) if args.trace else None,
            "bench_json": str(args.bench_json) if args.bench_json else None,
            "overrides": overrides,
        }
        report.write_json(args.out / "simulate.json", points, config=config)
        (args.out / "simulate.md").write_text(text + "\n")
        if not args.no_plot:
            report.plot(points, args.out / "simulate.png", title=header)
        print(
            f"\nwrote {args.out}/simulate.json, simulate.md"
            + ("" if args.no_plot else ", simulate.png")
        )
    return 0
