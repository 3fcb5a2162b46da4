"""Tests of `mnemojax bench` (mnemojax/_src/bench): the classical baseline really restarts
a process, the Young/Daly interval, preset validation, the tiny bench end to end (runs
a-d), and the multi-process runs (e) and (f) with a real kill on a smaller config."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from mnemojax._src.bench import baseline, driver, interval, multiproc, report, summary
from mnemojax._src.bench import cli as bench_cli
from mnemojax._src.bench.config import load_preset
from mnemojax._src.config import configure_devices
from mnemojax._src.errors import InvalidOptionError
from mnemojax._src.events import read_events
from tests.report_checks import check_process_pair, check_tiny_bench

RESTART_PRESET = """
devices = 8
mesh = [4, 2]
steps = 14
batch_size = 24
block_steps = 4
checkpoint_max_to_keep = 2
worker_timeout_s = 240
[model]
vocab_size = 64
seq_len = 16
d_model = 32
n_heads = 2
n_layers = 1
d_ff = 64
[[faults]]
step = 11
devices = [3]
"""


# -- Young/Daly and presets (pure, fast) ------------------------------------------------


def test_young_daly_interval():
    assert interval.young_daly_interval_s(0.5, 400.0) == pytest.approx(20.0)
    iv = interval.checkpoint_interval(0.5, 400.0, step_time_s=2.0, max_steps=100)
    assert (iv.interval_s, iv.steps, iv.clamped) == (pytest.approx(20.0), 10, False)
    assert iv.as_dict()["rule"].startswith("young_daly")
    assert interval.checkpoint_interval(0.5, 400.0, 0.01, max_steps=100).steps == 100
    assert interval.checkpoint_interval(0.5, 400.0, 0.01, max_steps=100).clamped
    assert interval.checkpoint_interval(0.0, 400.0, 1.0, max_steps=100).steps == 1
    # The interval grows as the square root of save cost and of MTBF.
    assert interval.young_daly_interval_s(2.0, 400.0) == pytest.approx(20.0 * math.sqrt(4))


@pytest.mark.parametrize("args, bad", [
    ((-1.0, 10.0), "save_cost_s=-1.0"), ((1.0, 0.0), "mtbf_s=0.0"),
    ((1.0, float("nan")), "mtbf_s=nan")])
def test_young_daly_rejects_bad_inputs(args, bad):
    with pytest.raises(InvalidOptionError, match=bad):
        interval.young_daly_interval_s(*args)
    with pytest.raises(InvalidOptionError, match="step_time_s=0"):
        interval.checkpoint_interval(1.0, 10.0, 0, max_steps=5)


def test_presets_load_and_the_record_preset_has_10m_params():
    from mnemojax.models.gpt import GPTConfig

    tiny, big = load_preset("tiny"), load_preset("gpt10m")
    assert 13_000 <= GPTConfig(**tiny.model).param_count() <= 100_000
    assert GPTConfig(**big.model).param_count() >= 10_000_000
    assert len(tiny.faults) == len(big.faults) == 2


def test_bad_preset_name_is_a_typed_error():
    with pytest.raises(InvalidOptionError, match="'nope'"):
        load_preset("nope")
    parser = __import__("argparse").ArgumentParser()
    bench_cli.add_arguments(parser)
    with pytest.raises(InvalidOptionError, match="'huge'"):
        bench_cli.run(parser.parse_args(["--preset", "huge"]))
    with pytest.raises(InvalidOptionError, match="mtbf_s=-3.0"):
        bench_cli.run(parser.parse_args(["--mtbf-s", "-3"]))


def test_preset_validation_names_the_bad_value(tmp_path):
    path = tmp_path / "bench_bad.toml"
    path.write_text(RESTART_PRESET.replace("step = 11", "step = 40"))
    with pytest.raises(InvalidOptionError, match="faults.step=40"):
        load_preset(path)
    path.write_text(RESTART_PRESET + "\ntypo = 1\n")
    with pytest.raises(InvalidOptionError, match="typo"):
        load_preset(path)


# The multi-process runs' config: 2 processes x 2 devices (the bench's presets: 4 x 2), a
# collective timeout of 5 s instead of the launcher's 20 s default, to keep the test short
# (the bench itself runs the defaults); no timing is asserted.
PROCESS_PRESET = """
devices = 4
mesh = [2, 2]
steps = 14
batch_size = 12
processes = 2
process_victim = 1
collective_timeout_s = 5
worker_timeout_s = 240
[model]
vocab_size = 64
seq_len = 16
d_model = 32
n_heads = 2
n_layers = 1
d_ff = 64
[[faults]]
step = 9
devices = [3]
"""


@pytest.mark.parametrize("edit, bad", [
    ("processes = 3", "processes=3"), ("processes = 1", "processes=1"),
    ("process_victim = 2", "process_victim=2"),
    ("collective_timeout_s = 0", "collective_timeout_s=0")])
def test_process_fields_are_validated(tmp_path, edit, bad):
    path = tmp_path / "bench_bad.toml"
    key = edit.split(" = ")[0]
    text = "\n".join(edit if line.startswith(f"{key} =") else line
                     for line in PROCESS_PRESET.splitlines())
    path.write_text(text)
    with pytest.raises(InvalidOptionError, match=bad):
        load_preset(path)


def _fake_pair_run(kind: str, next_good: float, final: list) -> dict:
    run = {"next_good_step_s": next_good, "back_past_killed_step_s": next_good + 1.0,
           "steps_past_killed_s": next_good + 3.0,
           "killed_step": 9, "steps_lost": 0, "processes_after": 3, "final_state": final,
           "nproc": 4, "devices_per_proc": 2, "victim": 1, "launch_options": "--x",
           "collective_timeout_s": 20, "interval_steps": 4}
    if kind == "e":
        return {**run, "recovery_phases_s": {"agree": 0.1}, "launcher_knows_s": 0.1,
                "recovery_total_s": next_good - 0.1, "executable": "cached",
                "from_export": True, "exports_taken": 2}
    return {**run, "phases_s": {"compile": 5.0}, "restored_step": 8}


def test_the_real_kill_figures_are_medians_over_alternating_pairs(tmp_path):
    """(e) and (f) run `process_pairs` times each: the figures are the medians, the ratio
    is of the medians, the phases shown are the median run's, and the worst final state
    counts."""
    ref = [np.zeros(3)]
    runs = {multiproc.RUN_E: [_fake_pair_run("e", t, [np.full(3, d)]) for t, d in
                              ((2.0, 0.0), (1.0, 1e-6), (4.0, 0.0))],
            multiproc.RUN_F: [_fake_pair_run("f", t, ref) for t in (30.0, 10.0, 20.0)]}
    p = summary.process_figures(runs, ref)
    assert p["pairs"] == 3 and len(p["runs"][multiproc.RUN_E]) == 3
    assert p["median"][multiproc.RUN_E] == {"next_good_step_s": 2.0,
                                            "back_past_killed_step_s": 3.0,
                                            "steps_past_killed_s": 5.0}
    assert p[multiproc.RUN_E]["next_good_step_s"] == 2.0  # the median run itself
    assert p["median_run"] == {multiproc.RUN_E: 0, multiproc.RUN_F: 2}
    assert p[multiproc.RUN_F]["next_good_step_s"] == 20.0
    assert p["ratio"]["next_good_step"] == pytest.approx(10.0)
    assert p["ratio"]["back_past_killed_step"] == pytest.approx(21.0 / 3.0)
    assert p["ratio"]["steps_past_killed"] == pytest.approx(23.0 / 5.0)
    assert p["final_state_max_abs_diff_vs_a"] == {"e": pytest.approx(1e-6), "f": 0.0}
    table = "\n".join(summary.format_process_table(p, summary.TARGETS))
    assert "3 runs of each, alternating" in table
    assert "1.00 2.00 4.00" not in table and "2.00 1.00 4.00" in table  # in run order
    assert "10.00x (medians) to the next good step" in table
    two = summary.process_figures({k: v[:2] for k, v in runs.items()}, ref)
    assert two["median"][multiproc.RUN_E]["next_good_step_s"] == 1.5  # the mean of two
    assert two[multiproc.RUN_E]["next_good_step_s"] == 1.0  # a run: the lower one
    with pytest.raises(InvalidOptionError, match="process_pairs=0"):
        load_preset("tiny", process_pairs=0)
    assert load_preset("tiny").process_pairs == 3


def test_kill_figures_wait_for_every_process_and_count_the_steps_past_the_kill():
    """A step counts once every process of the new world logged it; the third figure is
    `STEPS_PAST` steps past the killed one (slow steps after a recovery count there)."""
    t_kill, killed = 100.0, 16

    def steps(pid, t_first, step_s, last):
        return [{"pid": pid, "step": s, "time": t_first + (s - killed) * step_s}
                for s in range(killed, last + 1)]

    events = [{"pid": 1, "step": 15, "time": 99.0},  # the old world's: not counted
              *steps(1, 101.0, 0.1, 30), *steps(2, 101.5, 0.5, 30)]
    got = multiproc.kill_figures(events, killed=killed, t_kill=t_kill,
                                 new_world=lambda e: e["step"] >= killed)
    assert got["next_good_step_s"] == pytest.approx(1.5)
    assert got["back_past_killed_step_s"] == pytest.approx(1.5)
    assert got["steps_past_killed_s"] == pytest.approx(1.5 + multiproc.STEPS_PAST * 0.5)
    assert got["processes_after"] == 2
    short = [e for e in events if e["pid"] == 1 or e["step"] < killed + multiproc.STEPS_PAST]
    assert multiproc.kill_figures(short, killed=killed, t_kill=t_kill, new_world=lambda e: e[
        "step"] >= killed)["steps_past_killed_s"] is None  # process 2 never got there


def test_presets_use_the_launcher_defaults_for_the_real_kill():
    for name in ("tiny", "gpt10m"):
        cfg = load_preset(name)
        assert (cfg.processes, cfg.devices_per_process, cfg.collective_timeout_s) == (4, 2, None)
        assert cfg.process_kill_after_step == cfg.fault_steps[0] - 1


# -- the baseline really restarts a process ----------------------------------------------


# Slow (~45 s): the tiny bench's run (d) is this baseline, checked in CI by the wheel test.
@pytest.mark.slow
@pytest.mark.needs8
def test_baseline_restarts_a_process_and_resumes_from_the_checkpoint(tmp_path):
    preset = tmp_path / "bench_restart.toml"
    preset.write_text(RESTART_PRESET)
    cfg = load_preset(preset)
    events = tmp_path / "events.jsonl"
    final = tmp_path / "final.npz"
    result = baseline.run_baseline(cfg, preset=str(preset), out_dir=tmp_path,
                                   events_path=events, interval_steps=4,
                                   final_state=str(final), compile_cache=str(tmp_path / "xla"))
    launches = result["launches"]
    assert [x["returncode"] for x in launches] == [-signal.SIGKILL, 0]
    assert len({x["pid"] for x in launches}) == 2 and os.getpid() not in result["pids"]
    for x in launches:  # the killed process is really gone
        with pytest.raises(ProcessLookupError):
            os.kill(x["pid"], 0)
    log = [e for e in read_events(events) if e["run"] == "baseline"]
    pids = {e["pid"] for e in log if e.get("pid")}
    assert pids == {x["pid"] for x in launches}
    restores = [e for e in log if e["kind"] == "checkpoint_restore"]
    assert len(restores) == 1 and restores[0]["pid"] == launches[1]["pid"]
    (rec,) = result["recoveries"]
    assert rec["restored_step"] in (4, 8) and rec["restored_step"] == restores[0]["step"]
    assert rec["steps_lost"] == 10 - rec["restored_step"]
    assert result["steps_redone"] == rec["steps_lost"]
    first_new = min(e["step"] for e in log if e["kind"] == "step"
                    and e["pid"] == launches[1]["pid"])
    assert first_new == rec["restored_step"] + 1
    assert rec["recovery_s"] > sum(rec["phases_s"][k] for k in ("start+import", "init"))
    acc = {a.run: a for a in report.account_log(events)}["baseline"]
    assert acc.badput_s["restart"] > 0 and acc.badput_s["wasted_progress"] > 0

    # The same job without the kill, in one process: the same final state.
    ref = tmp_path / "ref.npz"
    subprocess.run([sys.executable, "-m", baseline.WORKER_MODULE, "--preset", str(preset),
                    "--ckpt-dir", str(tmp_path / "ref_ckpt"), "--events",
                    str(tmp_path / "ref.jsonl"), "--interval", "4", "--final-state", str(ref),
                    "--compile-cache", str(tmp_path / "xla")],
                   check=True, timeout=240, capture_output=True)
    with np.load(final) as got, np.load(ref) as want:
        assert got.files == want.files
        for k in want.files:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


# -- the tiny bench end to end ----------------------------------------------------------


# Slow (~130 s here, more than a sixth of the default suite): CI runs the same checks on
# the wheel test's `mnemojax bench --preset tiny` (tests/packaging_test.py), (e)/(f) included.
@pytest.mark.slow
@pytest.mark.needs8
def test_tiny_bench_writes_json_pngs_and_all_four_runs(tmp_path):
    cfg = load_preset("tiny")
    configure_devices(cfg.devices, who="mnemojax bench")
    s = driver.run_bench(cfg, preset="tiny", out_dir=tmp_path, progress=False)
    assert s["processes"] is None  # (e), (f): their own test below
    assert check_tiny_bench(tmp_path)["runs"].keys() == s["runs"].keys()


# -- (e) and (f): a real SIGKILL, several processes ------------------------------------------


def _failure_free_final_state(cfg) -> list:
    """The job without the kill, in this process (plain Flax on the same mesh)."""
    import jax
    from flax import nnx

    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step, shard_onto

    mesh = jax.make_mesh(cfg.mesh, ("data", "model"),
                         devices=jax.devices()[:int(np.prod(cfg.mesh))],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, optimizer = build_gpt(GPTConfig(**cfg.model), seed=cfg.seed,
                                 learning_rate=cfg.learning_rate)
    shard_onto(model, optimizer, mesh)
    corpus = BigramCorpus(cfg.model["vocab_size"], cfg.model["seq_len"], seed=cfg.seed)
    step = nnx.jit(lm_train_step)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    with jax.set_mesh(mesh):
        for i in range(cfg.steps):
            step(model, optimizer, jax.device_put(corpus.batch(i, cfg.batch_size),
                                                  batch_sharding))
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, optimizer)))]


# Slow (~55 s): the default suite's budget. CI still runs (e) and (f) end to end through the
# wheel test's `mnemojax bench --preset tiny`; the peer watch and the kill are covered by
# tests/e2e.
@pytest.mark.slow
@pytest.mark.multiprocess
def test_process_runs_recover_from_a_real_kill_to_the_failure_free_state(tmp_path):
    preset = tmp_path / "bench_processes.toml"
    preset.write_text(PROCESS_PRESET)
    cfg = load_preset(preset)
    runs = driver.run_process_pairs(cfg, preset=str(preset), out=tmp_path / "processes",
                                    cache=str(tmp_path / "xla"), interval_steps=4,
                                    progress=False)
    [e], [f] = runs[multiproc.RUN_E], runs[multiproc.RUN_F]
    assert e["processes_after"] == 1
    assert e["collective_timeout_s"] == 5 and e["launcher_knows_s"] is not None
    assert [x["returncodes"][1] for x in f["launches"]] == [-signal.SIGKILL, 0]
    assert f["launches"][1]["returncodes"] == [0, 0] and f["processes_after"] == 2
    assert f["restored_step"] in (0, 4, 8)
    for run in (e, f):
        # Killed once it completed step 8; it may finish step 9 before the signal lands.
        assert run["killed_step"] in (9, 10)
        assert run["back_past_killed_step_s"] > 0
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"mnjx{os.getpid()}_")]
    p = summary.process_figures(runs, _failure_free_final_state(cfg))
    check_process_pair(p)  # what the wheel test checks of `mnemojax bench`'s pair too
    diff = p["final_state_max_abs_diff_vs_a"]
    assert diff["f"] <= 1e-5, diff  # here (a) is on the same mesh: restored and redone
    table = "\n".join(summary.format_process_table(p, summary.TARGETS))
    assert "(f) classical / (e) mnemojax" in table and "(e) mnemojax launch" in table
