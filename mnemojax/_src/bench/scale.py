"""How cost grows with state: recovery time, snapshot overhead and host memory at several
model sizes, side by side (issue 13 item 7; issue 12's snapshot-memory figure).

python -m mnemojax._src.bench.scale --out runs/scale [--sizes 0.1m,11m,40m] [--steps 13]

For each size, one process with 8 virtual CPU devices, mesh data=4 x model=2, the GPT of
`models.gpt`:

* (a) no snapshots and (b) a snapshot every step, interleaved in blocks (`runs.
  failure_free_pair`): the steady step time of each, and (b)/(a);
* (c) every-step snapshots, the next meshes compiled ahead, one device lost at the middle
  step (`runs.run_with_faults`): the recovery's total and phases;
* the state's bytes (parameters and optimizer state), one snapshot's bytes (replica 0 of
  every shard), the host memory the two snapshot slots take, and their ratio to the state.

Prints a table and writes ``scale.json``, ``scale.md`` and ``scale.png`` under ``--out``.
The figures are this machine's: quote medians and ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from mnemojax._src.bench.config import BenchConfig
from mnemojax._src.config import FaultSpec

# name -> GPT config (models.gpt.GPTConfig fields); ~0.1 M, ~11 M and ~40 M parameters.
SIZES: dict[str, dict[str, int]] = {
    "0.1m": {"vocab_size": 128, "seq_len": 32, "d_model": 64, "n_heads": 2, "n_layers": 2,
             "d_ff": 256},
    "11m": {"vocab_size": 1024, "seq_len": 128, "d_model": 384, "n_heads": 6, "n_layers": 6,
            "d_ff": 1536},
    # ~85 M (d_model 768, 12 layers) needed 24 GiB here and was killed for memory: the
    # data axis holds 4 replicas of the state, and (a) and (b) are alive together.
    "40m": {"vocab_size": 1024, "seq_len": 64, "d_model": 512, "n_heads": 8, "n_layers": 12,
            "d_ff": 2048},
}
SLOTS = 2  # snapshot buffers a `SnapshotStore` keeps (the copy in flight, the last good)


def config_for(size: str, *, steps: int, block_steps: int) -> BenchConfig:
    """The bench config of one size: `steps` steps, one device lost at the middle one."""
    return BenchConfig(name=f"scale-{size}", model=SIZES[size], steps=steps, batch_size=12,
                       learning_rate=1e-3, block_steps=block_steps,
                       faults=(FaultSpec(step=steps // 2 + 1, devices=(3,)),),
                       max_precompiled=2)


def measure(size: str, out: Path, *, steps: int, block_steps: int) -> dict[str, Any]:
    """Runs (a), (b) and (c) for one size; returns its row of figures."""
    import jax
    import numpy as np

    from mnemojax._src.bench import runs
    from mnemojax.models.data import BigramCorpus

    cfg = config_for(size, steps=steps, block_steps=block_steps)
    mesh = jax.make_mesh(cfg.mesh, ("data", "model"), devices=jax.devices()[:8],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    corpus = BigramCorpus(cfg.model["vocab_size"], cfg.model["seq_len"], seed=cfg.seed)
    batches = [corpus.batch(i, cfg.batch_size) for i in range(cfg.steps)]
    events = out / f"events-{size}.jsonl"
    cache = str(out / "xla-cache")
    pair = runs.failure_free_pair(cfg, mesh, batches, events, cache_dir=cache)
    faults = runs.run_with_faults(cfg, mesh, batches, events, cache_dir=cache)
    a, b = pair[runs.RUN_A], pair[runs.RUN_B]
    state_bytes = sum(x.nbytes for x in a["final_state"])
    params = _param_count(cfg)
    [rec] = faults["recoveries"] or [None]
    snapshot = b["snapshot_bytes"]
    return {
        "size": size, "params": params, "state_bytes": state_bytes,
        "step_s": {"a": a["steady_step_s"], "b": b["steady_step_s"]},
        "snapshot_overhead": b["steady_step_s"] / a["steady_step_s"],
        "snapshot_bytes": snapshot, "snapshot_copy_median_s": b["snapshot_copy_median_s"],
        "snapshot_host_bytes": SLOTS * snapshot,
        "snapshot_host_over_state": SLOTS * snapshot / state_bytes if state_bytes else math.nan,
        "peak_rss_bytes": {"ab": a["peak_rss_bytes"], "c": faults["peak_rss_bytes"]},
        "recovery": None if rec is None else {
            "total_s": rec["total_s"], "phases_s": rec["phases_s"],
            "executable": rec["executable"], "new_mesh": rec["new_mesh_shape"],
            "steps_lost": rec["steps_lost"],
            "over_step": rec["total_s"] / a["steady_step_s"]},
        "final_allclose_b_to_a": bool(all(
            np.allclose(x, y, rtol=1e-5, atol=1e-6)
            for x, y in zip(a["final_state"], b["final_state"], strict=True))),
        "final_max_diff_c_to_a": float(max(
            np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
            for x, y in zip(a["final_state"], faults["final_state"], strict=True))),
    }


def _param_count(cfg: BenchConfig) -> int:
    from flax import nnx

    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt

    model, _ = build_gpt(GPTConfig(**cfg.model), seed=cfg.seed, learning_rate=cfg.learning_rate)
    return sum(x.size for x in __import__("jax").tree.leaves(nnx.state(model, nnx.Param)))


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table."""
    mib = 1 << 20
    lines = ["| size | params | state | step (a) | step (b) | (b)/(a) | snapshot | "
             "snapshot slots / state | recovery | recovery / step | executable |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        rec = r["recovery"] or {}
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.2f} M | {r['state_bytes'] / mib:.1f} MiB | "
            f"{r['step_s']['a'] * 1e3:.1f} ms | {r['step_s']['b'] * 1e3:.1f} ms | "
            f"x{r['snapshot_overhead']:.3f} | {r['snapshot_bytes'] / mib:.1f} MiB | "
            f"{r['snapshot_host_over_state']:.2f} | "
            f"{rec.get('total_s', math.nan):.3f} s | {rec.get('over_step', math.nan):.1f} | "
            f"{rec.get('executable', '-')} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Three panels against the parameter count (log scale): recovery time, snapshot
    overhead, host memory of the snapshot slots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = [r["params"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), constrained_layout=True)
    panels = [
        ("recovery (s)", [(r["recovery"] or {}).get("total_s", math.nan) for r in rows]),
        ("every-step snapshot overhead (b)/(a)", [r["snapshot_overhead"] for r in rows]),
        ("snapshot host memory (MiB)", [r["snapshot_host_bytes"] / (1 << 20) for r in rows]),
    ]
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.plot(params, values, marker="o")
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(title)
        for p, v, r in zip(params, values, rows, strict=True):
            ax.annotate(r["size"], (p, v), textcoords="offset points", xytext=(4, 4))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mnemojax._src.bench.scale")
    p.add_argument("--out", default="runs/scale")
    p.add_argument("--sizes", default=",".join(SIZES),
                   help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--steps", type=int, default=13, help="steps per run (>= 5)")
    p.add_argument("--block-steps", type=int, default=3)
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or args.steps < 5 or args.block_steps < 1:
        p.error(f"sizes {unknown} unknown (known: {list(SIZES)}), or steps={args.steps} < 5"
                if unknown or args.steps < 5 else f"block_steps={args.block_steps} < 1")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in sizes:
        t0 = time.perf_counter()
        rows.append(measure(size, out, steps=args.steps, block_steps=args.block_steps))
        print(f"{size}: measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
    text = table(rows)
    print(text)
    (out / "scale.md").write_text(text + "\n")
    (out / "scale.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "scale.png")
    print(f"wrote {out / 'scale.md'}, scale.json and scale.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
