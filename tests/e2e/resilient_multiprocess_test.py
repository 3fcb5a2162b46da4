"""@mnemojax.resilient under the launcher: 3 or 4 processes x 2 CPU devices, real faults.

The job (`tests/jobs/mp_resilient_job.py`) is the user's view: `mnemojax.initialize()`,
then a decorated NNX step on a (processes, 2) data x model mesh. `mnemojax.testing.
run_scenario` does the faults to the processes from outside (SIGKILL of a worker or of a
whole host, SIGSTOP, a flipped bit in an agent's shared memory, a kill during the
agreement). Every recovery must end allclose (1e-5) to a failure-free plain Flax run;
every other outcome is a typed error. Each job is bounded by the launcher's timeout, which
kills every process it started; no process or shared-memory segment may outlive a job.

In the (n, 2) mesh the parameters are replicated over the data axis, so worker 0 (data row
0) owns every snapshot shard: losing worker 0's copies is what loses state.
"""

from __future__ import annotations

import json
import re
import signal
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from mnemojax.testing import ProcessFault, run_scenario
from tests import helpers as h

pytestmark = pytest.mark.multiprocess

STEPS = 10


@pytest.fixture(scope="module")
def reference():
    return h.reference_run(h.make_batches(STEPS))


def _run(tmp_path, faults, *, nproc=3, extra=(), **kw) -> dict:
    cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", str(tmp_path),
           "--steps", str(STEPS), *extra]
    return h.check_job_report(run_scenario(cmd, nproc=nproc, devices_per_proc=2,
                                           faults=faults, job_timeout_s=240, **kw))


def _assert_exact(tmp_path, reference) -> dict:
    return h.assert_job_exact(tmp_path, reference, STEPS)


def _one_recovery(tmp_path, reference, report, *, nproc=3) -> dict:
    assert report["rc"] == 0, report
    stats = _assert_exact(tmp_path, reference)
    [rec] = stats["recoveries"]
    assert rec["plan_kind"] == "process_loss" and rec["generation"] >= 1
    assert rec["old_mesh_shape"] == {"data": nproc, "model": 2}
    assert set(rec["phases_s"]) == {"detect", "close", "agree", "plan", "compile", "restore",
                                    "replay"}
    # Its publishes after steps read from the packs the step wrote (on CPU by default).
    assert stats["snapshots_packed"] >= STEPS // 2, stats["snapshots_packed"]
    # ... and its statistics say so (a trial read 0 taken, 0 bytes, cadence 0).
    assert stats["snapshots_taken"] >= stats["snapshots_packed"], stats
    assert stats["snapshot_bytes"] > 0 and stats["snapshot_every_steps"] == 1, stats
    return rec


def _assert_evals_exact(tmp_path) -> None:
    """Workers 0 and 2 wrote an eval after every step, each equal to the failure-free
    plain run's."""
    want = h.reference_evals(h.make_batches(STEPS))
    for w in (0, 2):
        with open(tmp_path / f"evals-w{w}.json") as f:
            got = json.load(f)
        assert sorted(map(int, got)) == list(range(1, STEPS + 1))
        np.testing.assert_allclose([got[str(k)] for k in range(1, STEPS + 1)], want,
                                   rtol=1e-5, atol=1e-5)


def _launcher_events(report, op):
    return [e for e in report["events"] if e["op"] == op]


@pytest.mark.slow  # ~26 s; per-host rows after a kill: the default multinode test
@pytest.mark.parametrize(("victim", "host_data"), [(1, True)], ids=["worker1-host-data"])
def test_kill_worker(tmp_path, reference, victim, host_data):
    """worker1-host-data: the job feeds per-host batches from a Grain dataset
    (`mnemojax.data.HostBatches`): each process reads only its third of each global batch,
    and after the loss the two survivors read half each, the lost slice included."""
    report = _run(tmp_path, [ProcessFault("kill", victim, 4)],
                  extra=("--host-data",) if host_data else ())
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["failed_processes"] == [victim] and rec["steps_lost"] <= 1
    assert rec["new_mesh_shape"] == {"data": 2, "model": 2}
    assert report["launcher_knows_s"] < 1.0  # the agent sees the exit at once
    # Only worker 0 owns snapshot shards (data row 0): they come from its own agent; the
    # other workers' copies hold no shards and are not fetched.
    assert rec["fetched_from"] == {"0": report["agents"][0]}
    if host_data:
        for w in (0, 2):  # the survivors (the killed worker writes nothing)
            rows = _rows_read(tmp_path, w)
            assert rows[1] == h.BATCH // 3  # its own slice of a 3-process world
            assert rows[STEPS] == h.BATCH // 2  # the world of 2: the lost slice shared
            assert max(rows.values()) < h.BATCH  # never the whole global batch
            assert sorted(rows) == list(range(1, STEPS + 1))


def test_a_worker_killed_during_a_guarded_eval_is_recovered_and_every_eval_is_exact(
        tmp_path, reference):
    """The job evaluates after every step through ``step.guard`` (its loss a mean over a
    batch placed across the processes); worker 1 dies inside the eval after step 3. The
    survivors recover there, run that eval again on the new mesh and go on: every eval
    and the final state equal the failure-free plain run's. (Unguarded, the same kill
    ended the job: gloo's error left the eval in every survivor.) Before each eval the job
    replaces the optimizer's step count by an equal array: the guard's comparison of the
    state with the step's runs across the processes, and passes."""
    report = _run(tmp_path, [ProcessFault("kill", 1, 3)],
                  extra=("--guarded-eval", "--eval-slow-after", "3", "--touch-before-eval"))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["guarded"] and rec["step"] == 4 and rec["failed_processes"] == [1]
    assert rec["new_mesh_shape"] == {"data": 2, "model": 2} and rec["steps_lost"] == 0
    _assert_evals_exact(tmp_path)


