"""The bench's figures: from the runs' results to ``bench.json`` and the table."""

from __future__ import annotations

import statistics
from typing import Any

from mnemojax._src.bench.multiproc import RUN_E, RUN_F, STEPS_PAST
from mnemojax._src.bench.runs import RUN_A, RUN_B, RUN_C

RUN_D = "d_baseline_faults"
TITLES = {RUN_A: "(a) no snapshots", RUN_B: "(b) snapshot/step",
          RUN_C: "(c) simulated loss", RUN_D: "(d) baseline+faults"}
PROCESS_TITLES = {RUN_E: "(e) mnemojax launch", RUN_F: "(f) classical restart"}
# Every-step snapshots against no snapshots, per platform (issue 13; `gpu_check` too).
OVERHEAD_MAX = {"gpu": 1.01, "cpu": 1.03}
TARGETS = {"recovery_ratio_min": 20.0, "mnemojax_steps_lost_max": 1, "process_ratio_min": 10.0}


def targets_for(platform: str) -> dict[str, float]:
    """The bench's targets on `platform` (JAX's backend name); another platform than CPU
    or GPU gets the GPU's overhead bound."""
    return {**TARGETS, "overhead_max": OVERHEAD_MAX.get(platform, OVERHEAD_MAX["gpu"])}


def _max_diff(a, b) -> float | None:
    import numpy as np

    if a is None or b is None or len(a) != len(b):
        return None
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b, strict=True))


