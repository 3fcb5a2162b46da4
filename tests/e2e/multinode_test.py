"""A job over two simulated nodes: two `mnemojax launch --rdzv etcd://...` launchers (2
workers x 1 CPU device each) meeting in a real 3-member etcd cluster on loopback.

The whole of one node (its launcher, agents and workers) is SIGKILLed mid-run, and one etcd
member with it: the other node's workers agree through etcd on a world of their own and
end allclose to the failure-free plain Flax run. The buddy ring spans the nodes, so worker
0's copies (it owns every shard of the data-parallel MLP) survive on the other node.

Either node may be the one killed. The other node's workers re-initialise in place when
the dead node did not run the coordination service; when it did, they die with it (jaxlib
0.10 aborts every client of a dead service), and their launcher restarts them into the
next world, whose state they take from their agents' copies (`step.restore()`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest

from mnemojax._src.distributed.launcher.status import summary
from tests import helpers as h
from tests.etcd_cluster import CutOff, etcd_cluster
from tests.jobs import two_nodes

pytestmark = pytest.mark.multiprocess

STEPS = 10


@pytest.fixture(scope="module")
def reference():
    return h.reference_run(h.make_batches(STEPS))


@contextlib.contextmanager
def _logs_on_failure(out: str):
    """A failed assertion or wait carries the tail of both launchers' logs (a failure in
    CI must say what the nodes saw)."""
    try:
        yield
    except (AssertionError, TimeoutError, subprocess.TimeoutExpired) as e:
        tails = []
        for name in ("0", "1", "0-again", "1-again"):
            with contextlib.suppress(OSError), open(f"{out}/launcher-{name}.log") as f:
                tails.append(f"--- launcher {name} ---\n" + "".join(f.readlines()[-40:]))
        raise AssertionError(f"{e}\n" + "\n".join(tails)) from e


def _launcher_lines(out: str, rank: int, text: str) -> list[str]:
    with open(f"{out}/launcher-{rank}.log") as f:
        return [line for line in f if text in line]


@pytest.mark.parametrize("victim_runs", [
    pytest.param("worker_nodes", marks=pytest.mark.slow),  # in place: as on one machine
    "coordination_service"])
def test_losing_a_whole_node_and_an_etcd_member_recovers_exact(tmp_path, reference,
                                                                 victim_runs, monkeypatch):
    """The node running the coordination service is lost with 2 spares on each node: the
    other node restarts its workers (aborted with the service) and its 2 spares take the
    lost node's ranks, all fresh processes. The other node lost: its survivors recover in
    place (no spares).

    The job feeds per-host batches from a Grain dataset (`mnemojax.data.HostBatches`):
    each process reads only the rows of its devices, the fresh processes from the step
    they restored, the in-place survivors the lost node's rows as well.

    The default suite's case (coordination service) runs over TLS: etcd refuses clients
    without a certificate from the job's CA, and the launchers reach it as ``etcds://``."""
    out, n = str(tmp_path), two_nodes.NPROC
    spares = n if victim_runs == "coordination_service" else 0
    tls = victim_runs == "coordination_service"
    with _logs_on_failure(out):
        with etcd_cluster(3, tls=tls) as cluster:
            if cluster.tls is not None:  # the launchers inherit this environment
                for var, path in cluster.tls.env().items():
                    monkeypatch.setenv(var, path)
                assert cluster.url.startswith("etcds://")
            o = two_nodes.run(cluster.url, lambda: cluster.kill(0), out, victim_runs,
                              steps=STEPS, spares=spares, job_args=("--host-data",))
        _check_node_loss(o, out, reference, victim_runs, spares)