def test_a_death_inside_a_guarded_eval_names_nothing_as_changed_outside_the_step(
        tmp_path, reference, capfd):
    """Worker 1 dies 1 s into its eval after step 3, so the others are inside theirs: the
    ``nnx.jit`` eval has written its outputs (equal values, never computed: the eval waits
    for the dead worker) back into the model. The eval runs again after the recovery, so
    the recovery names no leaf as changed outside the step (it named every one the eval
    wrote back, a user trial's 14); every eval and the final state exact."""
    report = _run(tmp_path, [], extra=("--guarded-eval", "--die-in-eval", "1",
                                       "--die-in-eval-at", "3"))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["guarded"] and rec["step"] == 4 and rec["failed_processes"] == [1]
    printed = capfd.readouterr()
    assert "killing myself in the eval after step 3" in printed.out + printed.err
    assert "changed outside the step" not in printed.out + printed.err
    _assert_evals_exact(tmp_path)


def test_survivors_that_meet_a_death_in_a_guarded_eval_and_in_the_next_step_go_on_together(
        tmp_path, reference):
    """An eval with no collective across processes (each computes the whole loss from
    the host batch): worker 0 pauses before its eval after step 3, worker 1 dies
    1 s into its own eval (it kills itself there: an outside kill at its step 3 could
    come before worker 2 finished its eval, seen once under the full suite), worker 2
    has finished its eval and meets the death in step 4. Worker 0
    meets it in the guarded eval (the death heard of before it starts) and recovers
    there; as worker 2 is past the eval, worker 0 does not run it again (work with
    collectives run alone would wait for worker 2: `GuardSkippedError`, which the job
    catches); then both run step 4 in the new world, with no compile barrier that only
    worker 0 would wait at. Every other eval and the final state exact."""
    report = _run(tmp_path, [],
                  extra=("--guarded-eval", "--eval-on-host", "--eval-slow-after", "3",
                         "--die-in-eval", "1", "--die-in-eval-at", "3"))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["guarded"] and rec["step"] == 4  # (worker 0's record: it writes stats.json)
    want = h.reference_evals(h.make_batches(STEPS))
    for w, skipped in ((0, {3}), (2, set())):
        with open(tmp_path / f"evals-w{w}.json") as f:
            got = json.load(f)
        assert {int(k) for k, v in got.items() if v is None} == skipped, (w, got)
        np.testing.assert_allclose([got[str(k)] for k in range(1, STEPS + 1) if k not in
                                    skipped], [v for k, v in enumerate(want, start=1)
                                               if k not in skipped], rtol=1e-5, atol=1e-5)


def test_the_users_own_code_between_steps_may_outlast_the_hang_limit(tmp_path, reference):
    """Every worker spends 22 s in its own code after step 3 (a long eval, a slow save):
    longer than the agents' hang limit here (20 s: the collective timeout and 10 s). The
    watchdog judges only the calls of the step, and between them the workers' signs of
    life: no worker is taken for hung, the job ends exact with no recovery. (Before, every
    agent killed its worker at 20 s and the job ended with nobody left.)"""
    report = _run(tmp_path, [], extra=("--pause-after", "3", "--pause-s", "22"))
    assert report["rc"] == 0, report
    assert _launcher_events(report, "hang") == []
    assert _assert_exact(tmp_path, reference)["recoveries"] == []


def test_a_users_thread_asking_jax_during_the_recovery_does_not_break_the_new_world(
        tmp_path, reference):
    """A thread of the user's asks ``jax.process_index()`` every 0.5 ms throughout (a
    logger; Orbax's save thread does it in its error path when the old client goes).
    Worker 1 dies after step 4. Asked between the old client's shutdown and the new one's
    connect, JAX made a backend without the distributed client, which stood for the new
    world's: "process 0 of the new world has 0 devices" in every survivor (a user trial).
    Now the new world's backend is made after the connect: exact."""
    report = _run(tmp_path, [ProcessFault("kill", 1, 4)], extra=("--poll-thread",))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["failed_processes"] == [1] and rec["new_mesh_shape"] == {"data": 2, "model": 2}


def test_a_survivor_fetches_only_the_regions_its_devices_hold(tmp_path):
    """4 processes x 2 devices on a (2, 4) mesh: each model replica spans two processes,
    and replica 0 (workers 0 and 1) owns every snapshot shard. Workers 0 and 1 are killed
    together; the world of [2, 3] keeps replica 1. Worker 2 (process 0 of the new world)
    fetches only the model columns its own devices hold: about half of the state, from
    worker 0's copy on worker 0's own agent (which outlives its worker), and nothing of
    worker 1's copy. The step also takes a typed PRNG key every call (the Flax dropout
    guide's pattern), placed whole on every device of every process and replayed as
    given."""
    report = _run(tmp_path, [ProcessFault("kill", 0, 4), ProcessFault("kill", 1, 4)],
                  nproc=4, extra=("--model-axis", "4", "--key-seed", "7"))
    assert report["rc"] == 0, report
    reference = h.reference_run(h.make_batches(STEPS), key_seed=7)
    assert not np.allclose(reference.state[0], h.reference_run(
        h.make_batches(STEPS), key_seed=8).state[0])  # the key changes the math
    stats = _assert_exact(tmp_path, reference)
    [rec] = stats["recoveries"]
    assert rec["plan_kind"] == "process_loss" and rec["failed_processes"] == [0, 1]
    assert rec["steps_lost"] <= 1 and report["launcher_knows_s"] < 1.0
    assert (rec["old_mesh_shape"], rec["new_mesh_shape"]) == (
        {"data": 2, "model": 4}, {"data": 1, "model": 4})
    assert rec["fetched_from"] == {"0": report["agents"][0]}
    state_bytes = sum(a.nbytes for a in np.load(tmp_path / "final.npz").values())
    assert 0 < rec["bytes_moved"] < 0.6 * state_bytes, (rec["bytes_moved"], state_bytes)


def test_a_replicated_input_that_differs_between_processes_is_refused(tmp_path):
    """Each process passes another PRNG key (seeded with its worker id) where the step
    takes one replicated key: at the first call every process compares the replicated
    inputs' checksums through the coordination service and raises BatchSplitError naming
    the input (exit 5), before any step runs. Unchecked, each process's devices would
    hold their own "replicated" key and the state's replicas would drift apart."""
    report = _run(tmp_path, [], nproc=2, extra=("--key-seed", "7", "--key-per-process"))
    assert report["rc"] == 5, report
    for w in (0, 1):
        text = (tmp_path / f"error-w{w}.txt").read_text()
        assert text.startswith("BatchSplitError: the replicated input key differs"), text
    assert not (tmp_path / "final.npz").exists()


