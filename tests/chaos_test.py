"""The chaos soak: random fault schedules end exact, with every fault in the event log.

In one process (8 CPU devices) and across processes (4 workers x 2 CPU devices under the
launcher, process faults done from outside).
"""

import itertools

import pytest

from mnemojax._src.chaos import draw_process_schedule, run_chaos, run_chaos_processes
from mnemojax.errors import InvalidOptionError


@pytest.mark.needs8
@pytest.mark.parametrize("seed", [0, 3])
def test_short_chaos_run_is_exact_and_accounted(seed, tmp_path):
    report = run_chaos(steps=60, seed=seed, fault_rate=0.15, workdir=str(tmp_path))
    assert report["faults_planned"] >= 3, report
    assert report["unaccounted"] == [], report
    assert report["state_matches_reference"], report


@pytest.mark.needs8
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_chaos_soak_300_steps(seed, tmp_path):
    report = run_chaos(steps=300, seed=seed, workdir=str(tmp_path))
    assert report["ok"], report
    assert report["faults_planned"] >= 5


def test_bad_chaos_parameters_are_named():
    with pytest.raises(InvalidOptionError, match="fault_rate=2"):
        run_chaos(steps=10, seed=0, fault_rate=2)
    with pytest.raises(InvalidOptionError, match="processes=1"):
        run_chaos_processes(nproc=1, steps=40, seed=0)


@pytest.mark.parametrize("seed", range(40))
def test_process_schedule_is_always_survivable(seed):
    """Never more than nproc - 1 processes lost, process faults 5+ steps apart, transient
    errors only in workers that live to the end, and the same schedule for the same seed."""
    plan = draw_process_schedule(nproc=4, steps=40, seed=seed, fault_rate=0.3)
    victims = [f.victim for f in plan["faults"]]
    assert len(victims) == len(set(victims)) <= 3
    steps = [f.at_step for f in plan["faults"] if f.kind != "kill_in_agreement"]
    assert all(b - a >= 5 for a, b in itertools.pairwise(steps))
    assert all(w not in victims for w, _ in plan["transients"])
    for i, f in enumerate(plan["faults"]):  # a kill during the agreement follows its kill
        if f.kind == "kill_in_agreement":
            assert plan["faults"][i - 1].kind == "kill" and plan["faults"][i - 1].victim != f.victim
    assert all(2 <= k < 39 for k in plan["nan_steps"] + steps)
    again = draw_process_schedule(nproc=4, steps=40, seed=seed, fault_rate=0.3)
    assert again["planned"] == plan["planned"]


@pytest.mark.slow  # ~50 s; the schedules are checked above, the soak below
def test_process_chaos_run_is_exact_and_accounted(tmp_path):
    """Seed 3: a whole host, a corrupt copy, a hang, a NaN batch and two transient errors."""
    report = run_chaos_processes(nproc=4, steps=40, seed=3, workdir=str(tmp_path),
                                 job_timeout_s=240)
    assert report["ok"], report
    assert {k for k, n in report["by_kind"].items() if n} == {
        "host", "corrupt", "hang", "nan", "transient"}
    assert report["lost_processes"] == [0, 1, 2] and report["final_mesh"] == {
        "data": 1, "model": 2}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 2, 5, 6, 7, 9, 13, 31])
def test_process_chaos_soak(seed, tmp_path):
    report = run_chaos_processes(nproc=4, steps=40, seed=seed, workdir=str(tmp_path),
                                 job_timeout_s=240)
    assert report["ok"], report
    assert report["faults_planned"] >= 3
