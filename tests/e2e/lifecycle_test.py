"""The multi-process job's lifecycle under `mnemojax launch` (issue 14): a user's exception
in one worker ends the job with it, a worker that never calls `mnemojax.initialize()` is
an error naming it, SIGTERM to the launcher checkpoints one step all workers agreed on and
exits 143, and kill -9 of the launcher leaves nothing behind.

The first jobs run under `mnemojax.testing.run_scenario`, bounded by the launcher's timeout,
which kills every process it started; the signal tests run ``python -m mnemojax launch`` as
a process of its own and kill its process group in ``finally``. No process or
shared-memory segment may outlive a job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from mnemojax._src.distributed.launcher.scenario import process_alive
from mnemojax.testing import run_scenario
from tests import helpers as h

pytestmark = pytest.mark.multiprocess
STEPS = 4000  # launched jobs run until signalled


def _run(tmp_path, *extra: str, nproc: int = 3) -> dict:
    cmd = [sys.executable, "-m", "tests.jobs.mp_lifecycle_job", "--out", str(tmp_path),
           *extra]
    t0 = time.monotonic()
    report = run_scenario(cmd, nproc=nproc, devices_per_proc=2, job_timeout_s=150)
    report["wall_s"] = time.monotonic() - t0
    assert not any(process_alive(p) for p in report["pids"]), "a process outlived the job"
    assert report["shm_left"] == [], "shared memory outlived the job"
    return report


def _ops(report, op):
    return [e for e in report["events"] if e["op"] == op]


@pytest.mark.parametrize("where", [pytest.param("loop", marks=pytest.mark.slow), "step",
                                   pytest.param("oom", marks=pytest.mark.slow)])  # ~22 s each
def test_user_exception_in_one_worker_ends_the_job_with_it(tmp_path, capfd, where):
    """Worker 2 of 4 raises (in the training loop, or inside the step call; or its step
    fails with RESOURCE_EXHAUSTED, an error of its own process, `proxy.looks_local`, not a
    peer failure): the job ends with its exit status and its message, every worker stops,
    nothing is recovered."""
    report = _run(tmp_path, "--raise-worker", "2", "--raise-at-step", "3", "--raise-in", where,
                  nproc=4)
    assert report["rc"] == 1, report["rc"]
    [error] = _ops(report, "worker_error")
    assert error["worker_id"] == 2 and error["code"] == 1
    if where == "loop":
        assert error["error"] == "RuntimeError: user bug in worker 2 at step 3"
    if where == "oom":
        assert error["error"].startswith("JaxRuntimeError: RESOURCE_EXHAUSTED"), error
    assert error["error"], error
    assert _ops(report, "decided") == []  # never recovered
    assert not (tmp_path / "final.npz").exists()
    assert "worker 2 exited with status 1" in capfd.readouterr().err
    assert report["wall_s"] < 100  # no collective or agreement timeout waited out


def test_worker_without_initialize_is_an_error_naming_it(tmp_path, capfd):
    report = _run(tmp_path, "--no-initialize", nproc=2)
    assert report["rc"] == 1, report["rc"]
    assert _ops(report, "worker_error")
    assert "never called mnemojax.initialize()" in capfd.readouterr().err
    assert not (tmp_path / "final.npz").exists()


def _job_pids(marker: str) -> list[int]:
    """Every live process whose command line holds ``marker`` (the job's unique out dir:
    the agents carry the worker command after ``--``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
            if marker.encode() in f.read() and process_alive(int(entry)):
                pids.append(int(entry))
    return pids


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _launch(tmp_path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mnemojax", "launch", "--nproc", "2", "--devices-per-proc",
           "2", "--timeout-s", "150", "--", sys.executable, "-m", "tests.jobs.mp_lifecycle_job",
           "--out", str(tmp_path), "--steps", str(STEPS), "--marker-at-step", "3", *extra]
    return subprocess.Popen(cmd, start_new_session=True)


def _no_leftovers(tmp_path, launcher_pid: int) -> None:
    assert _wait_for(lambda: not _job_pids(str(tmp_path)), 15), _job_pids(str(tmp_path))
    shm = [n for n in os.listdir("/dev/shm") if n.startswith(f"mnjx{launcher_pid}_")]
    assert _wait_for(lambda: not [n for n in os.listdir("/dev/shm")
                                  if n.startswith(f"mnjx{launcher_pid}_")], 5), shm


def _kill_job(proc: subprocess.Popen, tmp_path) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in _job_pids(str(tmp_path)):  # the agents run in sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, id="SIGTERM"),  # ~16 s each
                                 pytest.param(signal.SIGINT, id="SIGINT", marks=pytest.mark.slow)])
def test_signal_to_the_launcher_checkpoints_one_agreed_step_and_leaves_nothing(tmp_path, sig):
    """What a scheduler does on preemption (or Ctrl-C): the launcher forwards SIGTERM to the
    workers, which agree on the step to stop after, checkpoint it together (it equals the
    failure-free run's state at that step), and the launcher exits 128 + the signal with
    nothing left. No sleep between steps: the workers get the notice at different step
    boundaries."""
    ckpt = tmp_path / "ckpt"
    proc = _launch(tmp_path, "--ckpt", str(ckpt), "--step-sleep-s", "0")
    try:
        assert _wait_for(lambda: (tmp_path / "step-3").exists(), 120), "no step 3"
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=90) == 128 + sig
        assert time.monotonic() - t0 < 30
        _no_leftovers(tmp_path, proc.pid)
    finally:
        _kill_job(proc, tmp_path)
    saved = h.assert_only_checkpoint_is_the_reference(ckpt, (4, 2))
    assert 3 <= saved < STEPS


def test_kill_9_of_the_launcher_leaves_nothing(tmp_path):
    """The agents get SIGTERM when the launcher dies (PDEATHSIG): each kills its worker and
    removes its shared-memory segment."""
    proc = _launch(tmp_path)
    try:
        assert _wait_for(lambda: (tmp_path / "step-3").exists(), 120), "no step 3"
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"mnjx{proc.pid}_")]
        proc.kill()
        proc.wait(timeout=10)
        _no_leftovers(tmp_path, proc.pid)
    finally:
        _kill_job(proc, tmp_path)