def _check_node_loss(o, out, reference, victim_runs, spares):
    n = two_nodes.NPROC
    survivor = 1 - o.victim
    kept = [w for w in range(2 * n) if w // n == survivor]
    assert o.rc == 0
    assert o.final["generation"] == 1
    assert o.final["host_node"] == survivor
    assert o.final["coordinator"].startswith(two_nodes.host(survivor) + ":")
    stats = h.assert_job_exact(out, reference, STEPS)
    restarted = _launcher_lines(out, survivor, "restarted into world 1, from step")
    if victim_runs == "coordination_service":  # fresh processes: no recovery record
        node_spares = [2 * n + survivor * spares + i for i in range(spares)]
        ranks = dict(zip(range(o.victim * n, o.victim * n + n), node_spares, strict=True))
        assert o.final["members"] == [ranks.get(w, w) for w in range(2 * n)]
        assert len(restarted) == n and stats["recoveries"] == []
        # ... but it says how it came into the job (a user trial counted 0 recoveries)
        first = o.final["members"][0]
        assert stats["joined"]["how"] == ("spare" if first in node_spares else "restart")
        assert stats["joined"]["generation"] == 1
        assert stats["joined"]["members"] == o.final["members"]
        assert len(_launcher_lines(out, survivor, "joined world 1 at worker")) == spares
        # Every process of world 1 said where it goes on (the fresh ones too): none waited
        # for the others' word in restore() (a review: 60 s each, for posts never made).
        assert not _launcher_lines(out, survivor, "where its survivors go on is not known")
    else:  # re-initialised in place, the world shrunk to the survivors
        assert o.final["members"] == kept
        assert restarted == []
        [rec] = stats["recoveries"]
        assert rec["plan_kind"] == "process_loss" and stats["joined"] is None
    _check_rows_read(out, o.final["members"], width=len(o.final["members"]), steps=STEPS)
    # `mnemojax status`: where the job got to, and where world 1 resumed (trial 26: not shown)
    assert o.final["step"] == STEPS, o.final["steps"]
    assert o.final["resumed_from"][0] is None and 0 <= o.final["resumed_from"][1] < STEPS
    assert o.survivor_shm == [], "the surviving launcher left shared memory behind"
    assert two_nodes.leftover_pids(o.nodes) == [], "a process outlived the job"


def _check_rows_read(out: str, members: list[int], *, width: int, steps: int) -> None:
    """Every process of the final world read only its own rows: a 1/width share of the
    last global batch, never a whole one."""
    for w in members:
        with open(f"{out}/rows-w{w}.json") as f:
            rows = {int(k): n for k, n in json.load(f).items()}
        assert rows[steps] == h.BATCH // width, (w, rows)
        assert max(rows.values()) < h.BATCH, (w, rows)


@pytest.mark.slow  # ~55 s: the default suite is at its budget
def test_a_lost_node_restarted_with_grow_back_makes_the_job_whole_again(tmp_path):
    """Node 1 is killed whole: node 0's workers go on in place on half the mesh (world 1
    = [0, 1], mesh 2 x 1). Node 1's launcher is started again with ``--grow-back``: its
    two processes wait as spares with fresh ids (4, 5), the launchers ask world 1 to
    re-form, and world 2 = [0, 1, 4, 5] is world 0's layout again (mesh 4 x 1): the
    survivors keep their ranks, the spares take ranks 2 and 3 with the agreed state.
    Per-host batches throughout; exact at the end, every process ended. The run's
    recovery budget is one recovery: the regrow is not charged to it."""
    steps, out = 24, str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(3) as cluster:
            codes, final, left, worlds = two_nodes.run_grow_back(
                cluster.url, out, steps=steps,
                job_args=("--host-data", "--run-recoveries", "1"))
        assert codes == [0, 0]
        assert [w["members"] for w in worlds] == [[0, 1, 2, 3], [0, 1], [0, 1, 4, 5]]
        assert final["generation"] == 2
        h.assert_job_exact(out, h.reference_run(h.make_batches(steps)), steps)
        kept = two_nodes.recoveries(out, 0)  # a survivor throughout
        assert [e["new_mesh"] for e in kept] == [{"data": 2, "model": 1},
                                                 {"data": 4, "model": 1}]
        _check_rows_read(out, [0, 1, 4, 5], width=4, steps=steps)
        assert left == [], "a process outlived the job"


@pytest.mark.slow  # ~30 s: the default suite is at its budget
def test_a_workers_exception_ends_the_job_on_every_node_and_each_says_why(tmp_path):
    """Worker 3 (node 1) raises at step 3: no recovery, both launchers end with its status,
    and node 0's log says which node ended the job and the exception (trial 26: the
    traceback showed on node 1 only, node 0 ended silently)."""
    out = str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(3) as cluster, two_nodes.started(
                cluster.url, out, steps=STEPS, sleep_s=0.3,
                job_args=("--raise-worker", "3", "--raise-at-step", "3")) as job:
            codes = [p.wait(timeout=240) for p in job.launchers]
            final = two_nodes.summary(job.store, two_nodes.NPROC)
            left = two_nodes.leftover_pids(job.nodes)
        assert codes == [1, 1]
        assert final["end"]["worker_id"] == 3 and final["end"]["code"] == 1
        assert final["generation"] == 0  # never recovered
        [line] = _launcher_lines(out, 0, "node 1 ends the job")
        assert "worker 3 exited with status 1 (RuntimeError: user bug in worker 3 at step " \
            "3)" in line, line
        assert left == [], "a process outlived the job"


def test_spares_take_the_places_of_two_lost_hosts_in_a_row(tmp_path, monkeypatch):
    """Worker 0's host dies (it owns every shard): node 0's spare takes its rank, so the
    mesh stays 4 x 1; then that spare's host dies, and node 1's spare takes the rank with
    the state from the replica the first spare re-created. Forged requests without the job
    secret to a launcher and an agent, before that, are all refused. Exact at the end.
    Over TLS: etcd refuses clients without a certificate of the job's CA."""
    steps = 14
    out = str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(3, tls=True) as cluster:
            assert cluster.tls is not None and cluster.url.startswith("etcds://")
            for var, path in cluster.tls.env().items():  # the launchers inherit it
                monkeypatch.setenv(var, path)
            codes, final, left, answered = two_nodes.run_spares(cluster.url, out,
                                                                steps=steps)
        _check_spares(out, steps, codes, final, left, answered)


@pytest.mark.slow  # ~45 s: the default suite is at its budget
def test_a_spare_joining_while_the_survivors_are_in_guarded_work_skips_that_work(tmp_path):
    """The job evaluates after every step through ``step.guard`` (the eval after step 3
    sleeps 2 s); worker 0's host dies during that eval. The survivors meet the death in
    the eval and recover with node 0's spare in the new world, which starts at step 4: the
    eval does not run again (its collectives would meet the spare's step), each survivor's
    raises `GuardSkippedError` after the state is recovered, and the job goes on. The
    state ends exact, every other eval too."""
    steps, out = 8, str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(3) as cluster:
            codes, final, left, _ = two_nodes.run_spares(
                cluster.url, out, steps=steps, second_kill=False,
                job_args=("--guarded-eval", "--eval-slow-after", "3"))
        assert codes == [0, 0]
        assert final["worlds"] == {0: [0, 1, 2, 3], 1: [4, 1, 2, 3]}
        h.assert_job_exact(out, h.reference_run(h.make_batches(steps)), steps)
        want = h.reference_evals(h.make_batches(steps))
        for w in (1, 2, 3):  # the survivors: every eval but the skipped one, exact
            with open(f"{out}/evals-w{w}.json") as f:
                got = {int(k): v for k, v in json.load(f).items()}
            assert sorted(got) == list(range(1, steps + 1)) and got[3] is None, (w, got)
            assert all(abs(got[k] - want[k - 1]) <= 1e-5 * (1 + abs(want[k - 1]))
                       for k in got if k != 3), (w, got, want)
            [rec] = two_nodes.recoveries(out, w)
            assert rec["guarded"] and rec["joined_processes"] == [4], rec
        with open(f"{out}/evals-w4.json") as f:  # the spare: from step 4 on
            got = {int(k): v for k, v in json.load(f).items()}
        assert sorted(got) == list(range(4, steps + 1)), got
        assert left == [], "a process outlived the job"


@pytest.mark.slow  # ~45 s
@pytest.mark.parametrize("eval_first", [False, True])
def test_a_spare_joining_at_an_older_step_skips_the_guarded_work_the_survivors_passed(
        tmp_path, eval_first):
    """As above, but worker 0's snapshot of step 3 never reached its agent (nor its
    buddy), and no survivor holds its live arrays: the new world agrees on step 2. The
    survivors replay step 3 inside the eval's call and skip the eval after it; the spare
    runs the job's loop from step 3 and must skip that eval too (run, its collectives
    would meet the survivors' step 4). ``eval_first``: the loop evaluates before each
    step, so the spare's first call is the eval after step 2, before its first step,
    which the survivors had passed as well. The state ends exact."""
    steps, out = 8, str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(3) as cluster:
            codes, final, left, _ = two_nodes.run_spares(
                cluster.url, out, steps=steps, second_kill=False,
                job_args=("--guarded-eval", "--eval-slow-after", "3", "--no-held-replicas",
                          "--withhold-publish", "0", "--withhold-publish-at", "3",
                          *(("--eval-first",) if eval_first else ())))
        assert codes == [0, 0]
        assert final["worlds"] == {0: [0, 1, 2, 3], 1: [4, 1, 2, 3]}
        h.assert_job_exact(out, h.reference_run(h.make_batches(steps)), steps)
        want = h.reference_evals(h.make_batches(steps))
        [rec] = two_nodes.recoveries(out, 1)
        assert rec["guarded"] and rec["joined_processes"] == [4], rec
        assert rec["steps_lost"] == 1, rec  # (agreed on step 2)
        with open(f"{out}/evals-w4.json") as f:  # the spare: from step 3 on, 3 skipped
            got = {int(k): v for k, v in json.load(f).items()}
        skipped = [2, 3] if eval_first else [3]
        assert sorted(got) == list(range(skipped[0], steps + (not eval_first))), got
        assert [k for k in got if got[k] is None] == skipped, got
        assert all(abs(got[k] - want[k - 1]) <= 1e-5 * (1 + abs(want[k - 1]))
                   for k in got if k not in skipped), (got, want)
        assert left == [], "a process outlived the job"


@pytest.mark.slow  # ~13 s; a stop during a recovery: resilient_multiprocess_test, default
def test_a_stop_signal_to_one_node_stops_every_node_at_one_checkpointed_step(tmp_path):
    """SIGTERM to node 1's launcher (a scheduler's preemption notice there): it tells the
    other node through etcd (`stopping`, which leaves worlds decidable until the end, so
    that a recovery under way completes), both forward it to their workers, which agree
    on a step to stop after and checkpoint it together; node 0's own SIGTERM 0.5 s later
    is its first, not a second that would cut the grace (a review: then nothing was
    checkpointed). Both launchers exit 143 and the checkpoint equals the failure-free
    state at its step."""
    out, ckpt = str(tmp_path), tmp_path / "ckpt"
    with _logs_on_failure(out):
        with etcd_cluster(1) as cluster, two_nodes.started(
                cluster.url, out, steps=200, sleep_s=0.2, job_args=("--ckpt", str(ckpt))) as job:
            two_nodes.wait(lambda: len(two_nodes.step_times(out).get(0, ())) >= 3, 120,
                           "three steps")
            job.launchers[1].send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the scheduler's notice reaches node 0 too: its first signal
            job.launchers[0].send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=120) for p in job.launchers]
            left = two_nodes.leftover_pids(job.nodes)
        assert codes == [128 + signal.SIGTERM] * 2, codes
        assert left == [], "a process outlived the job"
    h.assert_only_checkpoint_is_the_reference(ckpt, (4, 1))


