"""Multi-process recovery end to end: 3 workers x 2 CPU devices under the launcher.

Each test kills (or hangs) one worker of a real job and checks that the survivors
re-initialise in-process, take the lost shards from an agent (the buddy when the whole host
died), continue, and end allclose (rtol = atol = 1e-5) to a failure-free one-device run.
Every process is bounded by the launcher's job timeout and killed in its cleanup.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mnemojax._src.distributed.prototype_demo import run_scenario
from mnemojax._src.distributed.prototype_train import reference_params
from tests.helpers import process_alive

STEPS = 14


@pytest.fixture(scope="module")
def reference():
    return reference_params(STEPS)



def _run(tmp_path, reference, **kw):
    report = run_scenario(out=str(tmp_path), nproc=3, devices_per_proc=2, steps=STEPS,
                          at_step=5, job_timeout_s=240, **kw)
    assert report["rc"] == 0, report
    got = np.load(report["final"])
    for k, v in reference.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    survivors = report["workers"]
    assert len(survivors) == 2, report
    for w in survivors.values():
        assert w["resume_step"] <= (report["killed_step"] or STEPS)
        assert "next_good_step_s" in w
    assert not any(process_alive(p) for p in report["pids"]), "a process outlived the job"
    assert report["shm_left"] == [], "shared memory outlived the job"
    return report


@pytest.mark.parametrize("victim", [1, 0], ids=["worker1", "worker0"])
def test_kill_worker_survivors_continue(tmp_path, reference, victim):
    report = _run(tmp_path, reference, fault="worker", victim=victim)
    assert victim not in report["workers"]
    assert report["launcher_knows_s"] < 1.0  # the agent sees the exit at once
    # The dead worker's own agent survived and still serves its snapshot.
    for w in report["workers"].values():
        assert w["fetched_from"][str(victim)] in report["agents"].values()


def test_kill_whole_host_state_comes_from_buddy(tmp_path, reference):
    victim = 1
    report = _run(tmp_path, reference, fault="host", victim=victim)
    dead_agent = report["agents"][victim]
    buddy = report["agents"][(victim + 1) % 3]
    for w in report["workers"].values():
        assert w["fetched_from"][str(victim)] == buddy != dead_agent


def test_hung_worker_is_fenced_and_survivors_continue(tmp_path, reference):
    report = _run(tmp_path, reference, fault="hang", victim=2)
    assert 2 not in report["workers"]
    assert os.path.exists(report["final"])
