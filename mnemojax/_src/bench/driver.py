"""One bench invocation: runs (a)-(d), and (e)-(f), on the same model, batches and faults.

Order: (a)+(b) interleaved → the checkpoint save calibration → the Young/Daly interval →
(c) → (d) → (e) → (f). (a)-(d) run in this process or one process at a time, the device
loss of (c) simulated in the runtime; (e) and (f) run ``cfg.processes`` processes with a
real SIGKILL (`multiproc`). Writes ``events.jsonl`` (runs a-d), ``bench.json``,
``steps_vs_time.png`` and ``recovery_phases.png`` under the output directory, and the
event logs, worker output and final states of (e) and (f) under ``processes/``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from mnemojax._src.bench import baseline, multiproc, plots, report, runs, summary
from mnemojax._src.bench.config import BenchConfig, preset_path
from mnemojax._src.bench.interval import checkpoint_interval
from mnemojax._src.events import jsonable

log = logging.getLogger("mnemojax")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_bench(cfg: BenchConfig, *, preset: str, out_dir: str | os.PathLike,
              progress: bool = True, processes: bool = False) -> dict:
    """Runs the runs and writes the outputs; returns the summary (``bench.json``).

    Args:
        processes: also run (e) and (f), the real process kill, ``cfg.process_pairs``
            times each (about a minute per pair on the tiny preset: two multi-process
            jobs, with the launcher's default collective timeout in (e)).
    """
    import jax
    import numpy as np

    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events_path = out / "events.jsonl"
    events_path.unlink(missing_ok=True)
    cache = out / "xla-cache"  # fresh: the first compile of every run is cold
    shutil.rmtree(cache, ignore_errors=True)
    corpus = BigramCorpus(cfg.model["vocab_size"], cfg.model["seq_len"], seed=cfg.seed)
    batches = [corpus.batch(i, cfg.batch_size) for i in range(cfg.steps)]
    mesh = jax.make_mesh(cfg.mesh, ("data", "model"),
                         devices=jax.devices()[:int(np.prod(cfg.mesh))],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    t_bench = time.perf_counter()
    results: dict[str, dict] = {}

    _say(progress, "(a) no snapshots and (b) snapshot every step, failure-free, interleaved")
    results.update(runs.failure_free_pair(cfg, mesh, batches, events_path,
                                          cache_dir=str(cache), progress=progress))
    a = results[runs.RUN_A]

    _say(progress, f"calibrating the checkpoint save ({cfg.calibration_saves} Orbax saves)")
    save_cost = baseline.calibrate_save_cost(cfg, mesh, out / "calibration_ckpt")
    if cfg.mtbf_s is not None:
        mtbf, rule = cfg.mtbf_s, "stated (--mtbf-s / preset mtbf_s)"
    else:
        mtbf = a["wall_s"] / len(cfg.faults)
        rule = (f"default: failure-free run (a) wall time {a['wall_s']:.1f} s / "
                f"{len(cfg.faults)} faults")
    interval = checkpoint_interval(save_cost.blocking_s, mtbf, a["steady_step_s"], cfg.steps)
    _say(progress, f"baseline checkpoint every {interval.steps} steps (Young/Daly: save "
                   f"{save_cost.blocking_s:.3f} s, MTBF {mtbf:.1f} s, step "
                   f"{a['steady_step_s'] * 1e3:.1f} ms)")

    _say(progress, "(c) mnemojax with faults (every-step snapshots, precompile on)")
    results[runs.RUN_C] = runs.run_with_faults(cfg, mesh, batches, events_path,
                                               cache_dir=str(cache), progress=progress)

    _say(progress, "(d) classical baseline with the same faults (Orbax + process restart)")
    final_path = out / "baseline_final.npz"
    final_path.unlink(missing_ok=True)
    results[summary.RUN_D] = baseline.run_baseline(
        cfg, preset=str(preset_path(preset).resolve()), out_dir=out, events_path=events_path,
        interval_steps=interval.steps, run=summary.RUN_D, compile_cache=str(cache),
        final_state=str(final_path))
    with np.load(final_path) as npz:
        baseline_final = [npz[f"arr_{i}"] for i in range(len(npz.files))]

    process_runs = None
    if processes:
        process_runs = run_process_pairs(cfg, preset=str(preset_path(preset).resolve()),
                                         out=out / "processes", cache=str(cache),
                                         interval_steps=interval.steps, progress=progress)

    goodput = {acc.run: acc.as_dict() for acc in report.account_log(events_path)}
    env = {"model_params": GPTConfig(**cfg.model).param_count(), "jax": jax.__version__,
           "python": platform.python_version(), "cpu_count": os.cpu_count(),
           "devices": len(jax.devices()), "platform": jax.default_backend(), "bench_s": time.perf_counter() - t_bench,
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    s = summary.build_summary(cfg, runs=results, save_cost=save_cost, interval=interval,
                              mtbf_rule=rule, baseline_final=baseline_final,
                              goodput=goodput, environment=env,
                              process_runs=process_runs)
    write_outputs(s, out)
    return s


def run_process_pairs(cfg: BenchConfig, *, preset: str, out: Path, cache: str,
                      interval_steps: int, progress: bool) -> dict[str, list[dict]]:
    """Runs (e) then (f), ``cfg.process_pairs`` times (under ``out/e``, ``out/f``, then
    ``out/e2``, ``out/f2``, ...); returns every run of each, with its final state's
    leaves. Each pair starts from a fresh compilation cache (a subdirectory of `cache`):
    the pairs are alike, none finds the entries an earlier pair wrote."""
    import numpy as np

    runs: dict[str, list[dict]] = {multiproc.RUN_E: [], multiproc.RUN_F: []}
    for i in range(cfg.process_pairs):
        tag = f" ({i + 1} of {cfg.process_pairs})" if cfg.process_pairs > 1 else ""
        suffix = str(i + 1) if i else ""
        pair_cache = Path(cache) / f"pair{i + 1}"
        shutil.rmtree(pair_cache, ignore_errors=True)
        for name, run in zip("ef", _process_pair(cfg, preset=preset, out=out,
                                                 cache=str(pair_cache),
                                                 interval_steps=interval_steps,
                                                 progress=progress, tag=tag, suffix=suffix),
                             strict=True):
            with np.load(out / f"{name}{suffix}" / "final.npz") as npz:
                run["final_state"] = [npz[f"arr_{j}"] for j in range(len(npz.files))]
            runs[multiproc.RUN_E if name == "e" else multiproc.RUN_F].append(run)
    return runs


def _process_pair(cfg: BenchConfig, *, preset: str, out: Path, cache: str,
                  interval_steps: int, progress: bool, tag: str, suffix: str
                  ) -> tuple[dict, dict]:
    common = {"preset": preset, "nproc": cfg.processes,
              "devices_per_proc": cfg.devices_per_process, "victim": cfg.process_victim,
              "kill_after_step": cfg.process_kill_after_step, "compile_cache": cache,
              "timeout_s": cfg.worker_timeout_s}
    kill = (f"worker {cfg.process_victim} of {cfg.processes} SIGKILLed after step "
            f"{cfg.process_kill_after_step}")
    _say(progress, f"(e){tag} mnemojax launch, {cfg.processes} processes x "
                   f"{cfg.devices_per_process} devices, {kill}")
    e = multiproc.run_mnemojax_job(cfg, out_dir=out / f"e{suffix}", **common,
                                   collective_timeout_s=cfg.collective_timeout_s)
    _say(progress, f"(e){tag} next good step {e['next_good_step_s']:.2f} s after the kill")
    _say(progress, f"(f){tag} classical jax.distributed + Orbax every {interval_steps} "
                   f"steps, {kill}, every process restarted")
    f = multiproc.run_classical_job(cfg, out_dir=out / f"f{suffix}",
                                    interval_steps=interval_steps, **common)
    _say(progress, f"(f){tag} next good step {f['next_good_step_s']:.2f} s after the kill")
    return e, f


def write_outputs(s: dict, out: Path) -> None:
    """bench.json and the two PNGs."""
    (out / "bench.json").write_text(json.dumps(s, indent=1, default=jsonable))
    series = []
    for name, title in summary.TITLES.items():
        r = s["runs"][name]
        series.append((title, r["timeline"], r.get("faults_at", [])))
    for name, title in summary.PROCESS_TITLES.items():
        r = (s.get("processes") or {}).get(name)
        if r:
            series.append((title, r["timeline"], [(r["fault_at_s"], r["killed_step"])]))
    plots.save_steps_vs_time(out / "steps_vs_time.png", series,
                             f"mnemojax bench ({s['preset']}): steps against wall time "
                             "(x = fault; (a),(b),(c) on their own clock)")
    bars = {}
    for rec in s["runs"][runs.RUN_C]["recoveries"]:
        bars[f"mnemojax\nstep {rec['step']}"] = {
            "before surfacing": rec.get("before_surfacing_s", 0.0), **rec["phases_s"]}
    restart_names = {"detect": "exit seen", "compile": "compile (restart)"}
    for rec in s["runs"][summary.RUN_D]["recoveries"]:  # names of their own: stacked in order
        bars[f"baseline\nstep {rec['step']}"] = {restart_names.get(k, k): v
                                                  for k, v in rec["phases_s"].items()}
    ratio = s["figures"]["recovery_s"]["ratio"]
    plots.save_recovery_phases(out / "recovery_phases.png", bars,
                               f"recovery phases ({s['preset']}); baseline/mnemojax = "
                               f"{ratio:.1f}x" if ratio else "recovery phases")


