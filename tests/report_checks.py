"""What a finished `mnemojax demo` report and a `mnemojax bench --preset tiny` output
directory must show, read from what they write. Shared by the in-repo tests (`make
test-slow`) and the wheel test (`make wheel-test`, run by CI), which runs both commands
from the installed wheel outside the repository."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def check_demo_report(report: dict) -> None:
    """The tiny demo: two device losses recovered from live replicas at steps 5 and 9, no
    step lost, the final state equal to the failure-free reference."""
    assert report["final_state_matches_reference"]
    recs = report["statistics"]["recoveries"]
    assert [r["step"] for r in recs] == [5, 9]
    assert [r["failed_devices"] for r in recs] == [[3], [5]]
    assert recs[0]["executable"] == "ready"  # compiled ahead: no compile on the critical path
    assert all(r["steps_lost"] == 0 and r["source"] == "live_replicas" for r in recs)
    assert report["statistics"]["steps_run"] == 12
    assert set(report["overhead"]["median_step_s"]) == {
        "plain_flax", "mnemojax_no_snapshots", "mnemojax_default",
        "mnemojax_snapshot_every_step"}


def check_tiny_bench(out: Path) -> dict:
    """Checks what the tiny bench wrote in ``out`` for runs (a)-(d): bench.json, both
    PNGs, the figures, the event log's accounts; (e) and (f) too when they ran. Returns
    bench.json."""
    from mnemojax._src.bench import report
    from mnemojax._src.bench.summary import format_table
    from mnemojax._src.simulator.bench import load_bench_costs

    s = json.loads((out / "bench.json").read_text())
    assert set(s["runs"]) == {"a_no_snapshots", "b_snapshots", "c_mnemojax_faults",
                              "d_baseline_faults"}
    for png in ("steps_vs_time.png", "recovery_phases.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    f = s["figures"]
    assert f["recovery_s"]["ratio"] > 1  # a figure, not a target: no timing asserts
    assert len(f["recovery_per_fault"]) == 2
    assert f["steps_lost"]["mnemojax"] == [0, 0]
    assert all(n >= 0 for n in f["steps_lost"]["baseline"])
    assert f["steady_state"]["overhead_b_over_a"] > 0
    assert f["snapshot_bytes"] > 0 and f["checkpoint_bytes"] > 0
    ahead = f["compile_off_critical_path"]
    assert ahead["used_by_recoveries"] == 2 and ahead["executables"] >= 2
    assert ahead["seconds_kept_off_critical_path"] > 0  # read from the step's compiler
    # Same model and batches: the baseline's plain Flax run ends where (a) ends.
    assert f["final_state_max_abs_diff_vs_a"]["d"] <= 1e-5
    assert f["final_state_max_abs_diff_vs_a"]["c"] <= 1e-3  # another mesh, another order
    assert len(s["runs"]["d_baseline_faults"]["pids"]) == 3  # the baseline restarted twice
    iv = s["interval"]
    assert 1 <= iv["steps"] <= 48 and iv["save_cost_s"] > 0 and "wall time" in iv["mtbf_rule"]
    costs = load_bench_costs(out / "bench.json")  # what `mnemojax simulate` reads
    assert "mnemojax.detect_s" in costs and "restart.startup_s" in costs

    accounts = {a.run: a for a in report.account_log(out / "events.jsonl")}
    assert set(accounts) == set(s["runs"])
    for acc in accounts.values():
        assert acc.steps == 48 and 0 < acc.goodput_pct <= 100
        assert acc.overlap_s < 0.05 * acc.wall_s, (acc.run, acc.overlap_s)
    assert accounts["c_mnemojax_faults"].faults == 2
    assert accounts["c_mnemojax_faults"].badput_s["infra_recovery"] > 0
    assert accounts["d_baseline_faults"].faults == 2
    assert accounts["d_baseline_faults"].badput_s["restart"] > 0
    table = format_table(s)
    assert "baseline / mnemojax" in table and "(d) baseline+faults" in table
    assert "simulated" in table
    if s["processes"] is not None:
        check_process_pair(s["processes"])
        assert "(f) classical / (e) mnemojax" in table
    return s


def check_process_pair(p: dict) -> None:
    """(e) mnemojax under `mnemojax launch` and (f) the classical job, one real SIGKILL:
    the bench's process figures (`summary.process_figures`), against (a)."""
    from mnemojax._src.bench.multiproc import RUN_E, RUN_F

    assert len(p["runs"][RUN_E]) == len(p["runs"][RUN_F]) == p["pairs"] >= 1
    for e in p["runs"][RUN_E]:
        assert e["recoveries"] == 1 and e["steps_lost"] == 0
        # Compiled ahead in the world before the kill: the new world loads the executable
        # from the persistent cache and lowers the step from its export, with no trace.
        assert e["executable"] == "cached" and e["from_export"], e
        # Process 0 traced each candidate world's step; the others took its export (the
        # last world's processes report it: with several, one is not process 0 of world 0).
        assert e["processes_after"] == 1 or e["exports_taken"] >= 1, e
    for f in p["runs"][RUN_F]:
        assert f["steps_lost"] == f["killed_step"] - 1 - f["restored_step"]
    for name in (RUN_E, RUN_F):
        for run in p["runs"][name]:
            assert run["next_good_step_s"] > 0
            assert run["back_past_killed_step_s"] >= run["next_good_step_s"]
            past = run.get("steps_past_killed_s")
            assert past is None or past > run["back_past_killed_step_s"]
            for pid in [q for launch in run.get("launches", []) for q in launch["pids"]]:
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)  # every process the bench started is gone
        # The median lies within the runs' range (its arithmetic: bench_test's unit test).
        values = [r["next_good_step_s"] for r in p["runs"][name]]
        assert min(values) <= p["median"][name]["next_good_step_s"] <= max(values)
    diff = p["final_state_max_abs_diff_vs_a"]
    # Against (a), one process: gloo's reductions across processes add in another order
    # (measured ~5e-5 for (f)); (e) also ends on a smaller mesh.
    assert diff["f"] <= 1e-4, diff
    assert diff["e"] <= 1e-3, diff
    assert p["ratio"]["next_good_step"] > 0 and p["ratio"]["back_past_killed_step"] > 0
