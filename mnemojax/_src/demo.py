"""`mnemojax demo`: the main job.

Trains the tiny GPT on 8 CPU devices (mesh data=4 x model=2), loses devices at the
configured steps, recovers and continues; then runs the failure-free reference with plain
Flax/optax, measures the steady-state cost of protection, and prints the report.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from mnemojax._src.config import configure_devices, load_config, shipped_config
from mnemojax._src.timing import interleaved_block_means

log = logging.getLogger("mnemojax")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(shipped_config("demo.toml")),
                        help="job config (TOML); default: configs/demo.toml")
    parser.add_argument("--steps", type=int, default=None, help="override the config's steps")
    parser.add_argument("--no-precompile", action="store_true",
                        help="do not compile fallback meshes ahead (recovery compiles)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, steps=args.steps)
    configure_devices(cfg.devices, who="mnemojax demo")
    report = run_job(cfg, precompile=not args.no_precompile, progress=not args.quiet)
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"\nreport written to {args.json}")
    return 0 if report["final_state_matches_reference"] else 1


def run_job(cfg, *, precompile: bool = True, progress: bool = True) -> dict:
    import jax
    import numpy as np
    from flax import nnx
    from tqdm import tqdm

    import mnemojax
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step

    gcfg = GPTConfig(**cfg.model)
    corpus = BigramCorpus(gcfg.vocab_size, gcfg.seq_len, seed=cfg.seed)
    batches = [corpus.batch(i, cfg.batch_size) for i in range(cfg.steps)]
    mesh = jax.make_mesh(cfg.mesh, ("data", "model"), devices=jax.devices()[:np.prod(cfg.mesh)],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    faults = mnemojax.testing.FaultInjector()
    for f in cfg.faults:
        faults.lose_devices(f.step, f.devices, surface=f.surface)
    options = mnemojax.ResilienceOptions(
        snapshot=mnemojax.SnapshotOptions(**cfg.snapshot),
        compile=mnemojax.CompileOptions(precompile=precompile))

    # 1. The protected run, with faults.
    model, optimizer = build_gpt(gcfg, seed=cfg.seed, learning_rate=cfg.learning_rate)
    step = mnemojax.resilient(lm_train_step, mesh=mesh, options=options, fault_injector=faults)
    losses, precompile_wait_s, precompiled_after_step1 = [], None, 0
    t_start = time.perf_counter()
    bar = tqdm(batches, desc="mnemojax (with faults)", disable=not progress, file=sys.stdout)
    for i, batch in enumerate(bar):
        losses.append(float(step(model, optimizer, batch)["loss"]))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", mesh="x".join(
            str(n) for n in step.statistics.mesh_shape.values()))
        if i == 0 and precompile and cfg.wait_for_precompile:
            t = time.perf_counter()
            step.wait_precompiled()
            precompile_wait_s = time.perf_counter() - t
            precompiled_after_step1 = step.statistics.precompiled_meshes
    wall_s = time.perf_counter() - t_start
    step.wait_snapshots()
    stats = step.statistics
    step.close()
    got = _host_leaves(nnx.state((model, optimizer)))

    # 2. The failure-free reference: plain Flax + optax on the same initial mesh.
    ref_losses = []
    want = _plain_run(gcfg, cfg, mesh, batches, progress, losses=ref_losses)
    max_diff = _max_diff(got, want)
    loss_diff = float(np.max(np.abs(np.array(losses) - np.array(ref_losses))))
    # The floating-point floor: the same failure-free run on the final mesh. Reductions
    # run in another order there, and Adam amplifies those last-bit differences over many
    # steps; a recovery that lost, repeated or reordered a step would be far above it.
    final_devices = [jax.devices()[i] for i in stats.mesh_devices]
    final_mesh = jax.make_mesh(tuple(stats.mesh_shape.values()), ("data", "model"),
                               devices=final_devices,
                               axis_types=(jax.sharding.AxisType.Auto,) * 2)
    floor = _max_diff(want, _plain_run(gcfg, cfg, final_mesh, batches, progress))
    exact = all(np.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want, strict=True))
    matches = bool(np.allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)) and (
        exact or max_diff <= 2 * floor)

    # 3. Steady-state cost of protection, rounds of blocks of steps, medians.
    overhead = measure_overhead(gcfg, mesh, corpus, batch_size=cfg.batch_size,
                                steps=cfg.overhead_steps, rounds=cfg.overhead_rounds,
                                seed=cfg.seed, learning_rate=cfg.learning_rate)

    return {
        "config": {"mesh": list(cfg.mesh), "steps": cfg.steps, "batch_size": cfg.batch_size,
                   "model_params": gcfg.param_count(), "precompile": precompile,
                   "faults": [{"step": f.step, "devices": list(f.devices),
                               "surface": f.surface} for f in cfg.faults]},
        "wall_s": wall_s,
        "precompile_wait_s": precompile_wait_s,
        "precompiled_after_step1": precompiled_after_step1,
        "statistics": stats.as_dict(),
        "losses": losses,
        "reference_losses": ref_losses,
        "max_loss_diff": loss_diff,
        "max_param_diff": max_diff,
        "float_floor_param_diff": floor,
        "exact_at_1e-5": bool(exact),
        "final_state_matches_reference": bool(matches),
        "overhead": overhead,
    }


def _loss_of(step, model, optimizer, batch) -> float:
    return float(step(model, optimizer, batch)["loss"])


def _plain_run(gcfg, cfg, mesh, batches, progress, losses=None):
    """Plain Flax + optax (no mnemojax) on `mesh`; returns the final host state."""
    import jax
    from flax import nnx
    from tqdm import tqdm

    from mnemojax.models.tasks import build_gpt, lm_train_step, shard_onto

    model, opt = build_gpt(gcfg, seed=cfg.seed, learning_rate=cfg.learning_rate)
    shard_onto(model, opt, mesh)
    step = nnx.jit(lm_train_step)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    shape = "x".join(str(n) for n in mesh.shape.values())
    for batch in tqdm(batches, desc=f"reference (plain Flax, {shape})", disable=not progress,
                      file=sys.stdout):
        loss = float(step(model, opt, jax.device_put(batch, batch_sharding))["loss"])
        if losses is not None:
            losses.append(loss)
    return _host_leaves(nnx.state((model, opt)))


def _max_diff(a, b) -> float:
    import numpy as np

    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def _host_leaves(state):
    import jax
    import jax.numpy as jnp
    import numpy as np

    def host(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return [host(x) for x in jax.tree.leaves(state)]


def measure_overhead(gcfg, mesh, corpus, *, batch_size: int, steps: int, rounds: int,
                     seed: int = 0, learning_rate: float = 3e-3, plain_step=None) -> dict:
    """Median step time of plain Flax vs mnemojax without and with snapshots: ``rounds``
    rounds of ``steps`` steps per configuration, the order rotating per round (also
    `make gpu-check`, `bench.gpu_check`). ``plain_step``: the plain run's
    ``nnx.jit(lm_train_step)``, when the caller has one compiled for these shapes already
    (default: a new one, compiled here)."""
    import jax
    from flax import nnx

    import mnemojax
    from mnemojax.models.tasks import build_gpt, lm_train_step, shard_onto

    batches = [corpus.batch(10_000 + i, batch_size) for i in range(steps)]
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    runners = {}

    plain_model, plain_opt = build_gpt(gcfg, seed=seed, learning_rate=learning_rate)
    shard_onto(plain_model, plain_opt, mesh)
    plain_step = plain_step if plain_step is not None else nnx.jit(lm_train_step)
    runners["plain_flax"] = lambda b: float(
        plain_step(plain_model, plain_opt, jax.device_put(b, batch_sharding))["loss"])

    mj_steps = {}  # name -> the resilient step
    variants = [
        ("mnemojax_no_snapshots", mnemojax.SnapshotOptions(every_steps=0,
                                                           unreplicated_every_steps=0)),
        ("mnemojax_default", mnemojax.SnapshotOptions()),
        ("mnemojax_snapshot_every_step", mnemojax.SnapshotOptions(every_steps=1))]
    if any(d.platform != "cpu" for d in mesh.devices.flat):  # (on CPU the default packs)
        variants.append(("mnemojax_snapshot_every_step_packed",
                         mnemojax.SnapshotOptions(every_steps=1, pack_copies=True)))
    for name, snap in variants:
        m, o = build_gpt(gcfg, seed=seed, learning_rate=learning_rate)
        # Precompile off: once its background compiles finish it costs nothing per step.
        opts = mnemojax.ResilienceOptions(snapshot=snap,
                                          compile=mnemojax.CompileOptions(precompile=False))
        s = mj_steps[name] = mnemojax.resilient(lm_train_step, mesh=mesh, options=opts)
        runners[name] = functools.partial(_loss_of, s, m, o)

    for run_one in runners.values():  # compile + warm up outside the timed rounds
        run_one(batches[0])
    medians: dict[str, list[float]] = {name: [] for name in runners}

    def run_block(name: str, _round: int) -> int:
        for b in batches:
            t = time.perf_counter()
            runners[name](b)
            medians[name].append(time.perf_counter() - t)
        if name in mj_steps:
            mj_steps[name].wait_snapshots()  # a copy still in flight belongs to this block
        return len(batches)

    times = interleaved_block_means(list(runners), rounds, run_block)
    for s in mj_steps.values():
        s.close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med["plain_flax"]
    bare = med["mnemojax_no_snapshots"]
    return {
        "median_step_s": med,
        "ratio_to_plain": {name: m / base for name, m in med.items()},
        "ratio_to_no_snapshots": {name: m / bare for name, m in med.items()},
        "default_snapshot_every_steps":
            mj_steps["mnemojax_default"].statistics.snapshot_every_steps,
        "median_of_steps_s": {name: statistics.median(ts) for name, ts in medians.items()},
        "rounds": rounds,
        "steps_per_round": len(batches),
        "snapshot_bytes": mj_steps["mnemojax_snapshot_every_step"].statistics.snapshot_bytes,
        "snapshot_copy_median_s":
            mj_steps["mnemojax_snapshot_every_step"].statistics.snapshot_copy_median_s,
    }


def format_report(r: dict) -> str:
    s = r["statistics"]
    lines = ["", "=" * 78, "mnemojax demo report", "=" * 78]
    c = r["config"]
    lines.append(f"model: tiny GPT, {c['model_params']:,} params; mesh data x model = "
                 f"{c['mesh'][0]} x {c['mesh'][1]}; {c['steps']} steps of "
                 f"{c['batch_size']} sequences")
    if r["precompile_wait_s"] is not None:
        lines.append(f"fallback executables compiled ahead after step 1: "
                     f"{r['precompiled_after_step1']} meshes (waited "
                     f"{r['precompile_wait_s']:.1f} s); {s['precompiled_meshes']} in all")
    lines.append(f"steps run: {s['steps_run']}, final mesh {s['mesh_shape']} on devices "
                 f"{list(s['mesh_devices'])}; dead {list(s['dead_devices'])}; "
                 f"spares {list(s['spare_devices'])}")
    lines.append("")
    lines.append("recoveries (seconds per phase):")
    head = (f"  {'step':>4} {'lost':>8} {'old->new mesh':>14} {'kind':>13} {'source':>22} "
            f"{'exe':>8} {'detect':>7} {'plan':>6} {'reshard':>7} {'compile':>7} "
            f"{'replay':>6} {'TOTAL':>6} {'lost':>4} {'groups kept/new':>15}")
    lines.append(head)
    for rec in s["recoveries"]:
        p = rec["phases_s"]
        shape = lambda d: "x".join(str(v) for v in d.values())  # noqa: E731
        lines.append(
            f"  {rec['step']:>4} {str(list(rec['failed_devices'])):>8} "
            f"{shape(rec['old_mesh_shape']) + '->' + shape(rec['new_mesh_shape']):>14} "
            f"{rec['plan_kind']:>13} {rec['source']:>22} {rec['executable']:>8} "
            f"{p['detect']:>7.3f} {p['plan']:>6.3f} {p['reshard']:>7.3f} {p['compile']:>7.3f} "
            f"{p['replay']:>6.3f} {rec['total_s']:>6.3f} {rec['steps_lost']:>4} "
            f"{str(rec['groups_kept']) + '/' + str(rec['groups_changed']):>15}")
    o = r["overhead"]
    lines.append("")
    lines.append(f"steady state: mean step time per round of {o['steps_per_round']} steps, "
                 f"median of {o['rounds']} rounds;")
    lines.append("  ratio to plain Flax / to mnemojax without snapshots:")
    for name, med in o["median_step_s"].items():
        lines.append(f"  {name:<32} {med * 1e3:8.2f} ms   x{o['ratio_to_plain'][name]:.3f}"
                     f"   x{o['ratio_to_no_snapshots'][name]:.3f}")
    lines.append(f"  (default: snapshots every {o['default_snapshot_every_steps']} steps, since "
                 "every shard has live replicas on this mesh)")
    lines.append(f"  snapshot: {o['snapshot_bytes'] / 1e6:.2f} MB per copy (replica-deduplicated)"
                 f", copied in {o['snapshot_copy_median_s'] * 1e3:.1f} ms (median, background)")
    lines.append("")
    verdict = "MATCH" if r["final_state_matches_reference"] else "MISMATCH"
    how = ("allclose at rtol=atol=1e-5" if r["exact_at_1e-5"] else
           f"max |diff| {r['max_param_diff']:.2e} <= 2 x the floating-point floor "
           f"{r['float_floor_param_diff']:.2e}" if verdict == "MATCH" else
           f"max |diff| {r['max_param_diff']:.2e} > 2 x the floating-point floor "
           f"{r['float_floor_param_diff']:.2e}")
    lines.append(f"final params + optimizer state vs the failure-free plain Flax run: {verdict}")
    lines.append(f"  {how}; per-step losses max diff {r['max_loss_diff']:.2e}")
    lines.append("  (floor: failure-free plain Flax on the initial vs the final mesh, which "
                 "reduce in another order)")
    lines.append(f"wall time of the run with faults: {r['wall_s']:.1f} s")
    return "\n".join(lines)
