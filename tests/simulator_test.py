"""Tests of the goodput simulator (mnemojax/_src/simulator). Pure Python: no JAX devices."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest

from mnemojax._src.simulator import cli as sim_cli
from mnemojax._src.simulator import strategies as st
from mnemojax._src.simulator.bench import load_bench_costs
from mnemojax._src.simulator.config import (
    LLAMA3_CATEGORIES,
    LLAMA3_MTBF_ACCELERATOR_HOURS,
    ClassicalOptions,
    FailureCategory,
    FailureOptions,
    InMemoryOptions,
    JobOptions,
    MnemojaxOptions,
    RestartCosts,
    SimulationConfigError,
    SimulationOptions,
    SpareOptions,
)
from mnemojax._src.simulator.engine import simulate_job
from mnemojax._src.simulator.failures import load_trace, poisson_stream, trace_stream
from mnemojax._src.simulator.grid import run_grid

LLAMA = LLAMA3_MTBF_ACCELERATOR_HOURS


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def _classical_only(*, mtbf_s: float, save_s: float, restart_s: float, days: float):
    """A job whose failures are exponential with job MTBF ``mtbf_s`` and fixed costs."""
    accelerators = 1024
    return SimulationOptions(
        job=JobOptions(accelerators=accelerators),
        failures=FailureOptions(mtbf_accelerator_hours=mtbf_s * accelerators / 3600),
        classical=ClassicalOptions(
            restart=RestartCosts(detect_s=0, startup_s=restart_s, compile_s=0),
            checkpoint_save_s=save_s,
            checkpoint_restore_s=0,
        ),
        days=days,
    )


# Sampling noise at ~20,000 failures is ~0.01 % absolute on a ~5-9 % waste, so the
# tolerances below are set by the formulas' own accuracy, not by noise.
@pytest.mark.parametrize(
    ("mtbf_h", "save_s", "restart_s"), [(8.0, 30.0, 0.0), (4.0, 30.0, 300.0), (2.0, 10.0, 60.0)]
)
def test_classical_waste_matches_young_daly(mtbf_h, save_s, restart_s):
    mtbf_s = mtbf_h * 3600
    options = _classical_only(
        mtbf_s=mtbf_s, save_s=save_s, restart_s=restart_s, days=20_000 * mtbf_h / 24
    )
    stream = poisson_stream(
        _rng(1), accelerators=1024, failures=options.failures, horizon_s=options.horizon_s
    )
    result = simulate_job(options, "classical", stream)
    tau = st.young_interval_s(save_s, mtbf_s)
    assert result.checkpoint_interval_s == pytest.approx(math.sqrt(2 * save_s * mtbf_s))
    waste = 1.0 - result.goodput
    first_order = st.first_order_waste(tau, save_s, mtbf_s, restart_s)
    exact = st.exponential_waste(tau, save_s, mtbf_s, restart_s)
    # Young's first-order formula: within 5 % (relative) in this regime (tau, R << M).
    assert waste == pytest.approx(first_order, rel=0.05)
    # Daly's exact expectation for exponential failures: within 2 % (relative).
    assert waste == pytest.approx(exact, rel=0.02)
    assert sum(result.seconds.values()) == pytest.approx(options.horizon_s)


def test_young_interval_minimises_simulated_waste():
    mtbf_s, save_s = 4 * 3600.0, 30.0
    base = _classical_only(mtbf_s=mtbf_s, save_s=save_s, restart_s=0, days=3000)
    stream = poisson_stream(
        _rng(2), accelerators=1024, failures=base.failures, horizon_s=base.horizon_s
    )
    tau = st.young_interval_s(save_s, mtbf_s)

    def waste(interval):
        opts = dataclasses.replace(
            base, classical=dataclasses.replace(base.classical, interval_s=interval)
        )
        return 1 - simulate_job(opts, "classical", stream).goodput

    assert waste(tau) < waste(tau / 4)
    assert waste(tau) < waste(tau * 4)


def test_daly_interval_is_close_to_young_for_small_checkpoints():
    young = st.young_interval_s(30, 14_400)
    daly = st.daly_interval_s(30, 14_400)
    assert young == pytest.approx(929.5, abs=0.1)
    assert abs(daly - young) / young < 0.05
    assert st.daly_interval_s(100, 40) == 40  # delta >= 2M: checkpoint every MTBF


def _grid(seed=0, **kw):
    base = SimulationOptions(job=JobOptions(accelerators=1024), days=kw.pop("days", 20), seed=seed)
    kw.setdefault("scales", [4096, 16_384])
    kw.setdefault("mtbf_accelerator_hours", [LLAMA])
    return run_grid(base, **kw)


def test_results_are_deterministic_for_a_seed():
    assert _grid(seed=7, runs=2) == _grid(seed=7, runs=2)


def test_different_seeds_give_different_results():
    a = [p.goodput for p in _grid(seed=1)]
    b = [p.goodput for p in _grid(seed=2)]
    assert a != b


def test_a_cell_does_not_depend_on_the_rest_of_the_grid():
    alone = _grid(scales=[16_384])
    within = [p for p in _grid(scales=[4096, 16_384]) if p.accelerators == 16_384]
    assert alone == within


def test_more_failures_mean_lower_goodput():
    points = _grid(
        scales=[16_384], mtbf_accelerator_hours=[LLAMA * 2, LLAMA, LLAMA / 2], days=60, runs=2
    )
    for strategy in st.STRATEGY_NAMES:
        goodputs = [p.goodput for p in points if p.strategy == strategy]
        assert goodputs == sorted(goodputs, reverse=True), (strategy, goodputs)
        assert goodputs[0] > goodputs[-1]


def test_mnemojax_beats_the_restart_strategies_at_16k():
    points = {p.strategy: p for p in _grid(scales=[16_384], days=30, runs=2)}
    assert points["mnemojax"].goodput > points["in_memory"].goodput > points["classical"].goodput
    assert points["mnemojax"].goodput - points["classical"].goodput > 0.05
    assert points["mnemojax"].mean_recovery_s < 60 < points["classical"].mean_recovery_s
    # at most one step lost per failure
    per_failure_s = (
        points["mnemojax"].lost_work_h_per_day * 3600 / points["mnemojax"].failures_per_day
    )
    assert per_failure_s < JobOptions(accelerators=8).step_time_s


def test_classical_near_llama3_published_goodput():
    # Llama 3 405B: 16,384 GPUs, 419 unexpected interruptions in 54 days, ">90% effective
    # training time". Classical restart here: 60 s detect + 180 s startup + 60 s compile +
    # 60 s restore = 6 min; 30 s blocking save at the Young interval.
    (p,) = _grid(scales=[16_384], days=54, runs=4, strategies=["classical"])
    assert 0.87 < p.goodput < 0.93


def _without_spares(job: JobOptions, *, rate: float, seed: int):
    """20 days at ``rate`` x the Llama 3 failure rate, no spare hosts (a lost host is back
    after 6 h): the options and their interruption stream."""
    options = SimulationOptions(
        job=job,
        spares=SpareOptions(spare_hosts=0, replacement_delay_s=6 * 3600),
        failures=FailureOptions(mtbf_accelerator_hours=LLAMA / rate),
        days=20,
    )
    return options, poisson_stream(_rng(seed), accelerators=job.accelerators,
                                   failures=options.failures, horizon_s=options.horizon_s)


def test_reduced_mesh_runs_degraded_and_grows_back():
    options, stream = _without_spares(JobOptions(accelerators=1024, hosts_per_replica=2),
                                      rate=20, seed=3)
    results = {name: simulate_job(options, name, stream) for name in st.STRATEGY_NAMES}
    mnemo = results["mnemojax"]
    assert mnemo.grows > 0
    assert mnemo.seconds[st.DEGRADED] > 0
    # The restart strategies wait for the replacement host instead.
    assert results["classical"].seconds[st.DEGRADED] == 0
    assert results["classical"].mean_recovery_s > 3600
    assert mnemo.goodput > results["classical"].goodput
    for r in results.values():
        assert sum(r.seconds.values()) == pytest.approx(options.horizon_s)
    # hot_spare mode with no spares waits like a restart strategy, so it does worse.
    hot = dataclasses.replace(options, mnemojax=MnemojaxOptions(mode="hot_spare"))
    assert simulate_job(hot, "mnemojax", stream).goodput < mnemo.goodput


def test_capacity_drops_replicas_or_narrows_the_model_axis_within_the_headroom():
    # 4 replicas of 8 hosts: one host lost drops a replica (3/4), or, where a device can
    # hold twice its share, keeps all four on model axes of 4 hosts (1/2): the better is 3/4.
    job = JobOptions(accelerators=256, hosts_per_replica=8, model_shrink_headroom=2.0)
    assert job.capacity(0) == 1.0 and job.capacity(1) == 0.75 and job.capacity(3) == 0.5
    # One replica over every host (a model too large for data parallelism).
    single = JobOptions(accelerators=64, hosts_per_replica=8)
    assert single.capacity(1) == 0.0  # headroom 1: nothing but waiting
    wider = dataclasses.replace(single, model_shrink_headroom=2.0)
    assert wider.capacity(1) == 0.5 and wider.capacity(4) == 0.5 and wider.capacity(5) == 0.0
    assert dataclasses.replace(single, model_shrink_headroom=8.0).capacity(5) == 0.25
    # 6 hosts per replica, headroom 2: 5 left -> the widest divisor of 6 in [3, 5] is 3.
    assert JobOptions(accelerators=48, hosts_per_replica=6,
                      model_shrink_headroom=2.0).capacity(1) == 0.5


def test_a_single_replica_job_runs_on_a_narrower_model_axis_instead_of_waiting():
    """One replica spans every host: with headroom 1 a lost host means waiting hours for a
    replacement, as for the restart strategies; with headroom 2 mnemojax goes on at half
    throughput on a model axis half as wide, and grows back when the host returns."""
    options, stream = _without_spares(JobOptions(accelerators=64, hosts_per_replica=8),
                                      rate=200, seed=5)
    waits = simulate_job(options, "mnemojax", stream)
    narrow = simulate_job(
        dataclasses.replace(
            options, job=dataclasses.replace(options.job, model_shrink_headroom=2.0)),
        "mnemojax", stream)
    assert waits.seconds[st.DEGRADED] == 0 and waits.mean_recovery_s > 3600
    assert narrow.seconds[st.DEGRADED] > 0 and narrow.grows > 0
    assert narrow.goodput > waits.goodput
    for r in (waits, narrow):
        assert sum(r.seconds.values()) == pytest.approx(options.horizon_s)


def test_finite_spare_pool_is_used_then_refilled():
    options = SimulationOptions(
        job=JobOptions(accelerators=1024),
        spares=SpareOptions(spare_hosts=2, replacement_delay_s=3600),
        failures=FailureOptions(mtbf_accelerator_hours=LLAMA / 10),
        days=10,
    )
    stream = poisson_stream(
        _rng(4), accelerators=1024, failures=options.failures, horizon_s=options.horizon_s
    )
    r = simulate_job(options, "mnemojax", stream)
    assert sum(r.seconds.values()) == pytest.approx(options.horizon_s)
    assert r.goodput > 0.9


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: JobOptions(accelerators=0), "accelerators=0"),
        (lambda: JobOptions(accelerators=12), "accelerators=12"),
        (lambda: JobOptions(accelerators=64, hosts_per_replica=3), "hosts_per_replica=3"),
        (lambda: JobOptions(accelerators=64, step_time_s=-1.0), "step_time_s=-1.0"),
        (lambda: JobOptions(accelerators=64, model_shrink_headroom=0.5),
         "model_shrink_headroom=0.5"),
        (lambda: FailureOptions(mtbf_accelerator_hours=-5.0), "mtbf_accelerator_hours=-5.0"),
        (lambda: FailureOptions(mtbf_accelerator_hours=0), "mtbf_accelerator_hours=0"),
        (lambda: FailureOptions(planned_per_day=-1.0), "planned_per_day=-1.0"),
        (lambda: FailureOptions(categories=LLAMA3_CATEGORIES[:2]), "sum of category fractions"),
        (lambda: FailureCategory(name="x", fraction=1.5), "x.fraction=1.5"),
        (lambda: SpareOptions(spare_hosts=-1), "spare_hosts=-1"),
        (lambda: SpareOptions(replacement_delay_s=0), "replacement_delay_s=0"),
        (lambda: RestartCosts(detect_s=-1), "detect_s=-1"),
        (lambda: ClassicalOptions(checkpoint_save_s=0), "checkpoint_save_s=0"),
        (lambda: InMemoryOptions(snapshot_overhead_frac=1.0), "snapshot_overhead_frac=1.0"),
        (lambda: MnemojaxOptions(mode="magic"), "mode='magic'"),
        (lambda: SimulationOptions(job=JobOptions(accelerators=8), days=0), "days=0"),
        (lambda: _grid(runs=0), "runs=0"),
        (lambda: _grid(strategies=["nope"]), "strategy='nope'"),
    ],
)
def test_bad_parameters_raise_typed_errors_naming_the_value(make, needle):
    with pytest.raises(SimulationConfigError, match="invalid|expected") as info:
        make()
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def _write_trace(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "trace.csv"
    path.write_text(
        "time_hours,host,category\n"
        "1.0,,software\n"
        "5.0,3,faulty_gpu\n"
        "10.0,,planned\n"
        "30.0,7,gpu_hbm\n"  # after a 1-day horizon: ignored
    )
    return path


def test_trace_file_drives_the_simulation(tmp_path):
    events = load_trace(_write_trace(tmp_path))
    assert [e.category for e in events] == ["software", "faulty_gpu", "planned", "gpu_hbm"]
    options = SimulationOptions(job=JobOptions(accelerators=1024), days=1)
    stream = trace_stream(
        events, hosts=128, categories=LLAMA3_CATEGORIES, horizon_s=options.horizon_s
    )
    assert len(stream) == 3
    for name in st.STRATEGY_NAMES:
        r = simulate_job(options, name, stream)
        assert (r.failures, r.planned, len(r.outages_s)) == (2, 1, 2)
        assert sum(r.seconds.values()) == pytest.approx(options.horizon_s)
    # mnemojax: a hardware fault costs detect + agree + plan + reshard(+transfer) + compile.
    m = MnemojaxOptions()
    hw = m.detect_s + m.agree_s + m.plan_s + m.reshard_fixed_s + m.compile_s
    hw += options.job.transfer_s
    sw = m.detect_s + m.process_restart_s + m.compile_s + m.reshard_fixed_s
    r = simulate_job(options, "mnemojax", stream)
    assert sorted(r.outages_s) == pytest.approx(sorted([hw, sw]))


def test_json_trace_and_grid(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(
        json.dumps(
            {
                "events": [
                    {"time_hours": 2, "accelerator": 17, "category": "gpu_hbm"},
                    {"time_hours": 3, "category": "network"},
                ]
            }
        )
    )
    events = load_trace(path)
    assert events[0].host == 2
    base = SimulationOptions(job=JobOptions(accelerators=1024), days=1)
    points = run_grid(base, scales=[1024, 4096], trace=events, runs=3)
    assert len(points) == 6
    assert all(p.failures_per_day == 2 and p.mtbf_accelerator_hours is None for p in points)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("time_hours,category\n-1,software\n", "time_hours='-1'"),
        ("time_hours,category\n1,cosmic_ray\n", "category='cosmic_ray'"),
        ("time_hours,host,category\n1,999,software\n", "host=999"),
        ("category\nsoftware\n", "'time_hours'"),
    ],
)
def test_bad_trace_raises_typed_error(tmp_path, text, needle):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(SimulationConfigError) as info:
        trace_stream(load_trace(path), hosts=128, categories=LLAMA3_CATEGORIES, horizon_s=1e6)
    assert needle in str(info.value)


def test_bench_json_maps_measured_phases(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            {
                "step_time_s": 0.03,
                "snapshot_overhead_frac": 0.02,
                "recovery": {
                    "phases_s": {
                        "detect": 6.9,
                        "agree": 0.2,
                        "source": 0.1,
                        "plan": 0.01,
                        "reshard": 0.03,
                        "compile": 1.7,
                        "replay": 0.03,
                    }
                },
                "baseline": {"restart_s": 25.0, "checkpoint_save_s": 3.0},
            }
        )
    )
    costs = load_bench_costs(path)
    assert costs == pytest.approx(
        {
            "mnemojax.snapshot_overhead_frac": 0.02,
            "mnemojax.detect_s": 6.9,
            "mnemojax.agree_s": 0.3,
            "mnemojax.plan_s": 0.01,
            "mnemojax.reshard_fixed_s": 0.03,
            "mnemojax.compile_s": 1.7,
            "restart.startup_s": 25.0,
            "classical.checkpoint_save_s": 3.0,
        }
    )
    path.write_text(json.dumps({"recovery": {"phases_s": {"detect": -1}}}))
    with pytest.raises(SimulationConfigError, match=r"recovery.phases_s.detect=-1"):
        load_bench_costs(path)


def _cli(argv, capsys):
    parser = __import__("argparse").ArgumentParser()
    sim_cli.add_arguments(parser)
    code = sim_cli.run(parser.parse_args(argv))
    return code, capsys.readouterr()


def test_cli_writes_json_markdown_and_png(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"recovery": {"phases_s": {"detect": 3.0}}}))
    out = tmp_path / "out"
    code, captured = _cli(
        [
            "--scales",
            "1k,16k",
            "--mtbf-hours",
            "50677",
            "--days",
            "5",
            "--runs",
            "1",
            "--bench-json",
            str(bench),
            "--mnemojax-compile-s",
            "2",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, captured.err
    assert "| 16k |" in captured.out
    data = json.loads((out / "simulate.json").read_text())
    assert data["schema"] == "mnemojax.simulate/1"
    assert len(data["results"]) == 2 * 3
    assert data["config"]["options"]["mnemojax"]["detect_s"] == 3.0  # from bench
    assert data["config"]["options"]["mnemojax"]["compile_s"] == 2.0  # flag wins
    assert all(0 < r["goodput"] <= 1 for r in data["results"])
    assert (out / "simulate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Badput by category" in (out / "simulate.md").read_text()


def test_cli_reports_bad_values(capsys):
    code, captured = _cli(["--days", "-1", "--no-plot"], capsys)
    assert code == 2
    assert "days=-1.0" in captured.err


def test_cli_is_registered_with_the_main_command(capsys):
    from mnemojax._src.cli import main

    with pytest.raises(SystemExit) as info:
        main(["simulate", "--help"])
    assert info.value.code == 0
    assert "--bench-json" in capsys.readouterr().out


def test_simulator_never_imports_jax():
    root = pathlib.Path(sim_cli.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "jax" or n.startswith(("jax.", "flax", "orbax")) for n in names), (
                path,
                names,
            )
            assert not any(
                n.startswith("mnemojax.")
                and not n.startswith(("mnemojax._src.simulator", "mnemojax._src.errors"))
                for n in names
            ), (path, names)
