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
from pathlib import Path

log = logging.getLogger("mnemojax")

KINDS = ("lose", "lose_block", "lose_twice", "hang", "transient", "corrupt", "memory", "nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-rate", type=float, default=0.06,
                        help="probability of a fault per step")
    parser.add_argument("--max-device-losses", type=int, default=4)
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")


def run(args: argparse.Namespace) -> int:
    from mnemojax._src.config import configure_devices

    configure_devices(8, who="mnemojax chaos")
    report = run_chaos(steps=args.steps, seed=args.seed, fault_rate=args.fault_rate,
                       max_device_losses=args.max_device_losses)
    print(json.dumps({k: v for k, v in report.items() if k != "faults"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


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
    import optax
    from flax import nnx

    import mnemojax
    from mnemojax._src.events import read_events
    from models import MLP

    tmp = Path(workdir or tempfile.mkdtemp(prefix="mnemojax-chaos-"))
    rng = np.random.default_rng(seed)
    data = np.random.default_rng(seed + 1)
    clean = [{"x": data.normal(size=(24, 16)).astype(np.float32),
              "y": data.integers(0, 4, size=(24,)).astype(np.int32)} for _ in range(steps)]

    def build():
        with nnx.use_eager_sharding(False):
            model = MLP(16, 64, 4, rngs=nnx.Rngs(seed))
            return model, nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    def train_step(model, optimizer, batch):
        def loss_fn(m):
            logits = m(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return {"loss": loss}

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
    model, optimizer = build()
    step = mnemojax.resilient(train_step, mesh=mesh, options=options, fault_injector=faults)
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

    ref_model, ref_opt = build()
    ref_step = nnx.jit(train_step)
    for batch in clean:
        ref_step(ref_model, ref_opt, batch)
    got = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]
    want = [np.asarray(x) for x in jax.tree.leaves(nnx.state((ref_model, ref_opt)))]
    max_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want, strict=True))
    exact = all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want,
                                                                         strict=True))

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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(steps=60, seed=0, fault_rate=0.1, max_device_losses=4,
                                    json=None)))