def _mean(xs) -> float | None:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def build_summary(cfg, *, runs: dict[str, dict], save_cost, interval, mtbf_rule: str,
                  baseline_final=None, goodput: dict | None = None,
                  environment: dict | None = None,
                  process_runs: dict[str, list[dict]] | None = None) -> dict[str, Any]:
    """Figures and ratios of one bench invocation (JSON-ready; final states dropped).

    ``process_runs``: every run of (e) and of (f) (`multiproc`), with their final states,
    or None.
    """
    a, b, c, d = runs[RUN_A], runs[RUN_B], runs[RUN_C], runs[RUN_D]
    # The platform JAX ran on (`driver` records it); tests that give none run on CPU.
    targets = targets_for((environment or {}).get("platform", "cpu"))
    m_rec, b_rec = c["recoveries"], d["recoveries"]
    # mnemojax: from the start of the failed step's call (the fault cannot be earlier) to
    # its replayed result; the runtime's own total_s (from the failure surfacing) apart.
    m_mean = _mean(r["call_s"] for r in m_rec)
    b_mean = _mean(r["recovery_s"] for r in b_rec)
    per_fault = []
    for mr, br in zip(m_rec, b_rec, strict=False):
        per_fault.append({"step": mr["step"], "mnemojax_s": mr["call_s"],
                          "mnemojax_runtime_total_s": mr["total_s"],
                          "mnemojax_before_surfacing_s": mr["before_surfacing_s"],
                          "baseline_s": br["recovery_s"],
                          "ratio": br["recovery_s"] / mr["call_s"] if mr["call_s"] else None,
                          "baseline_back_to_fault_step_s": br["back_to_fault_step_s"],
                          "mnemojax_steps_lost": mr["steps_lost"],
                          "baseline_steps_lost": br["steps_lost"],
                          "baseline_restored_step": br["restored_step"]})
    overhead = b["steady_step_s"] / a["steady_step_s"]
    steady_d = statistics.median(d["step_times_s"][1:]) if len(d["step_times_s"]) > 1 else None
    phases = {k: _mean(r["phases_s"].get(k, 0.0) for r in m_rec)
              for k in ("detect", "plan", "reshard", "compile", "replay")} if m_rec else {}
    b_phase = ({k: statistics.fmean(r["phases_s"][k] for r in b_rec)
                for k in b_rec[0]["phases_s"]} if b_rec else {})
    final = {name: runs[name].get("final_state") for name in (RUN_A, RUN_B, RUN_C)}
    figures = {
        "recovery_s": {"mnemojax": m_mean, "baseline": b_mean,
                       "mnemojax_runtime_total": _mean(r["total_s"] for r in m_rec),
                       "ratio": b_mean / m_mean if m_mean and b_mean else None},
        "recovery_per_fault": per_fault,
        "steps_lost": {"mnemojax": [r["steps_lost"] for r in m_rec],
                       "baseline": [r["steps_lost"] for r in b_rec],
                       "baseline_mean": _mean(r["steps_lost"] for r in b_rec),
                       "baseline_half_interval": interval.steps / 2,
                       "mnemojax_failed_step_replayed": len(m_rec)},
        "steady_state": {"a_step_s": a["steady_step_s"], "b_step_s": b["steady_step_s"],
                         "overhead_b_over_a": overhead,
                         "baseline_step_s": steady_d,
                         "block_steps": cfg.block_steps, "blocks": len(a["block_means_s"])},
        "snapshot_bytes": b["snapshot_bytes"],
        "checkpoint_bytes": save_cost.nbytes,
        "peak_rss_bytes": {"a+b": a["peak_rss_bytes"], "c": c["peak_rss_bytes"],
                           "d_max_worker": d["peak_rss_bytes"]},
        "compile_off_critical_path": c["compiled_ahead"],
        "precompile_waits": c["precompile_waits"],
        "final_state_max_abs_diff_vs_a": {
            "b": _max_diff(final[RUN_B], final[RUN_A]),
            "c": _max_diff(final[RUN_C], final[RUN_A]),
            "d": _max_diff(baseline_final, final[RUN_A])},
    }
    figures["targets_met"] = {
        "recovery_ratio": bool(figures["recovery_s"]["ratio"]
                               and figures["recovery_s"]["ratio"] >= targets["recovery_ratio_min"]),
        "overhead": overhead <= targets["overhead_max"],
        "mnemojax_steps_lost": all(r["steps_lost"] <= targets["mnemojax_steps_lost_max"]
                                   for r in m_rec)}
    wall = {name: runs[name]["wall_s"] for name in TITLES}
    processes = None
    if process_runs is not None:
        processes = process_figures(process_runs, final[RUN_A])
        figures["targets_met"]["process_ratio"] = bool(
            processes["ratio"]["next_good_step"]
            and processes["ratio"]["next_good_step"] >= targets["process_ratio_min"])
    return {
        "preset": cfg.name,
        "config": {"mesh": list(cfg.mesh), "steps": cfg.steps, "batch_size": cfg.batch_size,
                   "model": dict(cfg.model), "faults": [
                       {"step": f.step, "devices": list(f.devices), "surface": f.surface}
                       for f in cfg.faults]},
        "environment": environment or {},
        "interval": {**interval.as_dict(), "mtbf_rule": mtbf_rule},
        "save_cost": save_cost.as_dict(),
        "wall_s": wall,
        "figures": figures,
        "goodput": goodput or {},
        "targets": targets,
        "runs": {name: {k: v for k, v in runs[name].items() if k != "final_state"}
                 for name in TITLES},
        "processes": processes,
        # The keys `mnemojax simulate --bench-json` reads (simulator/bench.py).
        "step_time_s": a["steady_step_s"],
        "snapshot_overhead_frac": max(0.0, min(overhead - 1.0, 0.99)),
        "recovery": {"phases_s": phases},
        "baseline": {"detect_s": b_phase.get("detect", 0.0),
                     "restart_s": sum(b_phase.get(k, 0.0) for k in
                                      ("relaunch", "start+import", "init")),
                     "compile_s": b_phase.get("compile", 0.0),
                     "checkpoint_save_s": save_cost.blocking_s,
                     "checkpoint_restore_s": b_phase.get("restore", 0.0)},
    }


PROCESS_FIGURES = ("next_good_step_s", "back_past_killed_step_s", "steps_past_killed_s")


