"""The bench's run (e) alone: mnemojax under the launcher, 4 processes x 2 CPU devices, the
tiny preset's GPT, worker 1 SIGKILLed after step 15, a fresh compilation cache per run.

    PYTHONPATH=. python -m tests.jobs.e_alone [--runs N] [--tag T] [--ahead-losses 2]

Prints, per run and as medians, kill -> next good step, -> back past the killed step and
-> 10 steps past it (the bench's figures), and the recovery's phases: for comparing two
trees (another's worktree on ``PYTHONPATH``), interleaved, without the rest of the bench.
Every process ends with the launcher (bounded by the preset's worker timeout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from mnemojax._src.bench import multiproc
from mnemojax._src.bench.config import load_preset

FIGURES = ("next_good_step_s", "back_past_killed_step_s", "steps_past_killed_s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.jobs.e_alone")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tag", default="e", help="a label for the printed lines")
    p.add_argument("--ahead-losses", type=int, default=1,
                   help="the workers' CompileOptions(ahead_losses=N)")
    args = p.parse_args(argv)
    cfg = load_preset("tiny")
    runs = []
    for i in range(args.runs):
        out = Path(tempfile.mkdtemp(prefix=f"mnemojax-e-{args.tag}-"))
        e = multiproc.run_mnemojax_job(
            cfg, preset="tiny", out_dir=out / "e", nproc=cfg.processes,
            devices_per_proc=cfg.devices_per_process, victim=cfg.process_victim,
            kill_after_step=cfg.process_kill_after_step, compile_cache=str(out / "cache"),
            timeout_s=cfg.worker_timeout_s,
            worker_args=("--ahead-losses", str(args.ahead_losses)))
        phases = {k: round(v, 3) for k, v in e.get("recovery_phases_s", {}).items()}
        print(args.tag, i, json.dumps({k: round(e[k], 2) for k in FIGURES if k in e}),
              "phases", json.dumps(phases), flush=True)
        runs.append(e)
    for k in FIGURES:
        values = [r[k] for r in runs if k in r]
        if values:
            print(args.tag, "median", k, round(statistics.median(values), 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
