"""Every survivor learns of a peer's death from the launcher (`worker.peer_watch`), not at
the collective timeout.

4 processes x 2 CPU devices under a 10 s collective timeout (half the launcher's default,
to keep the paced job short; the watch tells in ~0.2 s either way); worker 0 is
SIGKILLed. Without the watch, the survivors that were not exchanging with it when it died
stay blocked in gloo until that timeout ("Timed out waiting ..."); with it, each survivor's
reported failure is either gloo's "Connection closed by peer" (it was exchanging with the
dead worker) or the watch's notice, and the job ends exact. The job runs on for longer
than the collective timeout after the kill: the collective each told survivor abandoned
fails in the background meanwhile, harmlessly. No wall-clock threshold: the reasons the
survivors report to the launcher say how each learned.
"""

from __future__ import annotations

import logging
import re
import sys

import pytest

from mnemojax._src.distributed.worker.peer_watch import TOLD_BY_LAUNCHER
from mnemojax.testing import ProcessFault, run_scenario
from tests import helpers as h

pytestmark = pytest.mark.multiprocess

STEPS = 10
KILL_AFTER_STEP = 3
NPROC = 4
COLLECTIVE_TIMEOUT_S = 10  # the launcher's default is 20 s


def test_survivors_are_told_of_a_death_before_the_collective_timeout(tmp_path, caplog,
                                                                     capfd):
    caplog.set_level(logging.INFO, logger="mnemojax")
    reference = h.reference_run(h.make_batches(STEPS))
    # Paced so that the steps after the kill outlast the collective timeout.
    sleep_s = COLLECTIVE_TIMEOUT_S / (STEPS - KILL_AFTER_STEP - 1)
    cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", str(tmp_path),
           "--steps", str(STEPS), "--step-sleep-s", f"{sleep_s:.2f}", "--rewrite-between",
           "--tally-between"]
    report = h.check_job_report(run_scenario(
        cmd, nproc=NPROC, devices_per_proc=2, faults=[ProcessFault("kill", 0, KILL_AFTER_STEP)],
        collective_timeout_s=COLLECTIVE_TIMEOUT_S, job_timeout_s=240))
    assert report["rc"] == 0, report
    stats = h.assert_job_exact(tmp_path, reference, STEPS)
    [rec] = stats["recoveries"]
    assert rec["failed_processes"] == [0]
    first = {}  # survivor -> the first failure it reported in world 0
    for e in report["events"]:
        if e["op"] == "report_failure" and e["generation"] == 0:
            first.setdefault(e["worker_id"], e["reason"])
    assert sorted(first) == [1, 2, 3], first
    assert not [r for r in first.values() if "Timed out" in r], first
    assert all(TOLD_BY_LAUNCHER in r or "closed by peer" in r for r in first.values()), first
    assert any(TOLD_BY_LAUNCHER in r for r in first.values()), first
    # The launcher keeps each worker's newest step, not an event per worker and step (its
    # event list grew with the job's length)
    assert not [e for e in report["events"] if e["op"] == "progress"]
    assert {w: report["steps"][w] for w in (1, 2, 3)} == dict.fromkeys((1, 2, 3), STEPS)
    # The tally reset between steps (as metrics are) is undone by the recovery: each
    # survivor says so, naming it (a user trial's reset was undone silently); the leaf
    # replaced by an equal copy (as an nnx.jit eval writes back) is not named (a review saw
    # every leaf named). Worker lines come prefixed with their id.
    err = capfd.readouterr().err
    undone = [line for line in err.splitlines() if "changed outside the step" in line]
    assert sorted(line.split("]")[0] for line in undone) == [
        f"[worker {w}" for w in (1, 2, 3)], err[-3000:]
    assert all(re.search(r"since step \d+, tally/calls changed outside", line)
               for line in undone), undone
    # The launcher says which world formed, from which step, where its service runs
    assert f"world 1: workers [1, 2, 3], from step {rec['source_step']}, coordination " \
        "service on 127.0.0.1:" in caplog.text