def test_a_batch_array_over_other_processes_devices_is_refused(tmp_path):
    """A batch built the MaxText way (`jax.make_array_from_process_local_data`: each process
    gives only its own rows) spans the other processes' devices: after a loss no survivor
    has the lost rows to replay the step or place it on a new mesh. Every process refuses
    it at the first call with a BatchSplitError naming the input and HostBatches (exit 5),
    not JAX's RuntimeError about fetching a non-addressable array."""
    report = _run(tmp_path, [], nproc=2, extra=("--global-array-batch",))
    assert report["rc"] == 5, report
    for w in (0, 1):
        text = (tmp_path / f"error-w{w}.txt").read_text()
        assert text.startswith("BatchSplitError: the step input "), text
        assert "over devices of other processes" in text and "HostBatches" in text, text
    assert not (tmp_path / "final.npz").exists()


def test_a_step_with_host_callbacks_compiles_nothing_ahead_and_recovers_exact(
        tmp_path, reference):
    """The step prints its loss (`jax.debug.print`), with the persistent cache on: JAX
    writes no entry for an executable with host callbacks, so no process compiles a
    candidate world ahead (nobody could load it) and, after worker 1 is killed, the new
    world compiles on its path without waiting for another process's entry; it ends
    exact."""
    report = _run(tmp_path, [ProcessFault("kill", 1, 3)],
                  extra=("--debug-print", "--precompile-cache", str(tmp_path / "xla")))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["executable"] == "compiled" and not rec["from_export"], rec
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["precompiled_meshes"] == 0 and stats["exports_taken"] == 0, stats


def _rows_read(out, worker: int) -> dict[int, int]:
    with open(f"{out}/rows-w{worker}.json") as f:
        return {int(k): n for k, n in json.load(f).items()}


@pytest.mark.slow  # ~20 s; compile_kill_test covers the initial state
def test_kill_during_the_first_step_resumes_from_the_initial_state(tmp_path, reference):
    """The initial state is published before step 1 (step 0), so a peer lost in the very
    first step costs nothing but that step."""
    report = _run(tmp_path, [ProcessFault("kill", 0, 0)])
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["failed_processes"] == [0] and rec["source_step"] == 0
    assert rec["step"] in (1, 2)  # step 1, or step 2 if step 1 completed before the kill


def test_a_lost_host_s_state_comes_from_its_buddy_which_an_outsider_could_not_harm(
        tmp_path, reference):
    """During the job, forged requests without the secret go to the launcher's port (a
    ``hello`` that would replace agent 1's link, an ``agree``) and to agent 1's (an
    ``alloc`` that would wipe the replicas it keeps, a ``get``): every connection is closed
    unanswered and logged. Then host 0 is lost (worker and agent): worker 0's state comes
    from its ring buddy, agent 1, over authenticated connections, and the run ends exact.
    (The survivors' held replicas are off: with them the agreement may take the newer step
    they cover over the buddy's copy, which lags by the replication time.)"""
    report = _run(tmp_path, [ProcessFault("intrude", 1, 2), ProcessFault("host", 0, 4)],
                  extra=("--no-held-replicas",))
    rec = _one_recovery(tmp_path, reference, report)
    intrusion = next(f for f in report["fired"] if f["kind"] == "intrude")
    assert intrusion["answered"] == []
    refused = _launcher_events(report, "refused_connection")
    assert len([e for e in refused if "worker_id" not in e]) == 2  # the launcher's port
    assert len([e for e in refused if e.get("worker_id") == 1]) == 2  # agent 1's
    assert rec["failed_processes"] == [0]
    assert rec["fetched_from"] == {"0": report["agents"][1]}  # 0's ring buddy


def test_a_spare_on_one_machine_keeps_the_mesh_and_its_replica_covers_the_next_loss(
        tmp_path, reference, caplog):
    """`mnemojax launch --spares 1` without etcd: 3 workers x 2 devices on (3, 2) and one
    warm spare (worker 3). Host 0 (worker and agent; worker 0 owns every snapshot shard)
    is lost at step 3: the spare takes its rank, and the mesh stays (3, 2). Then the
    spare's own host is lost at step 6: no spare is left, the world shrinks to (2, 2), and
    the state comes from the replica the spare made at its ring buddy. Exact at the end."""
    report = _run(tmp_path, [ProcessFault("host", 0, 3), ProcessFault("host", 3, 6)],
                  spares=1, extra=("--restore", "--no-held-replicas"))
    assert report["rc"] == 0, report
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided] == [[3, 1, 2], [1, 2]], decided
    assert decided[0]["replaces"] == {"3": 0} and decided[1]["replaces"] == {}
    assert [(e["worker_id"], e["replaces"]) for e in _launcher_events(report, "joined")] \
        == [(3, 0)]
    stats = _assert_exact(tmp_path, reference)  # written by worker 1, a survivor throughout
    first, second = stats["recoveries"]
    assert first["new_mesh_shape"] == first["old_mesh_shape"] == {"data": 3, "model": 2}
    assert first["joined_processes"] == [3] and first["failed_processes"] == [0]
    assert second["failed_processes"] == [3]
    assert second["new_mesh_shape"] == {"data": 2, "model": 2}
    # (the spare's state came from its ring buddy, agent 1: its own agent died with it)
    assert set(second["fetched_from"]) == {"3"}, second
    assert second["fetched_from"]["3"] == report["agents"][1], (second, report["agents"])
    said = caplog.text  # the launcher names each dead worker and the spare that joined
    assert "worker 0 ended by signal 9; the others recover" in said
    assert "spare 3 joined world 1 at worker 0's rank, from step" in said
    assert "worker 3 ended by signal 9; the others recover" in said


@pytest.mark.slow  # ~35 s
def test_a_spare_frozen_as_it_is_taken_in_is_declared_dead_and_the_world_forms_without_it(
        tmp_path, reference, caplog):
    """The spare freezes (SIGSTOP) as worker 1 dies, still offered to the next world, which
    takes it in. It never says it has its agreement: after `JOIN_ACK_S` the launcher
    declares it dead and the survivors form a world without it (a trial's stalled ~1.5 x
    the agreement timeout, 97 s by default). Exact at the end."""
    report = _run(tmp_path, [ProcessFault("freeze_spares", 1, 3), ProcessFault("kill", 1, 3)],
                  spares=1, extra=("--restore",))
    assert report["rc"] == 0, report
    [frozen] = [f for f in report["fired"] if f["kind"] == "freeze_spares"]
    assert frozen["frozen"] == 1
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided] == [[0, 3, 2], [0, 2]], decided
    assert [(e["worker_id"], e["why"]) for e in _launcher_events(report, "evicted")] \
        == [(3, "joined, then silent")]
    assert "spare 3, taken into world 1, did not say it has its agreement" in caplog.text
    _assert_exact(tmp_path, reference)


