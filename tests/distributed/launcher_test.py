"""`distributed.launcher`: options, the CLI, and whole jobs of plain (no JAX) workers."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import pytest

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.launcher import launcher as launcher_module
from mnemojax._src.distributed.launcher.launcher import Launcher
from mnemojax._src.distributed.launcher.options import LaunchOptions
from mnemojax._src.distributed.launcher.scenario import process_alive
from mnemojax._src.errors import InvalidOptionError


def test_launch_options_validate():
    with pytest.raises(InvalidOptionError, match="nproc=0"):
        LaunchOptions(nproc=0)
    with pytest.raises(InvalidOptionError):
        LaunchOptions(nproc=1, hang_factor=1.0)


def test_cli_parses_command_after_double_dash():
    from mnemojax._src.distributed.launcher import cli
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--nproc", "4", "--devices-per-proc", "2", "--heartbeat-s", "12",
                              "--", sys.executable, "train.py", "--lr", "1"])
    assert args.nproc == 4 and args.devices_per_proc == 2 and args.heartbeat_s == 12
    assert args.command[-3:] == ["train.py", "--lr", "1"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("code, recover, expected", [(0, True, 0), (3, False, 3)])
def test_launcher_forwards_exit_status_and_leaves_nothing(tmp_path, code, recover, expected):
    script = ("import os, sys; open(os.path.join(sys.argv[1], os.environ['MNEMOJAX_WORKER_ID']),"
              " 'w').write(os.environ['MNEMOJAX_COORDINATOR']); sys.exit(int(sys.argv[2]))")
    launcher = Launcher(LaunchOptions(nproc=2, recover=recover, job_timeout_s=60, grace_s=1),
                        [sys.executable, "-c", script, str(tmp_path), str(code)])
    assert launcher.run() == expected
    if code == 0:
        assert sorted(os.listdir(tmp_path)) == ["0", "1"]
    pids = [p.pid for p in launcher.agents.values()] + list(launcher.worker_pids.values())
    assert len(pids) == 4 and not any(process_alive(p) for p in pids)


@pytest.mark.multiprocess
def test_launcher_job_timeout_kills_everything(tmp_path):
    launcher = Launcher(LaunchOptions(nproc=2, job_timeout_s=3, grace_s=1),
                        [sys.executable, "-c", "import time; time.sleep(600)"])
    t = time.monotonic()
    assert launcher.run() == 124
    assert time.monotonic() - t < 30
    pids = [p.pid for p in launcher.agents.values()] + list(launcher.worker_pids.values())
    assert not any(process_alive(p) for p in pids)


LEAVER = """
import os, sys, time
from mnemojax._src.distributed import auth
from mnemojax._src.distributed.worker.coordinator_client import LauncherCoordinator
w = int(os.environ["MNEMOJAX_WORKER_ID"])
c = LauncherCoordinator(os.environ["MNEMOJAX_CONTROL"], w,
                        secret=auth.secret_from_env(os.environ))
gone = os.path.join(sys.argv[1], "gone")
if w == 1:
    c.leave(generation=0, reason="no device of the new mesh")
    open(gone, "w").close()
    sys.exit(3)  # whatever status a worker that left ends with, it ends nothing
seen = c.watch(generation=0, timeout_s=30)
open(os.path.join(sys.argv[1], "seen"), "w").write(repr(seen.failed))
deadline = time.monotonic() + 30
while not os.path.exists(gone) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(1.0)  # worker 1 has exited meanwhile (it exits right after writing `gone`)
"""


@pytest.mark.multiprocess
def test_a_worker_that_leaves_is_gone_for_the_others_and_its_exit_ends_nothing(tmp_path):
    """Worker 1 leaves the job (`wire.Leave`), then exits with status 3: worker 0's watch
    of the world reports it gone at once, and the job ends 0 with worker 0 (a worker's own
    non-zero status ends the job, but not once it has left)."""
    launcher = Launcher(LaunchOptions(nproc=2, job_timeout_s=60, grace_s=1),
                        [sys.executable, "-c", LEAVER, str(tmp_path)])
    assert launcher.run() == 0
    assert (tmp_path / "seen").read_text() == "(1,)"
    assert [e["worker_id"] for e in launcher.events if e["op"] == "leave"] == [1]
    assert launcher.exit_codes == {0: 0, 1: 3}


ALL_LEAVE = """
import os
from mnemojax._src.distributed import auth
from mnemojax._src.distributed.worker.coordinator_client import LauncherCoordinator
w = int(os.environ["MNEMOJAX_WORKER_ID"])
c = LauncherCoordinator(os.environ["MNEMOJAX_CONTROL"], w,
                        secret=auth.secret_from_env(os.environ))
