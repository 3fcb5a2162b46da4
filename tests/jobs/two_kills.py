"""Two real kills in one multi-process job: is either recovery's compile on the critical
path? (issue 13: "0 s of compile on the critical path for the first two faults of a run").

    PYTHONPATH=. python -m tests.jobs.two_kills [--kills 12,70] [--steps 90]
        [--victims 1,2] [--ahead-compilers K] [--no-compile-process]

Runs the bench's resilient worker (`mnemojax._src.bench.mp_resilient_worker`, the tiny
preset's GPT on mesh 4 x 2) under the launcher with its default options, 4 processes x 2
CPU devices, a fresh persistent compilation cache, and SIGKILLs worker 1 (``--victims``)
once it has published the first kill step, then worker 2 at the second. Prints, per recovery, how the
new world got its executable (``cached``: loaded from the entry written ahead;
``compiled``: on the critical path) and whether it lowered the step from its export, its
phases, kill -> next good step, and how long the 10 steps after it took (against the
median step of the job's last world: the background compiles of the next candidates run
meanwhile). Exit status 1 if the job failed or a recovery compiled on the critical path. Every process ends with the launcher (bounded by ``--timeout-s``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from mnemojax._src.bench.multiproc import STEPS_PAST, kill_figures, launch_resilient_workers
from mnemojax._src.events import read_events
from mnemojax.testing import ProcessFault


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.jobs.two_kills")
    p.add_argument("--kills", default="12,70",
                   help="the steps after which workers 1 and 2 are killed")
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--victims", default="1,2",
                   help="the workers killed at the first and the second of --kills")
    p.add_argument("--timeout-s", type=float, default=500.0)
    p.add_argument("--ahead-compilers", type=int, default=None,
                   help="CompileOptions.ahead_compilers (default: its default)")
    p.add_argument("--no-compile-process", action="store_true",
                   help="CompileOptions(compile_process=False): compiles ahead on a thread")
    args = p.parse_args(argv)
    kills = [int(k) for k in args.kills.split(",")]
    if len(kills) != 2 or not 0 < kills[0] < kills[1] < args.steps:
        p.error(f"--kills {args.kills!r}: two increasing steps below --steps")
    victims = [int(v) for v in args.victims.split(",")]
    if len(victims) != 2 or len(set(victims)) != 2 or not all(0 <= v < 4 for v in victims):
        p.error(f"--victims {args.victims!r}: two different workers of 0-3")
    out = Path(tempfile.mkdtemp(prefix="mnemojax-two-kills-"))
    log = out / "workers.log"
    report = launch_resilient_workers(
        preset="tiny", steps=args.steps, out=out, run="two_kills", nproc=4,
        devices_per_proc=2, faults=[ProcessFault("kill", victims[0], kills[0]),
                                    ProcessFault("kill", victims[1], kills[1])],
        compile_cache=str(out / "xla-cache"), timeout_s=args.timeout_s,
        worker_args=(() if args.ahead_compilers is None else
                     ("--ahead-compilers", str(args.ahead_compilers)))
        + (("--no-compile-process",) if args.no_compile_process else ()))
    print(f"job exit {report['rc']}, kills fired: "
          f"{[(f['victim'], f['step']) for f in report['fired']]}, output in {out}")
    if report["rc"] != 0 or len(report["fired"]) != 2:
        print(log.read_text()[-3000:] if log.exists() else "(no worker log)")
        return 1
    steps = [e for e in read_events(out / "events.jsonl") if e["kind"] == "step"]
    recs = json.loads((out / "stats.json").read_text())["recoveries"]
    ends: dict[int, float] = {}  # step -> when its last process logged it
    for e in steps:
        ends[e["step"]] = max(ends.get(e["step"], e["time"]), e["time"])
    on_path = 0
    for i, (fired, rec) in enumerate(zip(report["fired"], recs, strict=False)):
        # The new world's steps are the failed one (rec["step"]) and later: a lower step
        # logged after the kill was completed by the old world (as in the bench's (e)).
        figures = kill_figures(steps, killed=rec["step"], t_kill=fired["t"],
                               new_world=lambda e, r=rec: e["step"] >= r["step"])
        phases = ", ".join(f"{k} {v:.2f}" for k, v in rec["phases_s"].items())
        # Each survivor's own first good step: the spread is one survivor behind the others.
        first: dict[int, float] = {}
        for e in steps:
            if e["time"] > fired["t"] and e["step"] >= rec["step"]:
                first[e["pid"]] = min(first.get(e["pid"], e["time"]), e["time"])
        each = ", ".join(f"{t - fired['t']:.2f}" for t in sorted(first.values()))
        print(f"kill of worker {fired['victim']} after step {fired['step']}: executable "
              f"{rec['executable']}{', from export' if rec.get('from_export') else ''}; "
              f"kill -> next good step {figures['next_good_step_s']:.2f} s (every survivor; "
              f"{figures['processes_after']} processes; each: {each}); phases (s): {phases}")
        if figures["steps_past_killed_s"] is not None:
            # The world's steady step: after those 10, up to the next kill or the end.
            last = recs[i + 1]["step"] - 1 if i + 1 < len(recs) else max(ends)
            steady = statistics.median(ends[s] - ends[s - 1] for s in range(
                rec["step"] + STEPS_PAST + 1, last + 1) if s in ends and s - 1 in ends)
            after = figures["steps_past_killed_s"] - figures["back_past_killed_step_s"]
            print(f"  the {STEPS_PAST} steps after it: {after:.2f} s, "
                  f"{after / steady:.1f} of that world's later median step ({steady:.3f} s)")
        on_path += rec["executable"] == "compiled"
    return 1 if on_path or len(recs) != 2 else 0


if __name__ == "__main__":
    sys.exit(main())