@pytest.mark.slow  # ~25 s
def test_a_spare_joining_a_loop_that_skips_restore_leaves_and_no_other_spare_joins(
        tmp_path, reference):
    """The job's loop starts at step 0 whatever `step.restore()` would say (no
    ``--restore``), under `--spares 2`: the spare that takes worker 0's place leaves the job
    at its first call (it would run the loop from the wrong step), the launcher takes no
    other spare, and the survivors go on without it and end exact (the first spare's
    error ended the job before)."""
    report = _run(tmp_path, [ProcessFault("kill", 0, 3)], spares=2)
    assert report["rc"] == 0, report
    assert [e["worker_id"] for e in _launcher_events(report, "leave")] == [3]
    [refused] = _launcher_events(report, "spares_refused")
    assert "step.restore" in refused["why"]
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided] == [[3, 1, 2], [1, 2]], decided
    _assert_exact(tmp_path, reference)


def test_a_crashed_worker_restarted_as_a_spare_grows_the_job_back_to_its_first_mesh(
        tmp_path, reference):
    """`mnemojax launch --max-restarts 1` (one machine): worker 0 of 3 (it owns every
    snapshot shard) is killed at step 2; the survivors go on at (2, 2) while the launcher
    starts a fresh process (worker 3, a warm spare, 3 s slower to get ready than usual).
    Once it is warm, the world re-forms at its first size: the survivors keep their first
    ranks, the spare takes rank 0, and the mesh is (3, 2) again. Exact at the end."""
    report = _run(tmp_path, [ProcessFault("kill", 0, 2)], max_restarts=1,
                  extra=("--restore", "--step-sleep-s", "1.5"),
                  extra_env={"MP_JOB_SPARE_DELAY_S": "3"})
    assert report["rc"] == 0, report
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided] == [[1, 2], [3, 1, 2]], decided
    assert decided[1]["replaces"] == {"3": 0}
    [restart] = _launcher_events(report, "restarting")
    assert (restart["worker_id"], restart["restarts"]) == (3, 0)
    assert [e["generation"] for e in _launcher_events(report, "regrow")] == [1]
    # Worker 0's agent, whose copies the new worlds outdated, ended before the job did.
    assert [e["workers"] for e in _launcher_events(report, "agents_retired")] == [[0]]
    assert [e["worker_id"] for e in _launcher_events(report, "agent_ended")] == [0]
    _assert_exact(tmp_path, reference)  # (written by the spare, now process 0)
    with open(tmp_path / "mnemojax-events-w1.jsonl") as f:  # a survivor throughout
        shrink, grow = [e for e in map(json.loads, f) if e.get("kind") == "recovery"]
    assert shrink["new_mesh"] == {"data": 2, "model": 2}
    assert grow["new_mesh"] == {"data": 3, "model": 2} and grow["joined_processes"] == [3]


@pytest.mark.slow  # ~30 s; the default test above restarts a crashed worker
def test_a_lost_host_restarted_as_a_spare_grows_the_job_back(tmp_path, reference):
    """As above, but worker 0's whole host is lost (its agent with it): the fresh agent
    was started from the lost agent's link thread, which ends with it, and its PDEATHSIG
    killed it at once (the job stayed smaller); agents now start from a thread that lives
    as long as the launcher (`spawner.popen`)."""
    report = _run(tmp_path, [ProcessFault("host", 0, 2)], max_restarts=1,
                  extra=("--restore", "--step-sleep-s", "1.5"),
                  extra_env={"MP_JOB_SPARE_DELAY_S": "3"})  # (ready after the agreement)
    assert report["rc"] == 0, report
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided] == [[1, 2], [3, 1, 2]], decided
    assert not _launcher_events(report, "spare_lost")
    _assert_exact(tmp_path, reference)


@pytest.mark.slow  # ~25 s; the default host-loss test above covers the overlapped copy
def test_a_lost_host_with_replication_in_series_resumes_exact_from_its_buddy(
        tmp_path, reference):
    """`SnapshotOptions.replicate_in_series`: every step returns once the buddy holds its
    snapshot. Host 0 is lost (worker and agent) at step 4: its state comes from its ring
    buddy's copy, the new world's publishes go on in series (their first waits before its
    copy again), and the run ends exact with no step lost beyond the one being run."""
    report = _run(tmp_path, [ProcessFault("host", 0, 4)],
                  extra=("--no-held-replicas", "--in-series"))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["failed_processes"] == [0]
    assert rec["fetched_from"] == {"0": report["agents"][1]}  # 0's ring buddy
    assert rec["steps_lost"] <= 1


@pytest.mark.slow  # ~40 s; hangs in one process: fault_matrix_test, distributed/watchdog_test
def test_hung_worker_is_treated_as_failed(tmp_path, reference, caplog):
    """Worker 1 is SIGSTOPped after step 4: its agent's watchdog kills it at the hang limit
    (the launcher says so), and the others go on without it, exact."""
    report = _run(tmp_path, [ProcessFault("hang", 1, 4)])
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["failed_processes"] == [1]
    assert [e["worker_id"] for e in _launcher_events(report, "hang")] == [1]
    assert "worker 1 hung" in caplog.text and "its agent killed it" in caplog.text
    assert rec["waited_s"] >= 3.0  # the others' step waited out the hang limit (3 s here)


def test_corrupt_copy_is_never_restored(tmp_path, reference):
    """A bit flips in every snapshot worker 0's agent holds, then worker 0 dies: its agent
    reports the copies corrupt (CRC32) and the state comes from the buddy, exact (held
    replicas off, as for the lost host above)."""
    report = _run(tmp_path, [ProcessFault("corrupt", 0, 4)], extra=("--no-held-replicas",))
    rec = _one_recovery(tmp_path, reference, report)
    [fired] = report["fired"]
    assert fired["corrupted_steps"], fired
    corrupt = {(e["origin"], e["step"]) for e in _launcher_events(report, "corrupt_copy")}
    assert {(0, s) for s in fired["corrupted_steps"]} <= corrupt
    assert rec["source_step"] in fired["corrupted_steps"]  # the newest step, not an older one
    assert rec["fetched_from"] == {"0": report["agents"][1]}


