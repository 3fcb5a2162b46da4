"""`make gpu-check`: what mnemojax costs on a GPU, beside what the hardware gives.

    python -m mnemojax._src.bench.gpu_check                   # the GPU; skips without one
    python -m mnemojax._src.bench.gpu_check --platform cpu    # the same run on CPU devices
    python -m mnemojax._src.bench.gpu_check --json out.json   # the figures as JSON too

One run prints, side by side:

1. Device-to-host throughput: a plain ``jax.device_get`` of a fresh train state, and
   mnemojax's snapshot copy of the state during training (every step), each as a
   percentage of the PCIe peak (``--pcie-peak-gbs``, default 52.8 GB/s, the D2H figure
   measured on H100-class hosts) and of this host's memcpy of the same bytes.
2. The every-step snapshot overhead: step time with a snapshot every step over step time
   without snapshots (target x1.01 on a GPU, x1.03 on CPU); off a CPU also with the state
   packed by the step for the copy (``SnapshotOptions(pack_copies=True)``, the default
   on CPU only: a few large transfers instead of one per leaf and device).
3. mnemojax's step overhead against plain ``nnx.jit``: without snapshots, at the default
   snapshot cadence and every step.

Step times are medians of interleaved blocks (`demo.measure_overhead`: every
configuration runs one block per round, the order rotating), never one timed run.

The model is a GPT over every device of the platform on the data axis: ``--size large``
(167 M parameters, 2.0 GB of f32 state with AdamW; the default on a GPU), ``small`` (13 k,
the default on CPU: a check of the tool, not a figure).

JAX needs a CUDA build for the GPU, at the version the project pins (``pip install
"jax[cuda12]>=0.10,<0.11"`` in ``.venv``); with none visible, the check says so and exits
0. Nothing here runs on import.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from mnemojax._src.bench.summary import OVERHEAD_MAX

PCIE_PEAK_GBS = 52.8  # D2H, measured on H100-class hosts (issue 13)

SIZES = {  # GPTConfig fields; large: 167 M params, small: 13 k
    "large": {"vocab_size": 32_000, "seq_len": 512, "d_model": 1024, "n_heads": 16,
              "n_layers": 8, "d_ff": 4096},
    "small": {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2,
              "n_layers": 1, "d_ff": 64},
}


def _platform_devices(platform: str) -> list | str:
    """The platform's devices, or why there are none."""
    import jax

    try:
        return list(jax.devices(platform))
    except RuntimeError as exc:
        return str(exc).splitlines()[0]


def _fresh_state_d2h(gcfg, mesh, corpus, step, *, batch_size: int,
                     n: int) -> dict[str, Any]:
    """``jax.device_get`` of the state after each of ``n`` plain steps (``step``, an
    ``nnx.jit`` of the train step): fresh arrays each time (JAX keeps an array's host copy
    once fetched), the step finished first."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mnemojax.models.tasks import build_gpt, shard_onto

    model, optimizer = build_gpt(gcfg)
    shard_onto(model, optimizer, mesh)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    times, nbytes = [], 0
    for i in range(n + 1):
        step(model, optimizer, jax.device_put(corpus.batch(20_000 + i, batch_size), sharding))
        leaves = [x for x in jax.tree.leaves(nnx.state((model, optimizer)))
                  if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
        jax.block_until_ready(leaves)
        t = time.perf_counter()
        host = jax.device_get(leaves)
        if i:  # the first fetch warms up the transfer path
            times.append(time.perf_counter() - t)
        nbytes = sum(x.nbytes for x in host)
    median = statistics.median(times)
    return {"bytes": nbytes, "median_s": median, "gbs": nbytes / median / 1e9}


def _memcpy_gbs(nbytes: int) -> float:
    """This host's memcpy bandwidth for ``nbytes`` (``np.copyto``, median of 20)."""
    import numpy as np

    from mnemojax._src.bench.micro import median_ms

    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    return nbytes / median_ms(lambda: np.copyto(dst, src), 20) / 1e6