c.leave(generation=0, reason=f"no copy of worker {w + 7} step 4")
"""


@pytest.mark.multiprocess
def test_a_job_every_member_left_ends_saying_why(tmp_path, caplog):
    """Every member leaves (e.g. fresh processes whose agreed copies died before they could
    fetch them): the job ends with status 1, and the launcher says that no member is left
    and why each left, in its log and its events."""
    launcher = Launcher(LaunchOptions(nproc=2, job_timeout_s=60, grace_s=1),
                        [sys.executable, "-c", ALL_LEAVE])
    with caplog.at_level("ERROR", logger="mnemojax"):
        assert launcher.run() == 1
    [end] = [e for e in launcher.events if e["op"] == "no_members"]
    assert end["left"] == {"0": "no copy of worker 7 step 4", "1": "no copy of worker 8 step 4"}
    assert "no member of the job is left" in caplog.text
    assert "worker 1: no copy of worker 8 step 4" in caplog.text


STOPPED = """
import os, signal, sys, time
w = os.environ["MNEMOJAX_WORKER_ID"]
if w == "1":  # as a step with PersistentOptions(directory=...): takes SIGTERM, exits 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
open(os.path.join(sys.argv[1], w), "w").close()
time.sleep(60)
"""


@pytest.mark.multiprocess
def test_the_launcher_says_which_workers_its_stop_signal_ended_with_nothing_kept(tmp_path,
                                                                                 caplog):
    """Ctrl-C to a job whose steps keep no checkpoint directory ended every worker by the
    forwarded SIGTERM, and nothing said that nothing was kept (a user trial, two nodes).
    The launcher names the workers the signal ended (not one that stopped on its own)."""
    import signal
    import threading
    launcher = Launcher(LaunchOptions(nproc=2, job_timeout_s=60, grace_s=1, stop_grace_s=20),
                        [sys.executable, "-c", STOPPED, str(tmp_path)])

    def stop_when_started():
        deadline = time.monotonic() + 40
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler takes it (`run`)

    stopper = threading.Thread(target=stop_when_started, daemon=True)
    stopper.start()
    with caplog.at_level("WARNING", logger="mnemojax"):
        assert launcher.run() == 128 + signal.SIGTERM
    stopper.join(5)
    assert launcher.exit_codes == {0: -signal.SIGTERM, 1: 0}
    [said] = [r.getMessage() for r in caplog.records if "they checkpointed nothing" in r.message]
    assert said.startswith("mnemojax launch: workers [0] ended by the SIGTERM")


CRASH_AT_EXIT = """
import os
import mnemojax
session = mnemojax.initialize()
session.finish()
if os.environ["MNEMOJAX_WORKER_ID"] == "1":
    os.abort()  # a crash at exit, after the work was done