@pytest.mark.slow  # ~40 s; second rounds are unit-tested in tests/distributed/recovery_test.py
def test_survivor_dying_after_the_decision_means_a_second_round(tmp_path, reference):
    """Worker 1 dies; worker 2 dies as soon as the launcher has decided a world with it.
    That world never forms: the others give up connecting to it once the launcher tells
    them of the death (not at the connect timeout) and agree again without it (round 2),
    then end exact on a (2, 2) mesh."""
    report = _run(tmp_path, [ProcessFault("kill", 1, 4),
                             ProcessFault("kill_after_decision", 2)],
                  nproc=4, agree_timeout_s=20)
    rec = _one_recovery(tmp_path, reference, report, nproc=4)
    assert rec["failed_processes"] == [1, 2] and rec["agreement_rounds"] == 2
    again = [e["reason"] for e in _launcher_events(report, "report_failure")
             if e["generation"] == 1]
    assert sorted(e["worker_id"] for e in _launcher_events(report, "report_failure")
                  if e["generation"] == 1) == [0, 3], again
    assert all("workers [2] died before it formed (told by the launcher)" in r
               for r in again), again
    assert rec["new_mesh_shape"] == {"data": 2, "model": 2}
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided] == [[0, 2, 3], [0, 3]]


@pytest.mark.slow  # ~45 s; the plans are unit-tested in topology_test.py
def test_a_second_death_right_after_the_decision_finds_its_world_compiled_ahead(
        tmp_path, reference):
    """`CompileOptions(ahead_losses=2)`: world 0 compiles ahead the world one loss forms
    and the one a second loss forms. Worker 1 dies after step 15, worker 2 right after the
    decision: the world of the two left loads its step from the persistent cache (no
    compile on the recovery path), exact."""
    report = _run(tmp_path, [ProcessFault("kill", 1, 15),
                             ProcessFault("kill_after_decision", 2)], nproc=4,
                  extra=("--steps", "25", "--precompile-cache", str(tmp_path / "xla"),
                         "--ahead-losses", "2", "--step-sleep-s", "0.2"))
    assert report["rc"] == 0, report
    [rec] = h.assert_job_exact(tmp_path, h.reference_run(h.make_batches(25)), 25)["recoveries"]
    assert rec["failed_processes"] == [1, 2] and rec["executable"] == "cached"
    assert rec["new_mesh_shape"] == {"data": 2, "model": 2}


def _no_replica_double_loss(tmp_path, extra=(), **kw) -> dict:
    """Hosts 0 and 1 die together on a (1, 8) mesh over 4 processes: no device holds a
    replica, so worker 0's shards were only on its agent and on its buddy, agent 1 (worker
    1's survive on agent 2). The survivors' mesh is (1, 4)."""
    return _run(tmp_path, [ProcessFault("host", 0, 4), ProcessFault("host", 1, 4)], nproc=4,
                extra=("--model-axis", "8", *extra), **kw)


@pytest.mark.slow  # ~25 s; unit-tested in tests/distributed/recovery_test.py
def test_every_copy_lost_without_a_checkpoint_is_a_typed_error(tmp_path):
    """Worker 0's shards are lost with hosts 0 and 1 (`_no_replica_double_loss`): every
    survivor raises StateUnavailableError naming worker 0 (exit 4)."""
    report = _no_replica_double_loss(tmp_path)
    assert report["rc"] == 4, report
    # One decision, or two when worker 1 reached the agreement before its host died.
    decided = _launcher_events(report, "decided")[-1]
    assert decided["resume_step"] == -1 and decided["lost"] == [0]
    for w in (2, 3):
        text = (tmp_path / f"error-w{w}.txt").read_text()
        assert text.startswith("StateUnavailableError") and "workers [0]" in text


@pytest.mark.slow  # ~40 s; the fallback is also tested in one process (persistent_test)
def test_every_copy_lost_falls_back_to_the_checkpoint(tmp_path, reference):
    """The same double loss with an Orbax checkpoint every 2 steps: the survivors restore
    the newest checkpoint onto their (1, 4) mesh, replay the kept batches, end exact."""
    # Both hosts must be gone when the survivors agree. The peer watch tells them of the
    # first death within milliseconds, which can split the double loss into two recoveries
    # (each exact, the second maybe from a re-formed buddy), so it is off here: the failed
    # collective is slower than the second kill.
    report = _no_replica_double_loss(
        tmp_path, ("--ckpt", str(tmp_path / "ckpt"), "--ckpt-every", "2"),
        extra_env={"MNEMOJAX_PEER_WATCH": "0"})
    assert report["rc"] == 0, report
    [rec] = _assert_exact(tmp_path, reference)["recoveries"]
    assert rec["source"] == "persistent" and rec["failed_processes"] == [0, 1]
    assert rec["source_step"] in (2, 4) and rec["new_mesh_shape"] == {"data": 1, "model": 4}


