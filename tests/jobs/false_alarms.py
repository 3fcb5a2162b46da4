"""Counts false alarms of a loaded, failure-free multi-process job (issue 13, detection).

    PYTHONPATH=. python -m tests.jobs.false_alarms --minutes 30 --busy 4

Runs `tests.jobs.mp_resilient_job` under `mnemojax launch` with the launcher's defaults (4
processes x 2 CPU devices, collective timeout, heartbeats, hang detection, peer watch),
unpaced steps, for about ``--minutes``, with ``--busy`` busy-loop processes competing for
the cores the whole time. Nothing fails, so every fault or recovery a worker logs is a
false alarm. Prints the steps run, the wall time, the launcher's exit status and the
false alarms (fault and recovery events per worker); exit status 1 if there was any.
Every process it starts ends with it (the busy loops in a ``finally``, the job by the
launcher, bounded by ``--minutes`` plus a margin).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from mnemojax._src.events import read_events

BUSY = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.jobs.false_alarms")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--busy", type=int, default=4, help="busy-loop processes alongside")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--step-s", type=float, default=0.06,
                   help="expected seconds per step under this load, to size the job "
                        "(measured ~0.06 s beside 4 busy loops on the 2-core VM)")
    args = p.parse_args(argv)
    out = tempfile.mkdtemp(prefix="mnemojax-false-alarms-")
    steps = max(10, int(args.minutes * 60 / args.step_s))
    cmd = [sys.executable, "-m", "mnemojax", "launch", "--nproc", str(args.nproc),
           "--devices-per-proc", "2", "--", sys.executable, "-m",
           "tests.jobs.mp_resilient_job", "--out", out, "--steps", str(steps),
           "--step-sleep-s", "0"]
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
    t0 = time.monotonic()
    try:
        job = subprocess.run(cmd, timeout=args.minutes * 60 * 3 + 300, check=False)
        rc = job.returncode
    except subprocess.TimeoutExpired:  # run() killed the launcher; it ends its processes
        rc = None
    finally:
        for b in busy:
            b.kill()
            b.wait(timeout=10)
    wall = time.monotonic() - t0
    alarms, done = {}, {}
    for path in sorted(glob.glob(os.path.join(out, "mnemojax-events-w*.jsonl"))):
        events = list(read_events(path))
        worker = os.path.basename(path)[len("mnemojax-events-"):-len(".jsonl")]
        alarms[worker] = [e for e in events if e["kind"] in ("fault", "recovery")]
        done[worker] = max((e["step"] for e in events if e["kind"] == "step"), default=0)
    result = {"minutes": round(wall / 60, 1), "steps_planned": steps, "steps_done": done,
              "busy_loops": args.busy, "nproc": args.nproc, "launcher_rc": rc,
              "false_alarms": {w: len(a) for w, a in alarms.items()},
              "first_alarms": {w: a[:3] for w, a in alarms.items() if a}, "out": out}
    print(json.dumps(result, indent=1, default=str), flush=True)
    return 0 if rc == 0 and not any(alarms.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