def process_figures(process_runs: dict[str, list[dict]], reference) -> dict[str, Any]:
    """(e) and (f): every run of each (``runs``), the lower-median run of each by kill ->
    next good step (``RUN_E``, ``RUN_F``, its index in ``median_run``: its phases are the
    table's), the medians of both figures (``median``; with an even number of pairs, the
    mean of the middle two) and their ratios (f)/(e); every final state against
    ``reference``."""
    def strip(run: dict) -> dict:
        return {k: v for k, v in run.items() if k != "final_state"}

    out: dict[str, Any] = {"pairs": len(process_runs[RUN_E]), "runs": {}, "median": {},
                           "median_run": {}}
    for name, runs in process_runs.items():
        out["runs"][name] = [strip(r) for r in runs]
        # The lower median by kill -> next good step: a run that happened (its index in
        # ``runs``), whose phases the table shows.
        # (A run with no figure, None, sorts last.)
        order = sorted(range(len(runs)), key=lambda i: (
            runs[i]["next_good_step_s"] is None, runs[i]["next_good_step_s"] or 0.0))
        out["median_run"][name] = order[(len(runs) - 1) // 2]
        out[name] = strip(runs[out["median_run"][name]])
        out["median"][name] = {
            key: statistics.median(r[key] for r in runs) if all(
                r.get(key) is not None for r in runs) else None
            for key in PROCESS_FIGURES}
    e, f = out["median"][RUN_E], out["median"][RUN_F]

    def ratio(key: str) -> float | None:
        return f[key] / e[key] if e.get(key) and f.get(key) else None

    out["ratio"] = {"next_good_step": ratio("next_good_step_s"),
                    "back_past_killed_step": ratio("back_past_killed_step_s"),
                    "steps_past_killed": ratio("steps_past_killed_s")}

    def worst(name: str) -> float | None:
        diffs = [_max_diff(r.get("final_state"), reference) for r in process_runs[name]]
        return None if None in diffs else max(d for d in diffs if d is not None)

    out["final_state_max_abs_diff_vs_a"] = {"e": worst(RUN_E), "f": worst(RUN_F)}
    return out


def format_process_table(p: dict, targets: dict) -> list[str]:
    """The lines of (e) and (f) side by side, then the ratios (f)/(e)."""
    e, f = p[RUN_E], p[RUN_F]
    lines = [f"real process kill: {e['nproc']} processes x {e['devices_per_proc']} CPU "
             f"devices; worker {e['victim']} SIGKILLed from outside once it completed step "
             f"{e['killed_step'] - 1}; (e) {e['launch_options']} (collective timeout "
             f"{e['collective_timeout_s']} s); (f) restarts every process, Orbax every "
             f"{f['interval_steps']} steps", ""]
    pairs = p.get("pairs", 1)
    if pairs > 1:
        lines[-1:-1] = [f"{pairs} runs of each, alternating (e, f, e, f, ...): the first two "
                        "figures are medians; the rest are of the median run of each"]
    hdr = f"{'figure':<44}" + "".join(f"{t:>24}" for t in PROCESS_TITLES.values())
    lines += [hdr, "-" * len(hdr)]
    ph_e, ph_f = e["recovery_phases_s"], f["phases_s"]
    med = p.get("median", {RUN_E: e, RUN_F: f})
    rows = [
        ("kill -> next good step (s)", _f(med[RUN_E]["next_good_step_s"]),
         _f(med[RUN_F]["next_good_step_s"])),
        ("kill -> killed step done again (s)",
         _f(med[RUN_E]["back_past_killed_step_s"]), _f(med[RUN_F]["back_past_killed_step_s"])),
        (f"kill -> {STEPS_PAST} steps past the killed one (s)",
         _f(med[RUN_E].get("steps_past_killed_s")), _f(med[RUN_F].get("steps_past_killed_s"))),
        ("  the killed step (the victim never did it)", str(e["killed_step"]),
         str(f["killed_step"])),
        ("steps lost (redone)", str(e["steps_lost"]),
         f"{f['steps_lost']} (from ckpt {f['restored_step']})"),
        ("  the launcher / supervisor saw the exit (s)", _f(e["launcher_knows_s"]),
         _f(ph_f.get("detect"))),
        ("  survivors' recovery, runtime-timed (s)", _f(e["recovery_total_s"]), "-"),
    ]
    for name in ("detect", "close", "agree", "compile", "restore", "replay"):
        rows.append((f"    {name} (s)", _f(ph_e.get(name)), "-"))
    how = e.get("executable") or "-"
    rows.append(("      the new world's executable", how + (", from export" if
                                                        e.get("from_export") else ""), "-"))
    for name in ("teardown", "start+import", "jax.distributed", "init", "restore",
                 "compile"):
        rows.append((f"    {name} (s, slowest process)", "-", _f(ph_f.get(name))))
    diff = p["final_state_max_abs_diff_vs_a"]
    rows.append(("processes after the kill", str(e["processes_after"]),
                 str(f["processes_after"])))
    rows.append(("final state max |diff| vs (a)", _f(diff["e"], ".1e"), _f(diff["f"], ".1e")))
    if pairs > 1:
        labels = ("next good step", "back past", f"{STEPS_PAST} steps past")
        for key, label in zip(PROCESS_FIGURES, labels, strict=True):
            e_runs, f_runs = (" ".join(_f(r.get(key), ".2f") for r in p["runs"][name])
                              for name in PROCESS_TITLES)
            rows.append((f"every run: {label} (s)", e_runs, f_runs))
    for label, a, b in rows:
        lines.append(f"{label:<44}{a:>24}{b:>24}")
    r = p["ratio"]
    met = r["next_good_step"] is not None and r["next_good_step"] >= targets["process_ratio_min"]
    lines += ["", f"real kill: (f) classical / (e) mnemojax = {_f(r['next_good_step'], '.2f')}x "
              f"{'(medians) ' if pairs > 1 else ''}"
              f"to the next good step, {_f(r['back_past_killed_step'], '.2f')}x back past the "
              f"killed step (target >= {targets['process_ratio_min']:.0f}x: "
              f"{'met' if met else 'NOT met'}); {_f(r.get('steps_past_killed'), '.2f')}x to "
              f"{STEPS_PAST} steps past it (the slow steps after a recovery count there)"]
    return lines


def _f(x, spec=".3f", none="-") -> str:
    return none if x is None else format(x, spec)


def format_table(s: dict) -> str:
    """The bench table: figures per run side by side, then the ratios against targets."""
    f, iv, sc = s["figures"], s["interval"], s["save_cost"]
    runs = s["runs"]
    cfg = s["config"]
    m = cfg["model"]
    lines = ["", "=" * 96, f"mnemojax bench, preset {s['preset']}: GPT "
             f"{s['environment'].get('model_params', 0):,} params (d_model {m['d_model']}, "
             f"{m['n_layers']} layers, vocab {m['vocab_size']}, seq {m['seq_len']}); mesh "
             f"{cfg['mesh'][0]}x{cfg['mesh'][1]}; {cfg['steps']} steps of {cfg['batch_size']}",
             "faults: " + ", ".join(f"step {x['step']} device {x['devices']} ({x['surface']})"
                                   for x in cfg["faults"])
             + " (simulated in the runtime: no process dies); the baseline's process is "
             "SIGKILLed in the same steps", "=" * 96]
    lines.append(f"baseline checkpoint interval: Young/Daly tau = sqrt(2 x {sc['blocking_s']:.3f} s"
                 f" save x {iv['mtbf_s']:.1f} s MTBF) = {iv['interval_s']:.2f} s / "
                 f"{iv['step_time_s'] * 1e3:.1f} ms per step = every {iv['steps']} steps"
                 + (" (clamped)" if iv["clamped"] else ""))
    lines.append(f"  MTBF: {iv['mtbf_rule']}; first save of a process blocked "
                 f"{sc['first_blocking_s']:.2f} s, a committed save took {sc['total_s']:.2f} s")
    w = f["precompile_waits"]
    lines.append("(c) waited for background compiles (off the run's clock): " + ", ".join(
        f"{x['seconds']:.1f} s {x['when']}" for x in w))
    lines.append("")
    hdr = f"{'figure':<44}" + "".join(f"{t:>21}" for t in TITLES.values())
    lines += [hdr, "-" * len(hdr)]
    rows = []
    n = lambda name, key: runs[name].get(key)  # noqa: E731
    rows.append(("wall time (s, own clock)", [f"{s['wall_s'][k]:.2f}" for k in TITLES]))
    st = f["steady_state"]
    rows.append(("steady step time (ms)", [_f(st["a_step_s"] * 1e3, ".2f"),
                                           _f(st["b_step_s"] * 1e3, ".2f"),
                                           _f(statistics.median(n(RUN_C, "step_times_s")[1:])
                                              * 1e3, ".2f"),
                                           _f(st["baseline_step_s"] and
                                              st["baseline_step_s"] * 1e3, ".2f")]))
    rec = f["recovery_s"]
    rows.append(("recovery, fault -> next good step (s, mean)", ["-", "-",
                                                                _f(rec["mnemojax"]),
                                                                _f(rec["baseline"])]))
    for pf in f["recovery_per_fault"]:
        rows.append((f"  fault in step {pf['step']} (s)",
                     ["-", "-", _f(pf["mnemojax_s"]), _f(pf["baseline_s"])]))
        rows.append(("    of which runtime-timed (s, total_s)",
                     ["-", "-", _f(pf["mnemojax_runtime_total_s"]), "-"]))
        rows.append((f"  steps lost (baseline from ckpt {pf['baseline_restored_step']})",
                     ["-", "-", str(pf["mnemojax_steps_lost"]), str(pf["baseline_steps_lost"])]))
        rows.append(("  fault -> killed step done again (s)",
                     ["-", "-", _f(pf["mnemojax_s"]), _f(pf["baseline_back_to_fault_step_s"])]))
    g = s.get("goodput") or {}
    rows.append(("goodput (% of wall, offline from events)",
                 [_f(g.get(k, {}).get("goodput_pct"), ".1f") for k in TITLES]))
    rows.append(("snapshot / checkpoint bytes (MB)",
                 ["0", _f(f["snapshot_bytes"] / 1e6, ".2f"), _f(f["snapshot_bytes"] / 1e6, ".2f"),
                  _f(f["checkpoint_bytes"] / 1e6, ".2f")]))
    rss = f["peak_rss_bytes"]
    rows.append(("peak RSS (MB; a+b share a process)",
                 [_f(rss["a+b"] / 1e6, ".0f")] * 2 + [_f(rss["c"] / 1e6, ".0f"),
                                                      _f(rss["d_max_worker"] / 1e6, ".0f")]))
    ca = f["compile_off_critical_path"]
    rows.append(("compile off the critical path (s)",
                 ["-", "-", f"{ca['seconds_kept_off_critical_path']:.2f}", "0"]))
    diff = f["final_state_max_abs_diff_vs_a"]
    rows.append(("final state max |diff| vs (a)",
                 ["0", _f(diff["b"], ".1e"), _f(diff["c"], ".1e"), _f(diff["d"], ".1e")]))
    for label, cells in rows:
        lines.append(f"{label:<44}" + "".join(f"{c:>21}" for c in cells))
    lines.append("")
    sl = f["steps_lost"]
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    t = f["targets_met"]
    lines.append(f"recovery, simulated device loss (c) vs process restart (d): baseline / "
                 f"mnemojax = {_f(rec['ratio'], '.1f')}x "
                 f"(target >= {s['targets']['recovery_ratio_min']:.0f}x: {ok(t['recovery_ratio'])})")
    lines.append(f"steady-state overhead (b)/(a) = x{st['overhead_b_over_a']:.3f} "
                 f"(target <= x{s['targets']['overhead_max']:.2f}: {ok(t['overhead'])}; median of "
                 f"{st['blocks']} blocks of {st['block_steps']} steps, interleaved)")
    lines.append(f"steps lost: mnemojax {sl['mnemojax']} (+ the failed step replayed) "
                 f"(target <= 1: {ok(t['mnemojax_steps_lost'])}); baseline {sl['baseline']}, "
                 f"mean {_f(sl['baseline_mean'], '.1f')} vs half interval "
                 f"{sl['baseline_half_interval']:.1f}")
    lines.append(f"compiled ahead in the background: {ca['executables']} executables, "
                 f"{ca['seconds']:.1f} s; used by {ca['used_by_recoveries']} recoveries, "
                 f"{ca['seconds_kept_off_critical_path']:.2f} s kept off the critical path")
    if s.get("processes"):
        lines += ["", "=" * 96] + format_process_table(s["processes"], s["targets"])
    return "\n".join(lines)