def test_a_peer_killed_while_checkpoints_commit_loses_that_checkpoint_only(tmp_path,
                                                                          reference):
    """An Orbax checkpoint after every step; worker 0 is killed after step 4, while its
    checkpoint commits. The survivors' commit barrier waited for it (Orbax's 20 min), their
    next save waited for that one, and exit waited for Orbax's threads: the job hung (a
    user trial, 4 runs in 4). Now the barrier gives up once the death is heard of, the lost
    checkpoint is logged, not raised, and the job goes on: exact, the last step
    checkpointed, whole."""
    import orbax.checkpoint as ocp

    ckpt = tmp_path / "ckpt"
    report = _run(tmp_path, [ProcessFault("kill", 0, 4)],
                  extra=("--ckpt", str(ckpt), "--ckpt-every", "1", "--step-sleep-s", "0.1"))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["failed_processes"] == [0] and rec["source"] == "agent_snapshots"
    with ocp.CheckpointManager(ckpt, item_names=("state", "mnemojax")) as mngr:
        assert mngr.latest_step() == STEPS
        # Saved over other devices: restored onto one, by the leaves its JSON item lists
        # (in the state's order).
        leaves = mngr.restore(STEPS, args=ocp.args.Composite(
            mnemojax=ocp.args.JsonRestore()))["mnemojax"]["leaves"]
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target: dict = {}
        for leaf in leaves:
            *parents, name = leaf["path"].split("/")
            node = target
            for p in parents:
                node = node.setdefault(p, {})
            node[name] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(leaf["dtype"]),
                                              sharding=one)
        saved = mngr.restore(STEPS, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))["state"]
    assert len(leaves) == len(reference.state)
    for leaf, want in zip(leaves, reference.state, strict=True):
        got = saved
        for p in leaf["path"].split("/"):
            got = got[p]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_a_peer_dead_in_the_last_commit_leaves_no_barrier_to_wait_for_at_exit(
        tmp_path, reference, capfd):
    """The job's own Orbax checkpoints (the README's recipe, every 3 steps): worker 1 dies
    (SIGKILL) on its commit thread at the first barrier of the last save (step 9), once
    every process has gathered the final state, so the others' commits wait for it and no
    new world follows. Their barrier gives up on the death and leaves no thread blocked in
    jaxlib: the lost checkpoint is raised from ``wait_until_finished`` (caught, as the
    README says), and both exit at once with status 0, exact. (JAX's ``wait_at_barrier``
    cannot be cancelled: each survivor waited 20 s at exit for the thread left in it, which
    could abort the process as it returned into the finalising interpreter.)"""
    report = _run(tmp_path, [], extra=("--user-ckpt", str(tmp_path / "user-ckpt"),
                                       "--die-in-save", "1", "--die-in-save-at", "9",
                                       "--die-in-commit"))
    assert report["rc"] == 0, report
    assert _assert_exact(tmp_path, reference)["recoveries"] == []
    exits = {e["worker_id"]: e["code"] for e in _launcher_events(report, "worker_exit")}
    assert exits == {0: 0, 1: -9, 2: 0}, exits
    printed = capfd.readouterr()
    printed = printed.out + printed.err
    for w in (0, 2):
        assert f"w{w}: the last checkpoint was lost: barrier" in printed, w
    for left in ("abandoned earlier", "waiting at exit"):
        assert left not in printed, left