@pytest.mark.slow  # ~25 s
def test_a_clean_end_says_no_node_lost_and_a_grow_back_launcher_after_it_is_refused(
        tmp_path):
    """A failure-free job ends 0 on both nodes: each says it finished (etcd
    ``finished/<rank>``) before its lease goes, so no launcher reports a node lost (a user
    trial: "node 0, which ran world 0's coordination service, is lost" after a clean end,
    2 runs in 14). A launcher started with ``--grow-back`` afterwards is refused at once
    (it waited silently, then claimed to rejoin the finished job)."""
    out = str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(1) as cluster, two_nodes.started(cluster.url, out, steps=4,
                                                           sleep_s=0.1) as job:
            codes = [p.wait(timeout=120) for p in job.launchers]
            finished = sorted(job.store.items("finished/"))
            again = job.relaunch(1)
            rc = again.wait(timeout=60)
        assert codes == [0, 0] and finished == ["finished/0", "finished/1"], (codes, finished)
        for rank in (0, 1):
            assert not _launcher_lines(out, rank, "is lost"), rank
        assert rc == 2
        with open(f"{out}/launcher-1-again.log") as f:
            assert "cannot rejoin: the job has finished" in f.read()


@pytest.mark.slow  # ~40 s
def test_spares_joining_in_a_guarded_save_skip_the_guarded_eval_after_it_too(tmp_path):
    """The README's recipe after every step: a guarded own save, then a guarded eval; one
    spare per node. Worker 0's host dies while the others are in the save after step 3
    (worker 1 comes to it late). The survivors skip the save (the spare starts at step
    4) and the eval after it too: run, its collectives met the spare's step 4 (a review:
    gloo's "collective mismatch" abort, which used the second spare). One spare joins,
    the job ends exact."""
    steps, out = 8, str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(1) as cluster:
            codes, final, left, _ = two_nodes.run_spares(
                cluster.url, out, steps=steps, second_kill=False,
                job_args=("--guarded-eval", "--user-ckpt", str(tmp_path / "uck"),
                          "--late-saver", "1", "--late-save-at", "3"))
        assert codes == [0, 0]
        assert final["worlds"] == {0: [0, 1, 2, 3], 1: [4, 1, 2, 3]}, final["worlds"]
        h.assert_job_exact(out, h.reference_run(h.make_batches(steps)), steps)
        for w in (1, 2, 3):
            with open(f"{out}/evals-w{w}.json") as f:
                got = {int(k): v for k, v in json.load(f).items()}
            assert got[3] is None, (w, got)
        assert left == [], "a process outlived the job"


