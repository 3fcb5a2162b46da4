"""A job over two simulated nodes: two `mnemojax launch --rdzv etcd://...` launchers (2
workers x 1 CPU device each) meeting in a real 3-member etcd cluster on loopback.

The whole of one node (its launcher, agents and workers) is SIGKILLed mid-run, and one etcd
member with it: the other node's workers agree through etcd on a world of their own and
end allclose to the failure-free plain Flax run. The buddy ring spans the nodes, so worker
0's copies (it owns every shard of the data-parallel MLP) survive on the other node.

The node killed is the one *not* hosting the coordination service: with jaxlib 0.10 a
client whose service dies aborts its process (WORKSPACE_NOTES, "Coordinator loss").
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from mnemojax._src.distributed.launcher.etcd_store import EtcdStore
from mnemojax._src.distributed.launcher.scenario import process_alive
from mnemojax._src.distributed.launcher.status import summary
from mnemojax._src.distributed.shm import sweep
from tests import helpers as h
from tests.etcd_cluster import etcd_cluster

pytestmark = pytest.mark.multiprocess

STEPS = 10
NPROC = 2  # workers per node


@pytest.fixture(scope="module")
def reference():
    return h.reference_run(h.make_batches(STEPS))


def _launch(url: str, job: str, rank: int, out: str, env: dict[str, str]):
    cmd = [sys.executable, "-m", "mnemojax", "launch", "--rdzv", url, "--rdzv-id", job,
           "--nnodes", "2", "--node-rank", str(rank), "--nproc", str(NPROC),
           "--devices-per-proc", "1", "--timeout-s", "200", "--",
           sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", out,
           "--steps", str(STEPS), "--model-axis", "1", "--step-sleep-s", "0.3"]
    with open(os.path.join(out, f"launcher-{rank}.log"), "wb") as log:  # the child keeps it
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _steps_done(out: str) -> int:
    done = 0
    for name in os.listdir(out):
        if name.startswith("mnemojax-events-"):
            with open(os.path.join(out, name)) as f:
                done = max(done, sum(1 for line in f if '"kind": "step"' in line))
    return done


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def test_losing_a_whole_node_and_an_etcd_member_recovers_exact(tmp_path, reference):
    out = str(tmp_path)
    env = {**os.environ, "MNEMOJAX_JOB_SECRET": secrets.token_hex(32)}
    launchers, nodes = [], {}
    with etcd_cluster(3) as cluster:
        job = f"e2e-{os.getpid()}"
        store = EtcdStore.from_url(cluster.url, job)
        try:
            launchers = [_launch(cluster.url, job, r, out, env) for r in (0, 1)]
            world0 = _wait(lambda: store.get(store.key("world", 0)), 120, "world 0")
            nodes = {r: store.get(store.key("nodes", r)) for r in (0, 1)}
            _wait(lambda: _steps_done(out) >= 3, 120, "three steps")
            victim = 1 - world0["host_node"]
            os.kill(nodes[victim]["pid"], signal.SIGKILL)  # the whole node at once
            for pid in nodes[victim]["agent_pids"].values():  # each agent's group: + worker
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            cluster.kill(0)  # and an etcd member, during the recovery
            survivor = launchers[1 - victim]
            assert survivor.wait(timeout=240) == 0
            final = summary(store, NPROC)
            survivors = [w for w in range(2 * NPROC) if w // NPROC != victim]
            assert final["generation"] == 1 and final["members"] == survivors
            assert final["host_node"] == 1 - victim
            stats = h.assert_job_exact(out, reference, STEPS)
            [rec] = stats["recoveries"]
            assert rec["plan_kind"] == "process_loss"
        finally:
            for p in launchers:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
            for rec in nodes.values():  # the killed node's agents never cleaned theirs
                sweep(rec["shm_prefix"])
    pids = [rec["pid"] for rec in nodes.values()] + [
        p for rec in nodes.values() for p in rec["agent_pids"].values()]
    assert not any(process_alive(p) for p in pids), "a process outlived the job"