def run_check(platform: str, *, size: str, steps: int, rounds: int, batch_size: int,
              n_devices: int | None = None,
              pcie_peak_gbs: float = PCIE_PEAK_GBS) -> dict[str, Any]:
    """Runs the three measurements on the first ``n_devices`` devices of ``platform`` (all
    by default); returns the figures."""
    import jax
    from flax import nnx

    from mnemojax._src.demo import measure_overhead
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import lm_train_step

    found = _platform_devices(platform)
    if isinstance(found, str):
        raise RuntimeError(f"no {platform} devices: {found}")
    devices = found[:n_devices]
    if batch_size % len(devices):
        raise ValueError(f"batch_size={batch_size} does not split over {len(devices)} "
                         f"{platform} devices")
    gcfg = GPTConfig(**SIZES[size])
    corpus = BigramCorpus(gcfg.vocab_size, gcfg.seq_len)
    mesh = jax.make_mesh((len(devices), 1), ("data", "model"), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    plain_step = nnx.jit(lm_train_step)  # compiled once, for both measurements
    with jax.default_device(devices[0]):
        d2h = _fresh_state_d2h(gcfg, mesh, corpus, plain_step, batch_size=batch_size,
                               n=steps)
        overhead = measure_overhead(gcfg, mesh, corpus, batch_size=batch_size, steps=steps,
                                    rounds=rounds, plain_step=plain_step)
    snap_s = overhead["snapshot_copy_median_s"]
    snap_bytes = overhead["snapshot_bytes"]
    snap_gbs = snap_bytes / snap_s / 1e9 if snap_s else None
    memcpy = _memcpy_gbs(d2h["bytes"])
    ratios = overhead["ratio_to_plain"]
    return {
        "platform": platform, "device_kind": devices[0].device_kind, "devices": len(devices),
        "model": SIZES[size], "size": size, "params": gcfg.param_count(),
        "state_bytes": d2h["bytes"],
        "batch_size": batch_size, "steps_per_block": steps, "rounds": rounds,
        "pcie_peak_gbs": pcie_peak_gbs, "memcpy_gbs": memcpy,
        "d2h_device_get": {**d2h, "pct_of_pcie_peak": 100 * d2h["gbs"] / pcie_peak_gbs,
                           "pct_of_memcpy": 100 * d2h["gbs"] / memcpy},
        "d2h_snapshot": {"bytes": snap_bytes, "median_s": snap_s, "gbs": snap_gbs,
                         "pct_of_pcie_peak": 100 * snap_gbs / pcie_peak_gbs if snap_gbs else None,
                         "pct_of_memcpy": 100 * snap_gbs / memcpy if snap_gbs else None},
        "median_step_s": overhead["median_step_s"],
        "every_step_snapshot_overhead":
            overhead["ratio_to_no_snapshots"]["mnemojax_snapshot_every_step"],
        # Off a CPU, the same with the state packed by the step (`pack_copies=True`).
        "every_step_packed_overhead": overhead["ratio_to_no_snapshots"].get(
            "mnemojax_snapshot_every_step_packed"),
        "every_step_target": OVERHEAD_MAX.get(platform),
        "step_overhead_vs_plain": {k: v for k, v in ratios.items() if k != "plain_flax"},
        "default_snapshot_every_steps": overhead["default_snapshot_every_steps"],
    }


def format_table(r: dict[str, Any]) -> str:
    def pct(x):
        return "-" if x is None else f"{x:5.1f} %"

    head = (f"mnemojax gpu-check: {r['devices']} x {r['device_kind']} ({r['platform']}); "
            f"GPT {r['size']} ({r['params']:,} params, {r['state_bytes'] / 1e6:,.1f} MB of "
            f"state with AdamW); "
            f"batch {r['batch_size']}; {r['rounds']} rounds of {r['steps_per_block']} steps")
    lines = [head, "", f"{'device -> host':<40}{'GB/s':>9}{'of PCIe peak':>15}"
             f"{'of memcpy':>12}", "-" * 76]
    for name, key in (("jax.device_get of a fresh state", "d2h_device_get"),
                      ("snapshot copy, every step (median)", "d2h_snapshot")):
        d = r[key]
        gbs = "-" if d["gbs"] is None else f"{d['gbs']:9.2f}"
        lines.append(f"{name:<40}{gbs:>9}{pct(d['pct_of_pcie_peak']):>15}"
                     f"{pct(d['pct_of_memcpy']):>12}")
    lines.append(f"{'  (PCIe peak, memcpy of the same bytes)':<40}{r['pcie_peak_gbs']:9.2f}"
                 f"{'':>15}{r['memcpy_gbs']:>10.2f}  GB/s")
    lines += ["", f"{'step (median of blocks)':<40}{'ms':>9}{'vs plain nnx.jit':>18}", "-" * 76]
    med = r["median_step_s"]
    for name, s in med.items():
        ratio = "" if name == "plain_flax" else f"x{r['step_overhead_vs_plain'][name]:.3f}"
        lines.append(f"{name:<40}{1e3 * s:9.2f}{ratio:>18}")
    target = r["every_step_target"]
    lines += ["", f"every-step snapshot overhead (vs no snapshots): "
              f"x{r['every_step_snapshot_overhead']:.3f}"
              + (f"  (target x{target:.2f} on {r['platform']})" if target else "")]
    if r.get("every_step_packed_overhead") is not None:
        lines.append(f"the same with the state packed by the step (pack_copies=True): "
                     f"x{r['every_step_packed_overhead']:.3f}")
    lines.append(f"default snapshot cadence here: every {r['default_snapshot_every_steps']} "
                 "step(s)")
    return "\n".join(lines)


def _prefer(platform: str) -> None:
    """On CPU, CPU is JAX's default backend too (mnemojax places on ``jax.devices()``);
    no effect once a backend is up."""
    if platform == "cpu":
        import jax

        jax.config.update("jax_platforms", "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mnemojax._src.bench.gpu_check",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--size", choices=tuple(SIZES), default=None,
                        help="model size (default: large on gpu, small on cpu)")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of blocks")
    parser.add_argument("--devices", type=int, default=None,
                        help="use the first N devices of the platform (default: all)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sequences per step (default: 8 per device)")
    parser.add_argument("--pcie-peak-gbs", type=float, default=PCIE_PEAK_GBS)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "devices"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    _prefer(args.platform)
    devices = _platform_devices(args.platform)
    if isinstance(devices, str):
        print(f"gpu-check: skipped, no {args.platform} device visible to JAX ({devices}). "
              "A GPU needs a CUDA jaxlib: pip install 'jax[cuda12]>=0.10,<0.11'; --platform cpu "
              "runs the same check on CPU devices.")
        return 0
    n = min(args.devices or len(devices), len(devices))
    size = args.size or ("large" if args.platform == "gpu" else "small")
    batch_size = args.batch_size or 8 * n
    r = run_check(args.platform, size=size, steps=args.steps, rounds=args.rounds,
                  batch_size=batch_size, n_devices=n, pcie_peak_gbs=args.pcie_peak_gbs)
    print(format_table(r), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
