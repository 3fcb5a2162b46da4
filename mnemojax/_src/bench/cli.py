"""``mnemojax bench``: mnemojax against the classical restart baseline, same faults.

Runs (a) failure-free without snapshots, (b) failure-free with every-step snapshots,
(c) mnemojax with the preset's device losses (simulated in the runtime) and (d) the
classical baseline (plain Flax + Orbax, the process killed and restarted at the same
steps); then, unless ``--no-processes``, the real thing: (e) mnemojax under
``mnemojax launch`` and (f) the classical ``jax.distributed`` job restarted by a
supervisor, one worker SIGKILLed from outside in both. Prints the table and writes
``bench.json``, ``events.jsonl``, ``steps_vs_time.png`` and ``recovery_phases.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mnemojax._src.bench.config import PRESETS, load_preset
from mnemojax._src.config import configure_devices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (__doc__ or "").partition("\n")[0]
    parser.add_argument("--preset", default="tiny",
                        help=f"one of {', '.join(PRESETS)} (configs/bench_<name>.toml) or a "
                             "bench TOML path; default: tiny")
    parser.add_argument("--out", default=None, help="output directory (default: "
                        "runs/bench-<preset>)")
    parser.add_argument("--mtbf-s", type=float, default=None,
                        help="stated MTBF for the baseline's Young/Daly checkpoint interval "
                             "(default: run (a)'s wall time / number of faults)")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    parser.add_argument("--no-processes", action="store_true",
                        help="skip (e) and (f), the multi-process runs with a real kill "
                             "(about a minute per pair on the tiny preset)")
    parser.add_argument("--pairs", type=int, default=None, metavar="N",
                        help="run (e) and (f) N times each, alternating, and report medians "
                             "(default: the preset's process_pairs)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    cfg = load_preset(args.preset, steps=args.steps, mtbf_s=args.mtbf_s,
                      process_pairs=args.pairs)
    from mnemojax._src.bench import driver, summary

    configure_devices(cfg.devices, who="mnemojax bench")
    out = Path(args.out or f"runs/bench-{cfg.name}")
    s = driver.run_bench(cfg, preset=args.preset, out_dir=out, progress=not args.quiet,
                         processes=not args.no_processes)
    print(summary.format_table(s))
    print()

    print(f"written: {out / 'bench.json'}, {out / 'events.jsonl'}, "
          f"{out / 'steps_vs_time.png'}, {out / 'recovery_phases.png'}"
          + (f", {out / 'processes'}/" if s.get("processes") else ""))
    print(f"goodput per run: python -m mnemojax report {out / 'events.jsonl'} --out {out}")
    return 0