@pytest.mark.parametrize("then_eval", [False, True])
def test_a_guarded_save_met_by_a_death_that_a_peer_met_in_the_next_step_is_skipped(
        tmp_path, reference, capfd, then_eval):
    """The job's own Orbax checkpoints (the README's recipe, every 3 steps): worker 0
    spends 1 s in its own code before its guarded save after step 4 (a step Orbax does not
    keep: no collective), worker 1 is killed after step 4, worker 2 meets the death in step
    5. Worker 0 meets it in the guarded save; run again there alone, the save would make
    the new world's manager, whose first collective waits for worker 2, which replays step
    5 (a user trial's job ran out of recoveries). It is skipped (GuardSkippedError, caught
    by the job) and both go on together: exact, and the job's last checkpoint (step 9)
    restores to the failure-free state. ``then_eval``: a guarded eval (a collective) after
    each save, where worker 2 meets the death instead: it is past the save too (the 2nd
    guarded call after step 4), runs its eval again, and worker 0 runs its own after the
    skipped save: every eval exact."""
    import orbax.checkpoint as ocp

    ckpt = tmp_path / "user-ckpt"
    report = _run(tmp_path, [ProcessFault("kill", 1, 4)],
                  extra=("--user-ckpt", str(ckpt), "--late-saver", "0", "--late-save-at", "4",
                         *(("--guarded-eval",) if then_eval else ())))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["guarded"] and rec["failed_processes"] == [1]
    if then_eval:
        _assert_evals_exact(tmp_path)
    printed = capfd.readouterr()
    printed = printed.out + printed.err
    assert "w0: the save after step 4 skipped: guarded work after step 4 met a failure" in \
        printed and "workers [2] met it past the work (in step 5, or in guarded work after it)" in \
        printed
    assert "w2: the save after step 4 skipped" not in printed
    want = h.reference_run(h.make_batches(9)).state
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                          nnx.state(h.make_mlp()))
    with ocp.CheckpointManager(ckpt) as mngr:
        assert mngr.latest_step() == 9
        saved = jax.tree.leaves(mngr.restore(9, args=ocp.args.StandardRestore(target)))
    for got, w in zip(saved, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("late", [False, True])
def test_the_users_own_orbax_checkpoints_made_as_the_readme_says_survive_a_kill(
        tmp_path, reference, late):
    """The job keeps its own Orbax `CheckpointManager` (async, every 3 steps) beside the
    resilient step, as the README's recipe says: made again when ``step.mesh`` changes
    (Orbax keeps the world's client), saved through ``step.guard`` (a save starts with a
    collective across the processes), with ``mnemojax.checkpoint_barrier()``. Worker 1 is
    killed after step 3, around that step's save. The job ends exact, and its own last
    checkpoint (step 9) restores to the failure-free state after 9 steps. (A user trial:
    the Flax guide's manager, unchanged, failed its next save after any recovery.)
    ``late``: worker 1 SIGKILLs itself in that save, past its collective, as it comes to its
    first barrier (Orbax's, on the main thread), so the others meet the death there: the
    `CheckpointLostError` it raises is a peer failure to the guard, which recovers and
    saves again in the new world (it was raised to the job, which ended; seen once in six
    runs of the outside kill)."""
    import orbax.checkpoint as ocp

    ckpt = tmp_path / "user-ckpt"
    report = _run(tmp_path, [] if late else [ProcessFault("kill", 1, 3)],
                  extra=("--user-ckpt", str(ckpt),
                         *(("--die-in-save", "1", "--die-in-save-at", "3") if late else ())))
    rec = _one_recovery(tmp_path, reference, report)
    assert rec["failed_processes"] == [1]
    want = h.reference_run(h.make_batches(9)).state
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # (saved over 2 others)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                          nnx.state(h.make_mlp()))  # as the Flax guide restores
    with ocp.CheckpointManager(ckpt) as mngr:
        assert mngr.latest_step() == 9
        saved = jax.tree.leaves(mngr.restore(9, args=ocp.args.StandardRestore(target)))
    assert len(saved) == len(want)
    for got, w in zip(saved, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-5, atol=1e-6)


def test_a_death_just_before_a_guarded_save_ends_the_others_barrier_at_once(tmp_path,
                                                                              reference):
    """4 processes; worker 1 SIGKILLs itself as its guarded own save after step 3 starts:
    the others wait for it in the save's first barrier (Orbax's ``sync_global_devices``, a
    collective over every device, which a survivor not connected to the dead one left only
    at gloo's timeout: 20 s in a user trial, 10 s here). In guarded work that barrier
    waits in the coordination service's store, which a death heard of ends at once
    (`CheckpointLostError`, the recovery's cause): the others recover, save again in the
    new world, and end exact."""
    report = _run(tmp_path, [], nproc=4,
                  extra=("--user-ckpt", str(tmp_path / "user-ckpt"),
                         "--die-before-save", "1", "--die-before-save-at", "3"))
    rec = _one_recovery(tmp_path, reference, report, nproc=4)
    assert rec["failed_processes"] == [1] and rec["guarded"], rec
    assert "CheckpointLostError" in rec["cause"] and "barrier sync/" in rec["cause"], rec


def test_a_stop_signal_during_a_recovery_still_checkpoints_an_agreed_step(tmp_path):
    """Worker 1 is killed after step 3; as the first survivor comes to the agreement, the
    launcher gets SIGTERM (a preemption notice, forwarded to the workers). The recovery
    completes, the survivors agree in the new world on a step to stop after, checkpoint
    it together and exit; the launcher exits 143. (A user trial across nodes: the
    agreement was refused once the signal came, every survivor raised, nothing was
    checkpointed though the agents held the state.)"""
    ckpt = tmp_path / "ckpt"
    report = _run(tmp_path, [ProcessFault("kill", 1, 3),
                             ProcessFault("stop_in_agreement", 0, 0)],
                  extra=("--ckpt", str(ckpt)))
    assert report["rc"] == 128 + signal.SIGTERM, report
    assert _launcher_events(report, "decided"), "no world was decided"
    saved = h.assert_only_checkpoint_is_the_reference(ckpt, (4, 2))
    assert 3 <= saved < STEPS


def test_a_nan_batch_and_a_transient_error_in_place_then_a_host_lost_with_its_buddy(
        tmp_path, reference):
    """One job of 4 processes on a (4, 2) mesh, four faults.

    * The finiteness verdict is global: every process skips the poisoned batch of step 3.
    * Worker 0's launch of step 4 fails once with UNAVAILABLE: it retries at once, its
      peers wait in the collective, and no world recovery happens.
    * Hosts 0 and 1 then die together (workers and agents) after step 6. Worker 0 (data
      row 0) owned every snapshot shard, and its copies were on its own agent and its ring
      buddy's, agent 1. At the failure workers 2 and 3 hand their agents the replicas
      their devices hold (held copies, `agreement.held_origin`: worker w's as -1 - w): the
      survivors restore worker 0's shards from them on a (2, 2) mesh and end exact,
      instead of going to a checkpoint (`_no_replica_double_loss` has no replica left).
    """
    report = _run(tmp_path, [ProcessFault("host", 0, 6), ProcessFault("host", 1, 6)],
                  nproc=4, extra=("--nan-at-step", "3", "--transient-worker", "0",
                                  "--transient-at-step", "4"))
    assert report["rc"] == 0, report
    stats = _assert_exact(tmp_path, reference)
    # The final world's process 0 writes the stats: worker 2, which retried nothing.
    assert stats["skipped_batches"] == [3] and stats["transient_retries"] == 0
    recs = stats["recoveries"]
    # One recovery, or two when worker 1 reached the agreement before its host died.
    assert sorted(p for r in recs for p in r["failed_processes"]) == [0, 1]
    assert all(r["source"] == "agent_snapshots" and r["step"] > 6 for r in recs)
    assert recs[-1]["new_mesh_shape"] == {"data": 2, "model": 2}
    held_by = {"-3": report["agents"][2], "-4": report["agents"][3]}
    assert recs[-1]["fetched_from"], recs[-1]
    # Every copy from the survivors' agents; with one recovery, their held copies (with
    # two, world 1's worker 1 owned the shards, and its buddy's replica of them serves).
    assert set(recs[-1]["fetched_from"].values()) <= set(held_by.values()), recs
    if len(recs) == 1:
        assert set(recs[-1]["fetched_from"].items()) <= set(held_by.items())
    with open(tmp_path / "mnemojax-events-w0.jsonl") as f:  # worker 0's own log
        assert [e["step"] for e in map(json.loads, f)
                if e.get("classification") == "transient"] == [4]


def test_no_whole_replica_left_shrinks_the_model_axis_and_an_idle_survivor_leaves(
        tmp_path, reference):
    """4 processes x 2 devices on a (1, 8) mesh: the one model replica spans every
    process. Worker 3 is killed: no whole replica survives, so the model axis shrinks to
    4 (the widest width dividing its sharded dims that 6 devices hold), over workers 0
    and 1. Worker 2 would hold no device: it leaves the job (status 0), the others agree
    again without it, restore the 8-way shards onto 4 devices and end exact."""
    report = _run(tmp_path, [ProcessFault("kill", 3, 4)], nproc=4,
                  extra=("--model-axis", "8"))
    assert report["rc"] == 0, report
    stats = _assert_exact(tmp_path, reference)
    [rec] = stats["recoveries"]
    assert rec["old_mesh_shape"] == {"data": 1, "model": 8} and not rec["math_changed"]
    assert rec["new_mesh_shape"] == {"data": 1, "model": 4}
    assert rec["failed_processes"] == [3] and rec["left_processes"] == [2]
    assert rec["agreement_rounds"] == 2
    assert [e["worker_id"] for e in _launcher_events(report, "leave")] == [2]
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided] == [[0, 1, 2], [0, 1]]