def _check_spares(out, steps, codes, final, left, answered):
    assert answered == []  # every connection without the secret closed unanswered
    assert codes == [0, 0]
    assert final["worlds"] == {0: [0, 1, 2, 3], 1: [4, 1, 2, 3], 2: [5, 1, 2, 3]}
    h.assert_job_exact(out, h.reference_run(h.make_batches(steps)), steps)
    kept = two_nodes.recoveries(out, 1)  # a survivor throughout, recovered in place twice
    assert [e["new_mesh"] for e in kept] == [{"data": 4, "model": 1}] * 2
    assert left == [], "a process outlived the job"


@pytest.mark.slow  # ~45 s
def test_an_outage_of_the_whole_etcd_cluster_longer_than_the_lease_is_ridden_out(tmp_path):
    """Every etcd member is killed after step 3 and started again (on its data) 20 s
    later, four times ``--node-ttl-s`` and past one call's retries; worker 3 (its agent
    too) is killed 2 s into the outage. The launchers keep their leases meanwhile (one
    etcd did not say had ended is not taken for lost: a new leader renews every lease),
    and the survivors' agreement waits for etcd rather than failing; no node is taken
    for lost, and the job ends exact in world 1 of the three survivors."""
    steps, out = 40, str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(3) as cluster, two_nodes.started(cluster.url, out, steps=steps,
                                                           sleep_s=0.2) as job:
            two_nodes.wait(lambda: len(two_nodes.step_times(out).get(0, ())) >= 3, 120,
                           "three steps")
            for i in range(3):
                cluster.kill(i)
            time.sleep(2)
            os.killpg(job.nodes[1]["agent_pids"]["3"], signal.SIGKILL)
            time.sleep(18)
            cluster.restart(0, 1, 2)
            codes = [p.wait(timeout=180) for p in job.launchers]
            final = summary(job.store, two_nodes.NPROC)
            left = two_nodes.leftover_pids(job.nodes)
        assert codes == [0, 0], codes
        assert final["worlds"] == {0: [0, 1, 2, 3], 1: [0, 1, 2]}, final
        h.assert_job_exact(out, h.reference_run(h.make_batches(steps)), steps)
        for rank in (0, 1):
            assert not _launcher_lines(out, rank, "is lost"), rank
            assert not _launcher_lines(out, rank, "given up"), rank
        assert _launcher_lines(out, 1, "agreement waits for it")
        assert left == [], "a process outlived the job"


