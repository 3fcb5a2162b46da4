"""Measures multi-process recovery of the resilient job: kill -> detection -> next good step.

python -m tests.jobs.mp_measure --fault kill --victim 1 --collective-timeout-s 10 [--nproc 3]
    [--no-peer-watch] [--step-sleep-s S] [--then-after-decision W]
    [--precompile [--ahead-losses 2]] [--spares N] [--compare-precompile R]
    [--compare-spares R]

Runs `tests.jobs.mp_resilient_job` under the launcher, kills the victim once it has
published --at-step, and prints, in seconds from the kill: when the launcher knew (its
agent saw the exit), when each survivor's step failed (detection), and when each survivor
finished its first good step in the new world; plus each survivor's recovery phases.
With --then-after-decision W, worker W is killed too, as soon as the launcher has decided
the world that follows the first death (it never joins it: a death during the recovery).
"""

import argparse
import json
import sys
import tempfile

from mnemojax._src.distributed.env import PEER_WATCH
from mnemojax._src.distributed.worker.peer_watch import TOLD_BY_LAUNCHER
from mnemojax._src.events import read_events
from mnemojax.testing import ProcessFault, run_scenario


def measure(*, fault: str, victim: int, nproc: int, collective_timeout_s: int,
            at_step: int = 4, steps: int = 10, peer_watch: bool = True,
            step_sleep_s: float = 0.2, precompile: bool = False,
            then_after_decision: int | None = None, ahead_losses: int = 1,
            spares: int = 0) -> dict:
    out = tempfile.mkdtemp(prefix="mnemojax-mp-")
    cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", out,
           "--steps", str(steps), "--step-sleep-s", str(step_sleep_s),
           *(["--restore"] if spares else [])]  # (a spare starts its loop there)
    if precompile:  # a fresh cache: only what this job's worlds wrote
        cmd += ["--precompile-cache", tempfile.mkdtemp(prefix="mnemojax-xla-"),
                "--ahead-losses", str(ahead_losses)]
    report = run_scenario(cmd, nproc=nproc, devices_per_proc=2,
                          faults=[ProcessFault(fault, victim, at_step)] + (
                              [] if then_after_decision is None else
                              [ProcessFault("kill_after_decision", then_after_decision)]),
                          collective_timeout_s=collective_timeout_s, job_timeout_s=280,
                          extra_env=None if peer_watch else {PEER_WATCH: "0"},
                          spares=spares)
    t_kill = report["t0"]
    result = {"fault": fault, "victim": victim, "nproc": nproc,
              "collective_timeout_s": collective_timeout_s, "peer_watch": peer_watch,
              "step_sleep_s": step_sleep_s, "spares": spares,
              "rc": report["rc"],
              "launcher_knows_s": report.get("launcher_knows_s"), "survivors": {}}
    import glob
    for path in sorted(glob.glob(f"{out}/mnemojax-events-w*.jsonl")):
        events = list(read_events(path))
        fault_ev = next((e for e in events if e["kind"] == "fault"), None)
        rec = next((e for e in events if e["kind"] == "recovery"), None)
        if fault_ev is None or rec is None:
            continue
        t0 = t_kill if t_kill is not None else fault_ev["time"]
        after = [e for e in events if e["kind"] == "step" and e["time"] > rec["time"]]
        phases = {e["phase"]: round(e["duration_s"], 3) for e in events
                  if e["kind"] == "recovery_phase"}
        result["survivors"][events[0]["run"]] = {
            "detected_s": round(fault_ev["time"] - t0, 3),
            "recovered_s": round(rec["time"] - t0, 3),
            "next_good_step_s": round(after[0]["time"] - t0, 3) if after else None,
            "phases_s": phases, "steps_lost": rec.get("steps_lost"),
            "executable": rec.get("executable")}
    # How each survivor learned (the reason it reported first): the peer watch, gloo's
    # "Connection closed by peer" (it was exchanging with the dead process) or a timeout.
    for e in report["events"]:
        if e["op"] == "report_failure" and e.get("generation") == 0:
            result["survivors"].get(f"w{e['worker_id']}", {}).setdefault(
                "learned", _how(e["reason"]))
    return result