"""


@pytest.mark.multiprocess
def test_a_worker_that_crashes_after_it_finished_is_said_and_the_job_ends_0(tmp_path, caplog):
    """Worker 1 reports its "finish" phase, then aborts (SIGABRT): the job's status stays 0
    (its training was done), but the launcher says that it crashed after finishing (an
    abort at exit was silent: a survivor's thread left in jaxlib aborted it, session 24)."""
    launcher = Launcher(LaunchOptions(nproc=2, job_timeout_s=120, grace_s=1),
                        [sys.executable, "-c", CRASH_AT_EXIT])
    with caplog.at_level("WARNING", logger="mnemojax"):
        assert launcher.run() == 0
    assert launcher.exit_codes == {0: 0, 1: -6}
    assert [e["worker_id"] for e in launcher.events if e["op"] == "died_after_finish"] == [1]
    assert "worker 1 was ended by signal 6 after it finished" in caplog.text


DIES_LAST = """
import os, signal, sys, time
if os.environ["MNEMOJAX_WORKER_ID"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)  # after its last step, say: no world follows
time.sleep(2.0)
"""


@pytest.mark.multiprocess
def test_a_worker_killed_in_the_last_world_is_said_when_the_others_end_the_job_0(caplog):
    """Worker 1 is killed and no new world follows (the others finish): the job's status
    is 0, as the final members' (its training done), but the launcher says which worker
    ended by a signal with no world recovering it (it was silent: a user trial's last
    checkpoint went missing unannounced)."""
    launcher = Launcher(LaunchOptions(nproc=2, job_timeout_s=60, grace_s=1),
                        [sys.executable, "-c", DIES_LAST])
    with caplog.at_level("WARNING", logger="mnemojax"):
        assert launcher.run() == 0
    assert launcher.exit_codes == {0: 0, 1: -9}
    [said] = [e for e in launcher.events if e["op"] == "ended_without"]
    assert said["workers"] == {1: -9}
    assert "worker 1 ended by a signal (9) in its last world" in caplog.text


def test_a_spare_is_offered_to_a_world_only_while_it_asks_to_join(monkeypatch):
    """A warm spare that stops asking (`wire.AwaitJoin`, every `SPARE_POLL_S`: a frozen
    process) is offered to no world: a trial's SIGSTOPped spare was taken in and stalled
    the recovery for ~95 s. Between one poll's answer and the next it is still offered."""
    monkeypatch.setattr(launcher_module, "POLL_GAP_S", 2.0)
    launcher = Launcher(LaunchOptions(nproc=2, spares=1), ["true"])
    try:
        with launcher.roster.cv:
            launcher._idle.add(2)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            asking = pool.submit(launcher._await_join,
                                 wire.AwaitJoin(worker_id=2, timeout_s=1.0))
            time.sleep(0.3)
            with launcher.roster.cv:
                assert launcher._warm_spares() == [2]
            assert asking.result(timeout=5) == wire.Joined()  # (no world took it in)
        with launcher.roster.cv:
            assert launcher._warm_spares() == [2]  # (its next poll is on its way)
        time.sleep(2.3)
        with launcher.roster.cv:
            assert launcher._warm_spares() == []  # warm, idle, but not asking
    finally:
        launcher.cleanup()


def test_a_restart_past_the_budget_is_said_and_none_once_a_worker_finished(caplog):
    """`--max-restarts`: a crash past the budget was passed over in silence (a trial: the
    job went on at half its size with only "workers [4] dead"); it is said now. Once a
    worker of the job has exited 0 (its loop is done) nothing is restarted (a trial's
    worker killed after its last step got a charged restart and "the job grows back"),
    but a worker that left the job with status 0 does not count as done."""
    launcher = Launcher(LaunchOptions(nproc=2, max_restarts=1), ["true"])
    try:
        with launcher.roster.cv:
            launcher._restarts_used = 1
            assert not launcher._restart_as_spare(0, "ended by signal 9")
            assert [e["worker_id"] for e in launcher.events
                    if e["op"] == "restarts_used"] == [0]
            assert "worker 0 ended by signal 9: not restarted, all 1 restarts" in caplog.text
            launcher._restarts_used = 0
            launcher._departed.add(1)
            launcher.roster.exit_codes[1] = 0  # (it left the job)
            assert not launcher._loop_done()
            launcher._departed.clear()  # (its loop was done)
            assert launcher._loop_done()
            assert not launcher._restart_as_spare(0, "ended by signal 9")
            assert launcher._restarts_used == 0
    finally:
        launcher.cleanup()
