"""Demo and e2e driver: run `prototype_train` under the launcher, inject one failure, compare.

``python -m mnemojax._src.distributed.prototype_demo --nproc 3 --fault worker --victim 1
--at-step 8`` kills worker 1 with SIGKILL once it has published step 8 (``host`` kills its
agent too, ``hang`` makes it stop before that step, ``none`` runs failure-free), then checks
the final parameters against a one-device failure-free run (rtol = atol = 1e-5) and prints
the timeline: kill -> launcher knows (agent saw the exit) -> each survivor's error
(detection) -> agreement -> re-initialised -> state fetched -> rebuilt -> next good step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import sys
import tempfile
import threading

import numpy as np

from mnemojax._src.distributed.launcher import Launcher, LaunchOptions


def run_scenario(*, out: str, nproc: int = 3, devices_per_proc: int = 2, steps: int = 16,
                 fault: str = "worker", victim: int = 1, at_step: int = 6,
                 step_sleep_s: float = 0.2, collective_timeout_s: int = 10,
                 heartbeat_s: int = 10, job_timeout_s: float = 280.0,
                 cmd: list[str] | None = None) -> dict:
    """Runs one job with one fault; returns the report (timeline, phases, exit status).

    `cmd` replaces the prototype worker (it must publish snapshots to its agent, as a
    resilient step does, so the kill can be timed by the published step)."""
    os.makedirs(out, exist_ok=True)
    for f in glob.glob(os.path.join(out, "*")):
        os.remove(f)
    state = {"killed_at": None}
    launcher: Launcher | None = None

    def on_event(e: dict) -> None:
        if (fault in ("worker", "host") and state["killed_at"] is None
                and e["op"] == "progress" and e["worker_id"] == victim and e["step"] >= at_step):
            state["killed_at"] = e["t"]
            state["killed_step"] = e["step"]
            os.kill(launcher.worker_pids[victim], signal.SIGKILL)
            if fault == "host":
                os.kill(launcher.agents[victim].pid, signal.SIGKILL)

    if cmd is None:
        cmd = [sys.executable, "-m", "mnemojax._src.distributed.prototype_train", "--steps",
               str(steps), "--out", out, "--step-sleep-s", str(step_sleep_s)]
    if fault == "hang":
        cmd += ["--hang-worker", str(victim), "--hang-at-step", str(at_step)]
    options = LaunchOptions(nproc=nproc, devices_per_proc=devices_per_proc,
                            heartbeat_s=heartbeat_s, collective_timeout_s=collective_timeout_s,
                            hang_factor=10.0, hang_min_s=3.0, job_timeout_s=job_timeout_s)
    launcher = Launcher(options, cmd, on_event=lambda e: threading.Thread(
        target=on_event, args=(e,)).start() if e["op"] == "progress" else None)
    rc = launcher.run()
    report = _report(out, rc, launcher.events, state)
    report["_t0"] = state["killed_at"]  # wall time of the kill (None: no kill)
    report["shm_left"] = [n for n in os.listdir("/dev/shm") if n.startswith(launcher.shm_prefix)]
    report["pids"] = [p.pid for p in launcher.agents.values()] + list(
        launcher.worker_pids.values())
    return report


def _report(out: str, rc: int, launcher_events: list[dict], state: dict) -> dict:
    workers = []
    for path in sorted(glob.glob(os.path.join(out, "events-w*.jsonl"))):
        with open(path) as f:
            workers.extend(json.loads(line) for line in f if line.strip())
    report = {"rc": rc, "final": os.path.join(out, "final.npz"), "killed_step": None,
              "agents": {e["worker_id"]: e["address"] for e in launcher_events
                         if e["op"] == "hello"}}
    t0 = state["killed_at"]
    hang = [e for e in launcher_events if e["op"] == "hang"]
    if t0 is None and hang:
        t0 = next((e["t"] for e in workers if e["op"] == "hanging"), hang[0]["t"])
    if t0 is None:
        return report
    report["killed_step"] = state.get("killed_step")
    rel = lambda t: round(t - t0, 3)  # noqa: E731
    exits = [e for e in launcher_events if e["op"] in ("worker_exit", "agent_lost", "hang")
             and e["t"] >= t0 - 1]
    report["launcher_knows_s"] = rel(min(e["t"] for e in exits)) if exits else None
    per = {}
    for e in workers:
        w = per.setdefault(e["worker_id"], {})
        if e["op"] == "detect" and "detect_s" not in w:
            w["detect_s"], w["error"] = rel(e["t"]), e["error"]
        elif e["op"] == "reinitialized":
            w["reinitialized_s"], w["phases"] = rel(e["t"]), e["phases"]
            w["resume_step"], w["fetched_from"] = e["resume_step"], e["fetched_from"]
        elif e["op"] == "rebuilt":
            w["rebuilt_s"], w["compile_s"] = rel(e["t"]), e["compile_s"]
        elif e["op"] == "step" and e["generation"] > 0 and "next_good_step_s" not in w:
            w["next_good_step_s"] = rel(e["t"])
    report["workers"] = {k: v for k, v in per.items() if v}
    decided = [e for e in launcher_events if e["op"] == "decided"]
    if decided:
        report["decided_s"] = rel(decided[0]["t"])
        report["resume_step"] = decided[0]["resume_step"]
    return report


def compare(final_path: str, steps: int) -> float:
    """Max relative deviation from the failure-free reference; raises if not allclose."""
    from mnemojax._src.distributed.prototype_train import reference_params
    ref = reference_params(steps)
    got = np.load(final_path)
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    return max(float(np.max(np.abs(got[k] - v))) for k, v in ref.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mnemojax._src.distributed.prototype_demo")
    p.add_argument("--nproc", type=int, default=3)
    p.add_argument("--devices-per-proc", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--fault", choices=("none", "worker", "host", "hang"), default="worker")
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--at-step", type=int, default=6)
    p.add_argument("--collective-timeout-s", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="mnemojax-demo-")
    report = run_scenario(out=out, nproc=args.nproc, devices_per_proc=args.devices_per_proc,
                          steps=args.steps, fault=args.fault, victim=args.victim,
                          at_step=args.at_step, collective_timeout_s=args.collective_timeout_s)
    if report["rc"] == 0:
        report["max_abs_diff_vs_reference"] = compare(report["final"], args.steps)
    report.pop("pids")
    print(json.dumps(report, indent=1))
    return report["rc"]


if __name__ == "__main__":
    sys.exit(main())