def _how(reason: str) -> str:
    if TOLD_BY_LAUNCHER in reason:
        return "peer_watch"
    if "closed by peer" in reason or "Connection reset" in reason:
        return "connection_closed"
    if "Timed out" in reason:
        return "collective_timeout"
    return reason[:80]


def _compare(repeat: int, kwargs: dict, variants: dict[str, dict]) -> int:
    """Kill -> next good step and the recovery's compile phase, per survivor, for each of
    two ``variants`` (label -> `measure` arguments; alternated runs; medians and their
    ratio, the first over the second)."""
    import statistics
    figures: dict[str, dict[str, list[float]]] = {
        label: {"next": [], "compile": []} for label in variants}
    for i in range(repeat):
        for label, extra in variants.items():
            r = measure(**kwargs, **extra)
            for name, s in sorted(r["survivors"].items()):
                if s["next_good_step_s"] is not None:
                    figures[label]["next"].append(s["next_good_step_s"])
                figures[label]["compile"].append(s["phases_s"].get("compile", float("nan")))
                print(f"run {i} {label} {name}: rc {r['rc']}, next good step "
                      f"{s['next_good_step_s']} s, compile {s['phases_s'].get('compile')} s, "
                      f"executable {s['executable']}", flush=True)
    med = {a: {k: statistics.median(v) for k, v in f.items() if v} for a, f in figures.items()}
    a, b = variants
    for key, what in (("next", "kill -> next good step"), ("compile", "recovery compile phase")):
        print(f"median {what}: {a} {med[a][key]:.2f} s, {b} {med[b][key]:.2f} s "
              f"({med[a][key] / med[b][key]:.2f}x)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fault", choices=("kill", "host", "hang", "corrupt"), default="kill")
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--collective-timeout-s", type=int, default=10)
    p.add_argument("--no-peer-watch", action="store_true",
                   help="workers without the peer watch (the collective timeout only)")
    p.add_argument("--step-sleep-s", type=float, default=0.2,
                   help="pause between steps (a survivor told of a death while pausing "
                        "fails its next step at once)")
    p.add_argument("--at-step", type=int, default=4, help="kill once the victim published it")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--precompile", action="store_true",
                   help="workers compile the next worlds ahead into a fresh persistent "
                        "compilation cache (every process writes its entries)")
    p.add_argument("--compare-precompile", type=int, default=0, metavar="R",
                   help="R pairs of runs, without and with --precompile, alternated; "
                        "prints the medians side by side")
    p.add_argument("--then-after-decision", type=int, metavar="W",
                   help="also kill worker W once the world after the first death is decided")
    p.add_argument("--ahead-losses", type=int, default=1,
                   help="with --precompile: CompileOptions(ahead_losses=N)")
    p.add_argument("--spares", type=int, default=0,
                   help="warm spares (mnemojax launch --spares): the first takes the "
                        "victim's rank, the mesh keeps its shape")
    p.add_argument("--compare-spares", type=int, default=0, metavar="R",
                   help="R pairs of runs, with one spare and without, alternated; prints "
                        "the medians side by side")
    p.add_argument("--json", help="also write the result here (workers share stdout)")
    args = p.parse_args()
    kwargs = dict(fault=args.fault, victim=args.victim, nproc=args.nproc,
                  collective_timeout_s=args.collective_timeout_s,
                  peer_watch=not args.no_peer_watch, step_sleep_s=args.step_sleep_s,
                  at_step=args.at_step, steps=args.steps,
                  then_after_decision=args.then_after_decision,
                  ahead_losses=args.ahead_losses)
    if args.compare_precompile:
        return _compare(args.compare_precompile, {**kwargs, "spares": args.spares},
                        {"plain": {"precompile": False}, "ahead": {"precompile": True}})
    if args.compare_spares:
        return _compare(args.compare_spares, {**kwargs, "precompile": args.precompile},
                        {"spare": {"spares": 1}, "shrink": {"spares": 0}})
    r = measure(**kwargs, precompile=args.precompile, spares=args.spares)
    print(json.dumps(r, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r["rc"]


if __name__ == "__main__":
    sys.exit(main())