@pytest.mark.slow  # ~45 s
def test_a_node_cut_off_from_etcd_alone_ends_its_part_once_it_reaches_etcd_again(tmp_path):
    """Node 1 reaches etcd through a way of its own, cut after step 3 while node 0 still
    reaches it: node 0 takes node 1 for lost once its lease ends and goes on in world 1
    with its own workers; node 1 keeps waiting for etcd (it cannot tell this from an
    outage of the whole cluster) until its way is mended, then finds its lease ended and
    ends its part. The scheduler's SIGTERM reaches node 1 just before (a node drained):
    its ``stopping``, written once it reaches etcd, would stop the job the others went
    on with; etcd refuses it (node 1's writes need its registration, a review found an
    unfenced write land). Node 0 ends 0 and exact."""
    steps, out = 40, str(tmp_path)
    with _logs_on_failure(out):
        with etcd_cluster(3) as cluster, contextlib.closing(CutOff(cluster)) as way, \
                two_nodes.started(cluster.url, out, steps=steps, sleep_s=0.2,
                                  urls={1: way.url}) as job:
            two_nodes.wait(lambda: len(two_nodes.step_times(out).get(0, ())) >= 3, 120,
                           "three steps")
            way.cut()
            world1 = two_nodes.wait(lambda: job.store.get(job.store.key("world", 1)), 120,
                                    "world 1")
            time.sleep(3)
            waited = job.launchers[1].poll()  # (still waiting for etcd)
            job.launchers[1].send_signal(signal.SIGTERM)
            time.sleep(1)
            way.mend()
            codes = [p.wait(timeout=180) for p in job.launchers]
            end, stopping = (job.store.get(job.store.key(k)) for k in ("end", "stopping"))
            left = two_nodes.leftover_pids(job.nodes)
        assert waited is None
        assert codes[0] == 0 and codes[1] != 0, codes
        assert world1["members"] == [0, 1], world1
        assert end is None and stopping is None, (end, stopping)
        h.assert_job_exact(out, h.reference_run(h.make_batches(steps)), steps)
        assert _launcher_lines(out, 1, "etcd says its lease ended")
        assert _launcher_lines(out, 1, "etcd refuses this launcher's writes")
        assert left == [], "a process outlived the job"


