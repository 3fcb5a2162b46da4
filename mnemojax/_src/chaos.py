"""`mnemojax chaos`: a random fault schedule, then proof that nothing was lost.

A seeded generator injects, step by step, every fault kind mnemojax handles: device loss
(at dispatch or at the wait), a second loss during the recovery, hangs, transient errors,
host snapshot corruption, memory pressure and NaN batches. The run must end with the
state of a failure-free plain Flax run (SGD, so reduction-order differences stay tiny) on
the clean batches, and every injected fault must appear in the event log.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

log = logging.getLogger("mnemojax")

KINDS = ("lose", "lose_block", "lose_twice", "hang", "transient", "corrupt", "memory", "nan")


PROCESS_KINDS = ("kill", "host", "hang", "corrupt", "kill_in_agreement", "nan", "transient")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None,
                        help="steps (default 300; 40 with --processes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-rate", type=float, default=None,
                        help="probability of a fault per step (default 0.06; 0.12 with "
                             "--processes)")
    parser.add_argument("--max-device-losses", type=int, default=4)
    parser.add_argument("--processes", type=int, default=0,
                        help="N >= 2: run N worker processes x 2 CPU devices under the "
                             "launcher and do process faults to them (kill, whole host, hang, "
                             "corrupt copy, kill during the agreement) besides NaN batches "
                             "and transient errors")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")


def run(args: argparse.Namespace) -> int:
    if args.processes:
        report = run_chaos_processes(
            nproc=args.processes, steps=args.steps or 40, seed=args.seed,
            fault_rate=0.12 if args.fault_rate is None else args.fault_rate)
        print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        return 0 if report["ok"] else 1
    from mnemojax._src.config import configure_devices

    configure_devices(8, who="mnemojax chaos")
    report = run_chaos(steps=args.steps or 300, seed=args.seed,
                       fault_rate=0.06 if args.fault_rate is None else args.fault_rate,
                       max_device_losses=args.max_device_losses)
    print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


def build(seed: int):
    """The chaos model (the test MLP, `mnemojax.models.tasks`) with SGD (SGD keeps the
    reduction-order differences between meshes tiny). Its step is `mlp_train_step`."""
    import optax

    from mnemojax.models.tasks import build_mlp

    return build_mlp(seed=seed, optimizer=optax.sgd(0.05))


def clean_batches(seed: int, steps: int) -> list[dict]:
    """The global batches of a chaos run (24 examples: every data width up to 4 divides)."""
    import numpy as np

    data = np.random.default_rng(seed + 1)
    return [{"x": data.normal(size=(24, 16)).astype(np.float32),
             "y": data.integers(0, 4, size=(24,)).astype(np.int32)} for _ in range(steps)]


def reference_leaves(seed: int, batches) -> list:
    """The failure-free run, plain Flax on one device: its state leaves."""
    import jax
    import numpy as np
    from flax import nnx

    from mnemojax.models.tasks import mlp_train_step

    model, optimizer = build(seed)
    step = nnx.jit(mlp_train_step)
    for batch in batches:
        step(model, optimizer, batch)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]


def compare(got, want) -> tuple[bool, float]:
    """(allclose at 1e-5 leaf by leaf, the largest absolute difference)."""
    import numpy as np

    if len(got) != len(want):
        return False, float("inf")
    max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want, strict=True))
    return all(np.allclose(a, b, rtol=1e-5, atol=1e-5)
               for a, b in zip(got, want, strict=True)), max_diff


def run_chaos(*, steps: int, seed: int, fault_rate: float = 0.06,
              max_device_losses: int = 4, workdir: str | None = None) -> dict:
    """Runs the chaos job; returns a report with ``ok`` and what went wrong if not."""
    if steps < 1 or not 0 <= fault_rate <= 1 or max_device_losses < 0:
        from mnemojax._src.errors import InvalidOptionError

        raise InvalidOptionError(
            f"steps={steps!r}, fault_rate={fault_rate!r}, max_device_losses="
            f"{max_device_losses!r}: expected steps >= 1, 0 <= fault_rate <= 1, losses >= 0")
    import jax
    import numpy as np
    from flax import nnx

    import mnemojax
    from mnemojax._src.events import read_events
    from mnemojax.models.tasks import mlp_train_step

    tmp = Path(workdir or tempfile.mkdtemp(prefix="mnemojax-chaos-"))
    rng = np.random.default_rng(seed)
    clean = clean_batches(seed, steps)

    faults = mnemojax.testing.FaultInjector()
    options = mnemojax.ResilienceOptions(
        nonfinite="skip_batch", event_log=str(tmp / "events.jsonl"), run_name=f"chaos-{seed}",
        snapshot=mnemojax.SnapshotOptions(every_steps=5),
        recovery=mnemojax.RecoveryOptions(hang_timeout_s=1.0, probe_timeout_s=1.0),
        compile=mnemojax.CompileOptions(precompile=False, cache_dir=None),
        persistent=mnemojax.PersistentOptions(directory=str(tmp / "ckpt"),
                                              memory_check_every_steps=1))
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, optimizer = build(seed)
    step = mnemojax.resilient(mlp_train_step, mesh=mesh, options=options, fault_injector=faults)
    planned: list[dict] = []
    losses_left = max_device_losses
    memory_used = False
    t0 = time.perf_counter()
    i = 0
    try:
        while i < len(clean):
            k = step.step_count + 1  # the step the next call runs
            kind = rng.choice(KINDS) if k > 1 and rng.random() < fault_rate else None
            mesh_devices = list(step.statistics.mesh_devices)
            if kind in ("lose", "lose_block", "hang", "lose_twice") and (
                    losses_left < (2 if kind == "lose_twice" else 1) or len(mesh_devices) < 4):
                kind = "transient"
            if kind == "memory" and memory_used:
                kind = "corrupt"
            batch = clean[i]
            if kind in ("lose", "lose_block", "hang", "lose_twice"):
                victims = [int(d) for d in rng.choice(mesh_devices, size=2, replace=False)]
                if kind == "hang":
                    faults.hang(k, victims[:1])
                elif kind == "lose_twice":
                    faults.lose_devices(k, victims[:1]).lose_devices_during_recovery(
                        k, victims[1:])
                else:
                    faults.lose_devices(k, victims[:1],
                                        surface="block" if kind == "lose_block" else "dispatch")
                used = 2 if kind == "lose_twice" else 1
                losses_left -= used
                planned.append({"step": k, "kind": kind, "devices": victims[:used]})
            elif kind == "transient":
                times = int(rng.integers(1, 3))
                faults.transient_error(k, times=times)
                planned.append({"step": k, "kind": kind, "times": times})
            elif kind == "corrupt":
                faults.corrupt_snapshot(k)
                planned.append({"step": k, "kind": kind})
            elif kind == "memory":
                faults.memory_pressure(k + 3, fraction=0.97)
                memory_used = True
                planned.append({"step": k + 3, "kind": kind})
            elif kind == "nan":
                planned.append({"step": k, "kind": kind})
                with warnings.catch_warnings():  # planned: the event log accounts for it
                    warnings.simplefilter("ignore", mnemojax.errors.NonFiniteSkipWarning)
                    step(model, optimizer, {"x": np.full_like(batch["x"], np.nan),
                                            "y": batch["y"]})
                continue  # skipped: the same clean batch comes next
            step(model, optimizer, batch)
            i += 1
        step.wait_snapshots()
    finally:
        faults.release_hung()
        step.close()
    wall_s = time.perf_counter() - t0
    stats = step.statistics

    got = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]
    exact, max_diff = compare(got, reference_leaves(seed, clean))

    events = list(read_events(tmp / "events.jsonl"))
    problems = _unaccounted(planned, faults.injected, events)
    return {
        "ok": exact and not problems,
        "seed": seed, "steps": steps, "wall_s": wall_s,
        "faults_planned": len(planned),
        "by_kind": {kd: sum(p["kind"] == kd for p in planned) for kd in KINDS},
        "recoveries": len(stats.recoveries), "transient_retries": stats.transient_retries,
        "skipped_batches": stats.skipped_batches,
        "final_mesh": stats.mesh_shape, "dead_devices": list(stats.dead_devices),
        "state_matches_reference": exact, "max_param_diff": max_diff,
        "unaccounted": problems, "faults": planned, "event_log": str(tmp / "events.jsonl"),
    }


def _unaccounted(planned, injected, events) -> list[str]:
    """Every injected fault must have left its trace in the event log."""
    problems = []
    faults = [e for e in events if e["kind"] == "fault"]
    lost = {d for e in faults if e.get("classification") == "device_failure"
            for d in e.get("failed_devices", [])}
    for p in planned:
        if p["kind"] in ("lose", "lose_block", "hang", "lose_twice"):
            missing = set(p["devices"]) - lost
            if missing:
                problems.append(f"step {p['step']}: {p['kind']} of {sorted(missing)} not in log")
    hangs = sum(1 for e in faults if e.get("hang"))
    if hangs < sum(p["kind"] == "hang" for p in planned):
        problems.append(f"{hangs} hang recoveries logged for "
                        f"{sum(p['kind'] == 'hang' for p in planned)} hangs")
    transients = sum(1 for e in faults if e.get("classification") == "transient")
    want_transients = sum(p.get("times", 0) for p in planned if p["kind"] == "transient")
    if transients != want_transients:
        problems.append(f"{transients} transient faults logged, {want_transients} injected")
    corrupted = sum(1 for f in injected if f.kind == "corrupted_buffers" and f.device_ids[0])
    corrupt_logged = sum(1 for e in faults if e.get("classification") == "corrupt_snapshot")
    if corrupt_logged < corrupted:
        problems.append(f"{corrupt_logged} corrupt snapshots logged, {corrupted} corrupted")
    nans = sum(1 for e in faults if e.get("classification") == "nonfinite")
    if nans != sum(p["kind"] == "nan" for p in planned):
        problems.append(f"{nans} NaN batches logged, "
                        f"{sum(p['kind'] == 'nan' for p in planned)} injected")
    if any(p["kind"] == "memory" for p in planned) and not any(
            e["kind"] == "preemption" and "memory" in e.get("trigger", "") for e in events):
        problems.append("memory pressure injected, no just-in-time checkpoint logged")
    return problems


def draw_process_schedule(*, nproc: int, steps: int, seed: int, fault_rate: float) -> dict:
    """A random schedule every fault of which the run must survive exactly.

    At most ``nproc - 1`` processes are lost (the (1, 2) mesh still holds the model), one
    host at a time (a host and its ring buddy lost together is a typed error, tested apart),
    process faults at least 5 steps apart. A transient error goes to a worker that lives to
    the end.

    Returns:
        ``faults`` (`ProcessFault` s), ``nan_steps``, ``transients`` ((worker, step) pairs)
        and ``planned`` (one dict per fault, for the report).
    """
    import numpy as np

    from mnemojax._src.distributed.launcher.scenario import ProcessFault

    rng = np.random.default_rng(seed)
    alive = list(range(nproc))
    faults, nan_steps, transient_steps, planned = [], [], [], []
    last = -10
    for k in range(2, steps - 1):
        if rng.random() >= fault_rate:
            continue
        kind = str(rng.choice(PROCESS_KINDS))
        need = 2 if kind == "kill_in_agreement" else 1
        if kind not in ("nan", "transient") and (len(alive) - need < 1 or k - last < 5):
            kind = "nan" if rng.random() < 0.5 else "transient"
        if kind == "nan":
            nan_steps.append(k)
            planned.append({"step": k, "kind": kind})
        elif kind == "transient":
            transient_steps.append(k)
        else:
            victims = [int(v) for v in rng.choice(alive, size=need, replace=False)]
            if kind == "kill_in_agreement":
                faults += [ProcessFault("kill", victims[0], k),
                           ProcessFault("kill_in_agreement", victims[1])]
            else:
                faults.append(ProcessFault(kind, victims[0], k))
            alive = [w for w in alive if w not in victims]
            planned.append({"step": k, "kind": kind, "victims": victims})
            last = k
    transients = [(int(rng.choice(alive)), k) for k in transient_steps]
    planned += [{"step": k, "kind": "transient", "victims": [w]} for w, k in transients]
    return {"faults": faults, "nan_steps": nan_steps, "transients": transients,
            "planned": sorted(planned, key=lambda p: p["step"])}


def run_chaos_processes(*, nproc: int, steps: int, seed: int, fault_rate: float = 0.12,
                        workdir: str | None = None, job_timeout_s: float = 600.0) -> dict:
    """Runs the chaos job on ``nproc`` processes under the launcher (see
    `draw_process_schedule`); returns a report with ``ok`` and what went wrong if not."""
    if nproc < 2 or steps < 8 or not 0 <= fault_rate <= 1:
        from mnemojax._src.errors import InvalidOptionError

        raise InvalidOptionError(
            f"processes={nproc!r}, steps={steps!r}, fault_rate={fault_rate!r}: expected "
            "processes >= 2, steps >= 8, 0 <= fault_rate <= 1")
    import numpy as np

    from mnemojax._src.distributed.launcher.scenario import process_alive, run_scenario
    from mnemojax._src.events import read_events

    tmp = Path(workdir or tempfile.mkdtemp(prefix="mnemojax-chaos-mp-"))
    tmp.mkdir(parents=True, exist_ok=True)
    plan = draw_process_schedule(nproc=nproc, steps=steps, seed=seed, fault_rate=fault_rate)
    cmd = [sys.executable, "-m", "mnemojax._src.chaos_worker", "--out", str(tmp),
           "--seed", str(seed), "--steps", str(steps),
           "--nan-steps", ",".join(map(str, plan["nan_steps"])),
           "--transients", ",".join(f"{w}:{k}" for w, k in plan["transients"])]
    t0 = time.perf_counter()
    report = run_scenario(cmd, nproc=nproc, devices_per_proc=2, faults=plan["faults"],
                          job_timeout_s=job_timeout_s)
    wall_s = time.perf_counter() - t0
    with open(tmp / "launcher-events.jsonl", "w") as f:  # for the post-mortem
        f.writelines(json.dumps(e, default=str) + "\n" for e in report["events"])
    exact, max_diff, stats = False, None, {}
    if report["rc"] == 0 and (tmp / "final.npz").exists():
        final = np.load(tmp / "final.npz")
        got = [final[f"arr_{i}"] for i in range(len(final.files))]
        exact, max_diff = compare(got, reference_leaves(seed, clean_batches(seed, steps)))
        stats = json.loads((tmp / "stats.json").read_text())
    events = [e for path in sorted(tmp.glob("events-w*.jsonl")) for e in read_events(path)]
    collateral = _collateral(report, events)
    problems = _unaccounted_processes(plan, report, events, stats, collateral)
    if report["rc"] != 0:
        problems.insert(0, f"the job exited with status {report['rc']}")
    if any(process_alive(p) for p in report["pids"]):
        problems.append("a process outlived the job")
    if report["shm_left"]:
        problems.append(f"shared memory outlived the job: {report['shm_left']}")
    return {
        "ok": exact and not problems,
        "seed": seed, "processes": nproc, "steps": steps, "wall_s": round(wall_s, 1),
        "faults_planned": len(plan["planned"]),
        "by_kind": {kd: sum(p["kind"] == kd for p in plan["planned"]) for kd in PROCESS_KINDS},
        "recoveries": len(stats.get("recoveries", [])),
        "lost_processes": sorted({w for r in stats.get("recoveries", [])
                                  for w in r["failed_processes"]}),
        "collateral_losses": collateral,
        "transient_retries": stats.get("transient_retries"),
        "skipped_batches": stats.get("skipped_batches"),
        "final_mesh": stats.get("mesh_shape"),
        "state_matches_reference": exact, "max_param_diff": max_diff,
        "unaccounted": problems, "faults": plan["planned"], "workdir": str(tmp),
    }


def _collateral(report: dict, events: list[dict]) -> list[dict]:
    """Workers lost without a fault done to them, with how they ended (launcher's view)."""
    lost = {w for e in events if e["kind"] == "fault" for w in e.get("failed_processes", [])}
    victims = {f["victim"] for f in report["fired"]}
    return [{"worker": w, "ended": [e["op"] + (f" {e['code']}" if "code" in e else "")
                                    for e in report["events"] if e.get("worker_id") == w
                                    and e["op"] in ("worker_exit", "hang", "evicted")]}
            for w in sorted(lost - victims)]


def _unaccounted_processes(plan: dict, report: dict, events: list[dict],
                           stats: dict, collateral: list[dict]) -> list[str]:
    """Every fault must have left its trace: in the workers' event logs (recoveries, NaN
    batches, transient retries) or the launcher's (corrupt copies, hangs, evictions).

    A worker lost without a fault done to it is a problem when mnemojax ended it (its
    watchdog or an eviction); one that crashed by itself when a peer died
    (the runtime, e.g. gloo, aborting) is recovered like any other loss and reported as
    ``collateral_losses`` instead."""
    problems = []
    fired = {(f["kind"], f["victim"]) for f in report["fired"]}
    for f in report["unfired"]:
        problems.append(f"{f['kind']} of worker {f['victim']} never fired")
    for f in report["fired"]:
        if "error" in f:
            problems.append(f"{f['kind']} of worker {f['victim']} could not be done: "
                            f"{f['error']}")
    lost = {w for e in events if e["kind"] == "fault"
            for w in e.get("failed_processes", [])}
    for kind, victim in fired:
        if victim not in lost:
            problems.append(f"{kind} of worker {victim}: no recovery lists it as lost")
    for c in collateral:
        fenced = [op for op in c["ended"] if op in ("hang", "evicted")]
        if fenced:  # mnemojax itself ended a worker nobody harmed: a false alarm
            problems.append(f"worker {c['worker']} was lost without a fault done to it "
                            f"({fenced[0]})")
    launcher = report["events"]
    for f in report["fired"]:
        if f["kind"] == "corrupt" and f.get("corrupted_steps") and not any(
                e["op"] == "corrupt_copy" and e.get("origin") == f["victim"] for e in launcher):
            problems.append(f"corrupt copies of worker {f['victim']} were never reported")
        if f["kind"] == "hang" and not any(
                e["op"] in ("hang", "evicted") and e["worker_id"] == f["victim"]
                for e in launcher):
            problems.append(f"the hang of worker {f['victim']} was neither seen by the "
                            "watchdog nor ended by an eviction")
    if stats and stats.get("skipped_batches") != plan["nan_steps"]:
        problems.append(f"NaN batches at {plan['nan_steps']}, skipped "
                        f"{stats.get('skipped_batches')}")
    for worker, step in plan["transients"]:
        if not any(e["kind"] == "fault" and e.get("classification") == "transient"
                   and e["step"] == step and e.get("run") == f"w{worker}" for e in events):
            problems.append(f"the transient error of worker {worker} at step {step} is "
                            "not in its event log")
    return problems


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(steps=60, seed=0, fault_rate=0.1, max_device_losses=4,
                                    processes=0, json=None)))
