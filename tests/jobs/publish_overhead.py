"""What publishing every step to the agent costs across processes (issue 13, item 6).

    PYTHONPATH=. python -m tests.jobs.publish_overhead [--hidden 2048] [--steps 60]
        [--repeats 3]

Runs a resilient MLP (512 -> hidden -> 512, Adam; ~25 MB of state at the default width)
under `mnemojax.testing.run_scenario`: 2 processes x 2 CPU devices, a (2, 2) data x model
mesh, so worker 0 owns every snapshot shard and publishes the whole state after every step.
Five modes, interleaved ``--repeats`` times: ``off`` (a budget of one byte: nothing is
published), ``nowait`` (the copy into the agent's shared memory done before the step
returns, without waiting for the buddy to hold the last snapshot: session 8's synchronous
publish), ``sync`` (the default since session 9: the same, after the agent says its buddy
holds the last snapshot), ``series`` (`SnapshotOptions.replicate_in_series`: the step
returns once the buddy holds the snapshot just published) and ``background``
(`SnapshotOptions.overlap_publish`: the copy runs while the next step does). Prints worker
0's median step time per mode (steps after the first 10), the ratios to ``off``, the median
time of its copy into the agent's shared memory (the CRC32C included) and the mean time per
publish it waited for the buddy; the rest of the cost is the agents' replication to the ring
buddy, on the same cores here. Every process ends with the launcher (bounded by
``--timeout-s``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

MODES = ("off", "nowait", "sync", "series", "background")
WARMUP = 10  # steps left out: the compile, the first executions


def _timed(cls: type, name: str) -> list[float]:
    """Wraps method ``name`` of ``cls`` to time every call; returns the list of seconds."""
    import time

    seconds: list[float] = []
    method = getattr(cls, name)

    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return method(self, *a, **k)
        finally:
            seconds.append(time.perf_counter() - t)

    setattr(cls, name, timed)
    return seconds


def worker(args: argparse.Namespace) -> None:
    import mnemojax

    session = mnemojax.initialize()
    if args.mode == "nowait":  # no wait for the buddy before overwriting a slot
        from mnemojax._src.distributed.worker.session import DistributedSession

        DistributedSession._await_replicated = lambda *a, **k: None  # type: ignore[method-assign]

    import jax
    import numpy as np

    from mnemojax._src.distributed.worker.agent_client import AgentClient
    from mnemojax.models.tasks import build_mlp, mlp_train_step

    copies = _timed(AgentClient, "publish")  # each copy into the agent's shared memory
    waits = _timed(AgentClient, "await_replicated")  # each wait for the buddy

    me = session.world.stable_id if session is not None else 0
    mesh = jax.make_mesh((2, jax.device_count() // 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, optimizer = build_mlp(seed=0, din=512, dhidden=args.hidden, dout=512)
    budget = 1 if args.mode == "off" else 8 << 30
    step = mnemojax.resilient(mlp_train_step, mesh=mesh, options=mnemojax.ResilienceOptions(
        event_log=str(Path(args.out) / f"events-{args.mode}-w{me}.jsonl"),
        run_name=f"{args.mode}-w{me}",
        compile=mnemojax.CompileOptions(precompile=False, cache_dir=None),
        snapshot=mnemojax.SnapshotOptions(host_memory_budget_bytes=budget,
                                          overlap_publish=args.mode == "background",
                                          replicate_in_series=args.mode == "series")))
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(64, 512)).astype(np.float32),
             "y": rng.integers(0, 512, size=(64,)).astype(np.int32)}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mnemojax.errors.SnapshotBudgetWarning)  # "off"
        for _ in range(args.steps):
            step(model, optimizer, batch)
    step.close()
    if session is not None:
        session.finish()
    (Path(args.out) / f"copies-w{me}.json").write_text(json.dumps(copies))
    (Path(args.out) / f"waits-w{me}.json").write_text(json.dumps(waits))


def median_step_s(path: Path) -> float:
    from mnemojax._src.events import read_events

    steps = [e["duration_s"] for e in read_events(path) if e["kind"] == "step"]
    return statistics.median(steps[WARMUP:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.jobs.publish_overhead")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="sync", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from mnemojax.testing import run_scenario

    medians: dict[str, list[float]] = {m: [] for m in MODES}
    copy_ms: dict[str, list[float]] = {m: [] for m in MODES}
    wait_ms: dict[str, list[float]] = {m: [] for m in MODES}
    params = 512 * args.hidden * 2 + args.hidden + 512
    print(f"MLP 512-{args.hidden}-512 ({params / 1e6:.2f} M params, ~{params * 12 / 1e6:.0f} "
          f"MB with Adam), 2 processes x 2 CPU devices, mesh (2, 2), {args.steps} steps")
    for r in range(args.repeats):
        for mode in MODES:
            out = Path(tempfile.mkdtemp(prefix=f"mnemojax-publish-{mode}-"))
            cmd = [sys.executable, "-m", "tests.jobs.publish_overhead", "--worker", "--mode",
                   mode, "--out", str(out), "--hidden", str(args.hidden), "--steps",
                   str(args.steps)]
            report = run_scenario(cmd, nproc=2, devices_per_proc=2, job_timeout_s=args.timeout_s)
            if report["rc"] != 0:
                print(f"{mode}: the job failed (exit {report['rc']}); output in {out}")
                return 1
            medians[mode].append(median_step_s(out / f"events-{mode}-w0.jsonl"))
            copied = json.loads((out / "copies-w0.json").read_text())[WARMUP:]
            # One wait per publish; in series the world's first publish also waits before
            # its copy, so the last waits are those of the publishes counted.
            waited = json.loads((out / "waits-w0.json").read_text())[-len(copied) or None:]
            copy_ms[mode].append(statistics.median(copied) * 1e3 if copied else 0.0)
            wait_ms[mode].append(sum(waited) / len(copied) * 1e3 if copied else 0.0)
            print(f"  run {r + 1} {mode:>10}: median step {medians[mode][-1] * 1e3:.1f} ms, "
                  f"copy into the agent {copy_ms[mode][-1]:.1f} ms, wait for the buddy "
                  f"{wait_ms[mode][-1]:.2f} ms per publish (mean)")
    off = statistics.median(medians["off"])
    print(f"\n| mode | worker 0's median step (ms, median of {args.repeats}) | x off | "
          "its copy into the agent (ms) | its waits for the buddy per publish (ms) |")
    print("|---|---:|---:|---:|---:|")
    for mode in MODES:
        m = statistics.median(medians[mode])
        print(f"| {mode} | {m * 1e3:.1f} | {m / off:.3f} | "
              f"{statistics.median(copy_ms[mode]):.1f} | "
              f"{statistics.median(wait_ms[mode]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