@pytest.mark.slow  # ~60 s
def test_a_crashed_worker_is_restarted_on_its_node_and_the_job_grows_back(tmp_path):
    """``--max-restarts 1`` across nodes: worker 1's process (not its agent) is killed;
    the other three go on as world 1 while node 0's launcher claims a fresh id in etcd
    (4: every id the job used is taken) and starts it as a warm spare; once it is warm,
    the job re-forms at world 0's size with the spare at worker 1's rank. Exact."""
    steps, out = 28, str(tmp_path)  # (room for the claim, the spare's start, the regrow)
    with _logs_on_failure(out):
        with etcd_cluster(3) as cluster, two_nodes.started(
                cluster.url, out, steps=steps, sleep_s=0.5,
                launcher_args=("--max-restarts", "1")) as job:
            two_nodes.wait(lambda: len(two_nodes.step_times(out).get(1, ())) >= 3, 120,
                           "three steps of worker 1")
            agent = job.nodes[0]["agent_pids"]["1"]
            [worker] = subprocess.check_output(
                ["pgrep", "-P", str(agent), "-f", "tests.jobs.mp_resilient_job"]).split()
            os.kill(int(worker), signal.SIGKILL)
            codes = [p.wait(timeout=240) for p in job.launchers]
            worlds = {int(k.split("/")[1]): v["members"]
                      for k, v in job.store.items("world/").items()}
            claims = job.store.items("rejoin/")
            left = two_nodes.leftover_pids(job.nodes)
        assert codes == [0, 0]
        assert worlds[max(worlds)] == [0, 4, 2, 3], worlds
        assert {k.split("/")[1]: v["restarts"] for k, v in claims.items()} == {"4": 1}
        assert _launcher_lines(out, 0, "worker 1 ended by signal 9: starting spare 4")
        # Its agent ended once every member of the world after it had published twice
        # (node 1's count read from etcd).
        assert _launcher_lines(out, 0, "the agents of workers [1] are ended")
        h.assert_job_exact(out, h.reference_run(h.make_batches(steps)), steps)
        assert left == [], "a process outlived the job"