@pytest.mark.slow  # ~12 s; the planning around is tested in one process by default
def test_a_mesh_no_process_can_compile_for_is_planned_around_together(tmp_path, reference):
    """4 processes x 2 devices on (4, 2); worker 3 is killed. The step's trace fails on
    (3, 2) in every survivor: they see that every process failed, plan around it, (2, 2),
    which leaves one survivor idle (it leaves the job), and end exact (a user trial's job
    ended with a StepCompileError where (2, 2) worked)."""
    report = _run(tmp_path, [ProcessFault("kill", 3, 4)], nproc=4,
                  extra=("--untraceable-mesh", "3x2"))
    assert report["rc"] == 0, report
    stats = _assert_exact(tmp_path, reference)
    [rec] = stats["recoveries"]
    assert rec["new_mesh_shape"] == {"data": 2, "model": 2}, rec
    assert rec["failed_processes"] == [3] and len(rec["left_processes"]) == 1, rec


@pytest.mark.slow  # ~35 s
def test_a_recovery_across_processes_tries_at_most_three_meshes_the_step_cannot_compile_for(
        tmp_path, capfd):
    """As above, but the step's trace fails on every mesh the survivors plan: they try
    three together ((3, 2), then (2, 2), which one of them leaves, then (4, 1), the model
    axis narrowed), then end with the first mesh's error naming the other two
    (they went on re-planning, an agreement round each, until no mesh was left)."""
    report = _run(tmp_path, [ProcessFault("kill", 3, 4)], nproc=4,
                  extra=("--untraceable-mesh", "3x2,2x2,4x1,1x2"))
    assert report["rc"] != 0, report
    printed = capfd.readouterr()
    said = [line for line in (printed.out + printed.err).splitlines()
            if "StepCompileError" in line and "nor for meshes" in line]
    assert said and "{'data': 3, 'model': 2}" in said[0], said
    assert "nor for meshes [{'data': 2, 'model': 2}, {'data': 4, 'model': 1}]" in said[0], said


@pytest.mark.slow  # ~35 s; the default test above leaves a survivor idle too
def test_a_survivor_the_new_mesh_leaves_idle_leaves_the_job_and_the_rest_end_exact(
        tmp_path, reference):
    """4 processes x 2 devices on a (2, 4) mesh: a model replica spans two processes.
    Worker 3 is killed; of its three survivors one replica's worth (two processes) can
    run the step, and the third would hold no device. (Shrinking the model axis instead
    would keep (2, 2), as many devices: the tie goes to the batch axis.) It leaves the job
    (status 0); the other two agree again without it and end exact on a (1, 4) mesh."""
    report = _run(tmp_path, [ProcessFault("kill", 3, 4)], nproc=4,
                  extra=("--model-axis", "4"))
    assert report["rc"] == 0, report
    stats = _assert_exact(tmp_path, reference)
    [rec] = stats["recoveries"]
    assert rec["failed_processes"] == [3] and rec["left_processes"] == [2]
    assert rec["agreement_rounds"] == 2
    assert rec["new_mesh_shape"] == {"data": 1, "model": 4}
    assert [e["worker_id"] for e in _launcher_events(report, "leave")] == [2]
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided] == [[0, 1, 2], [0, 1]]
    # Its exit may come after the others end the job (it first waits out the collectives
    # it abandoned): then the launcher ends it. An exit it did report is a clean one.
    assert [e["code"] for e in _launcher_events(report, "worker_exit")
            if e["worker_id"] == 2] in ([0], [])
    with open(tmp_path / "mnemojax-events-w2.jsonl") as f:
        left = [e for e in map(json.loads, f) if e.get("classification") == "left_job"]
    assert len(left) == 1 and "no device" in left[0]["detail"]


@pytest.mark.slow  # ~45 s; the default test above grows a job back after a crash
def test_an_idle_survivor_and_a_crashed_worker_restarted_as_spares_restore_the_first_mesh(
        tmp_path):
    """As above ((2, 4), worker 3 killed, worker 2 left idle by the (1, 4) mesh of the
    survivors), under `--max-restarts 2`: the crashed worker and the one that left the
    job are each started again as a spare (workers 4 and 5; 3 s slower to get ready than
    usual, so that the first agreement does not find 4 ready). Once both are warm the world
    re-forms at its first size with workers 0 and 1 at their first ranks, and the mesh is
    (2, 4) again: a second loss would find a whole replica. Exact at the end."""
    steps = 16
    cmd = [sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", str(tmp_path),
           "--steps", str(steps), "--model-axis", "4", "--restore", "--step-sleep-s", "1.5"]
    report = h.check_job_report(run_scenario(
        cmd, nproc=4, devices_per_proc=2, faults=[ProcessFault("kill", 3, 2)],
        job_timeout_s=240, max_restarts=2, extra_env={"MP_JOB_SPARE_DELAY_S": "3"}))
    assert report["rc"] == 0, report
    restarts = {e["restarts"]: e["worker_id"] for e in _launcher_events(report, "restarting")}
    assert restarts.keys() == {2, 3}, restarts
    decided = _launcher_events(report, "decided")
    assert [d["survivors"] for d in decided][:2] == [[0, 1, 2], [0, 1]], decided
    assert decided[-1]["survivors"] == [0, 1, *sorted(restarts.values())], decided
    h.assert_job_exact(tmp_path, h.reference_run(h.make_batches(steps)), steps)
    with open(tmp_path / "mnemojax-events-w0.jsonl") as f:  # a survivor throughout
        meshes = [e["new_mesh"] for e in map(json.loads, f) if e.get("kind") == "recovery"]
    assert meshes[-1] == {"data": 2, "model": 4}, meshes


@pytest.mark.slow  # ~35 s
def test_too_few_survivors_end_in_typed_error_with_a_checkpoint(tmp_path):
    """4 processes x 2 devices on a (1, 8) mesh with ``min_devices=8``: after a kill 6
    devices remain. The job ends with MeshTooSmallError (exit 3), and the agreed step is
    in the persistent tier, equal to the failure-free run after that many steps."""
    import orbax.checkpoint as ocp

    report = _run(tmp_path, [ProcessFault("kill", 3, 4)], nproc=4,
                  extra=("--model-axis", "8", "--min-devices", "8",
                         "--ckpt", str(tmp_path / "ckpt")))
    assert report["rc"] == 3, report
    error = (tmp_path / "error-w0.txt").read_text()
    assert error.startswith("MeshTooSmallError") and re.search("min_devices=8", error), error
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("state", "mnemojax"))
    saved = mngr.latest_step()
    assert saved is not None and 4 <= saved < STEPS
    state = mngr.restore(saved, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]
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
