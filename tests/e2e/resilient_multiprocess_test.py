"""@mnemojax.resilient under `mnemojax launch`: 3 processes x 2 CPU devices, one dies.

The job (`tests/jobs/mp_resilient_job.py`) is the user's view: `mnemojax.initialize()`,
then a decorated NNX step on a (3, 2) data x model mesh. A worker is killed (or hangs);
the survivors re-initialise in-process, take the lost shards from the agents (the buddy
when the whole host died), continue on a (2, 2) mesh, and end allclose (1e-5) to a
failure-free plain Flax run. Each job is bounded by the launcher's timeout, which kills
every process it started.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from mnemojax._src.distributed.prototype_demo import run_scenario
from tests import helpers as h

STEPS = 10


@pytest.fixture(scope="module")
def reference():
    return h.reference_run(h.make_batches(STEPS))



def _run(tmp_path, reference, **kw):
    out = str(tmp_path)
    cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", out, "--steps",
           str(STEPS)]
    report = run_scenario(out=out, nproc=3, devices_per_proc=2, steps=STEPS, at_step=4,
                          job_timeout_s=240, cmd=cmd, **kw)
    assert report["rc"] == 0, report
    final = np.load(tmp_path / "final.npz")
    for i, want in enumerate(reference.state):
        np.testing.assert_allclose(final[f"arr_{i}"], want, rtol=1e-5, atol=1e-5)
    assert not any(h.process_alive(p) for p in report["pids"]), "a process outlived the job"
    assert report["shm_left"] == [], "shared memory outlived the job"
    stats = json.loads((tmp_path / "stats.json").read_text())
    [rec] = stats["recoveries"]
    assert rec["plan_kind"] == "process_loss" and rec["generation"] == 1
    assert rec["old_mesh_shape"] == {"data": 3, "model": 2}
    assert rec["new_mesh_shape"] == {"data": 2, "model": 2}
    assert rec["steps_lost"] <= 1
    assert set(rec["phases_s"]) == {"detect", "agree", "plan", "compile", "restore", "replay"}
    assert stats["steps_run"] == STEPS
    return rec, report


@pytest.mark.parametrize("victim", [1, 0], ids=["worker1", "worker0"])
def test_kill_worker(tmp_path, reference, victim):
    rec, report = _run(tmp_path, reference, fault="worker", victim=victim)
    assert rec["failed_processes"] == [victim]
    assert report["launcher_knows_s"] < 1.0


def test_kill_whole_host_takes_state_from_the_buddy(tmp_path, reference):
    rec, _ = _run(tmp_path, reference, fault="host", victim=2)
    assert rec["failed_processes"] == [2]


def test_hung_worker_is_treated_as_failed(tmp_path, reference):
    rec, _ = _run(tmp_path, reference, fault="hang", victim=1)
    assert rec["failed_processes"] == [1]


def test_nan_batch_is_skipped_by_every_process_alike(tmp_path, reference):
    """The finiteness verdict is global: every process skips the poisoned batch, and a
    kill later in the run still recovers exactly."""
    cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", str(tmp_path),
           "--steps", str(STEPS), "--nan-at-step", "3"]
    report = run_scenario(out=str(tmp_path), nproc=3, devices_per_proc=2, steps=STEPS,
                          at_step=6, job_timeout_s=240, cmd=cmd, fault="worker", victim=1)
    assert report["rc"] == 0, report
    final = np.load(tmp_path / "final.npz")
    for i, want in enumerate(reference.state):
        np.testing.assert_allclose(final[f"arr_{i}"], want, rtol=1e-5, atol=1e-5)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["skipped_batches"] == [3] and len(stats["recoveries"]) == 1


def test_transient_error_in_one_process_is_retried_in_place(tmp_path, reference):
    """Worker 0's launch of step 4 fails once with UNAVAILABLE: it retries at once, its
    peers wait in the collective, and no world recovery happens."""
    cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", str(tmp_path),
           "--steps", str(STEPS), "--transient-worker", "0", "--transient-at-step", "4"]
    report = run_scenario(out=str(tmp_path), nproc=3, devices_per_proc=2, steps=STEPS,
                          job_timeout_s=240, cmd=cmd, fault="none")
    assert report["rc"] == 0, report
    final = np.load(tmp_path / "final.npz")
    for i, want in enumerate(reference.state):
        np.testing.assert_allclose(final[f"arr_{i}"], want, rtol=1e-5, atol=1e-5)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["transient_retries"] == 1 and stats["recoveries"] == []
    assert stats["mesh_shape"] == {"data": 3, "model": 2}


def test_too_few_survivors_end_in_typed_error_with_a_checkpoint(tmp_path):
    """4 processes x 2 devices on a (1, 8) mesh: the model needs all 8 devices. After a
    kill, 6 remain: the job ends with MeshTooSmallError (exit 3), and the agreed step is
    in the persistent tier, equal to the failure-free run after that many steps."""
    import orbax.checkpoint as ocp

    out = str(tmp_path)
    cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", out, "--steps",
           str(STEPS), "--model-axis", "8", "--ckpt", str(tmp_path / "ckpt")]
    report = run_scenario(out=out, nproc=4, devices_per_proc=2, steps=STEPS, at_step=4,
                          job_timeout_s=240, cmd=cmd, fault="worker", victim=3)
    assert report["rc"] != 0
    assert not any(h.process_alive(p) for p in report["pids"]), "a process outlived the job"
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("state", "mnemojax"))
    saved = mngr.latest_step()
    assert saved is not None and 4 <= saved < STEPS
    state = mngr.restore(saved, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]
    from flax import nnx

    model, optimizer = h.make_mlp()  # the failure-free run, plain Flax, `saved` steps
    ref_step = nnx.jit(h.train_step)
    for b in h.make_batches(saved):
        ref_step(model, optimizer, b)
    got = state["model"]
    for layer in ("l1", "l2"):
        for name in ("kernel", "bias"):
            np.testing.assert_allclose(
                np.asarray(got[layer][name]),
                np.asarray(getattr(getattr(model, layer), name).get_value()),
                rtol=1e-5, atol=1e-5)
    assert int(state["optimizer"]["step"]) == saved
