"""Two simulated nodes of one job: two ``mnemojax launch --rdzv etcd://`` launchers (2
workers x 1 CPU device each, `tests.jobs.mp_resilient_job`), a real 3-member etcd, and the
kill of one whole node mid-run. Used by `tests/e2e/multinode_test.py`, and runnable to
measure the kill -> next good step of each survivor::

    PYTHONPATH=. python -m tests.jobs.two_nodes --victim coordination_service [--repeat 3]

Needs etcd (`make etcd`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.launcher.etcd_store import EtcdStore
from mnemojax._src.distributed.launcher.scenario import forged_requests_answered, process_alive
from mnemojax._src.distributed.launcher.status import summary
from mnemojax._src.distributed.shm import sweep

NPROC = 2  # workers per node
VICTIMS = ("worker_nodes", "coordination_service")


def host(rank: int) -> str:
    """Each simulated node serves on an address of its own (all of 127/8 is loopback)."""
    return f"127.0.0.{rank + 1}"


def launch(url: str, job: str, rank: int, out: str, env: dict[str, str], *, steps: int,
           sleep_s: float, spares: int = 0, job_args: Sequence[str] = (),
           launcher_args: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """Node ``rank``'s launcher; its job restores first (a restarted worker needs it)."""
    cmd = [sys.executable, "-m", "mnemojax", "launch", "--rdzv", url, "--rdzv-id", job,
           "--nnodes", "2", "--node-rank", str(rank), "--nproc", str(NPROC),
           "--spares", str(spares),
           "--host", host(rank), "--devices-per-proc", "1", "--timeout-s", "200",
           *launcher_args, "--",
           sys.executable, "-m", "tests.jobs.mp_resilient_job", "--out", out,
           "--steps", str(steps), "--model-axis", "1", "--step-sleep-s", str(sleep_s),
           "--restore", *job_args]
    name = f"launcher-{rank}{'-again' if '--grow-back' in launcher_args else ''}.log"
    with open(os.path.join(out, name), "wb") as log:  # the child keeps it
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def step_times(out: str) -> dict[int, list[tuple[int, float]]]:
    """Worker -> [(step, time)] from the event logs."""
    times: dict[int, list[tuple[int, float]]] = {}
    for name in os.listdir(out):
        if name.startswith("mnemojax-events-w"):
            w = int(name[len("mnemojax-events-w"):].split(".")[0])
            with open(os.path.join(out, name)) as f:
                for line in f:
                    if '"kind": "step"' in line:
                        e = json.loads(line)
                        times.setdefault(w, []).append((e["step"], e["time"]))
    return times


def wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


@dataclasses.dataclass
class Outcome:
    rc: int
    victim: int
    killed_at: float
    final: dict[str, Any]
    nodes: dict[int, dict[str, Any]]
    survivor_shm: list[str]

    def next_good_step_s(self, out: str) -> list[float]:
        """Per survivor: seconds from the kill to its first step after it."""
        return [min(t for _, t in steps if t > self.killed_at) - self.killed_at
                for w, steps in step_times(out).items() if w // NPROC != self.victim
                and any(t > self.killed_at for _, t in steps)]


@dataclasses.dataclass
class Job:
    """Two launchers of one job while it runs (`started`)."""

    store: EtcdStore
    launchers: list[subprocess.Popen[bytes]]
    nodes: dict[int, dict[str, Any]]  # rank -> its record in etcd (pids, shm prefix)
    world0: dict[str, Any]
    relaunch: Callable[[int], subprocess.Popen[bytes]]  # rank -> its node again


@contextlib.contextmanager
def started(cluster_url: str, out: str, *, steps: int, sleep_s: float, spares: int = 0,
            job_args: Sequence[str] = (), urls: Mapping[int, str] | None = None,
            launcher_args: Sequence[str] = ()):
    """Starts both nodes and waits for world 0; at exit kills whatever is left of them
    and removes the killed node's shared memory (its agents never could). ``urls``: a
    node's own way to the cluster (rank -> its ``--rdzv``), ``cluster_url`` otherwise."""
    urls = {r: (urls or {}).get(r, cluster_url) for r in (0, 1)}
    env = {**os.environ, "MNEMOJAX_JOB_SECRET": secrets.token_hex(32)}
    job = f"two-nodes-{os.getpid()}-{secrets.token_hex(3)}"
    store = EtcdStore.from_url(cluster_url, job)
    launchers: list[subprocess.Popen[bytes]] = []
    nodes: dict[int, dict[str, Any]] = {}
    try:
        launchers = [launch(urls[r], job, r, out, env, steps=steps, sleep_s=sleep_s,
                            spares=spares, job_args=job_args, launcher_args=launcher_args)
                     for r in (0, 1)]
        world0 = wait(lambda: store.get(store.key("world", 0)), 120, "world 0")
        nodes.update({r: store.get(store.key("nodes", r)) for r in (0, 1)})

        def relaunch(rank: int) -> subprocess.Popen[bytes]:
            """Node ``rank`` again (a restarted host), with ``--grow-back``; ended and
            swept with the others."""
            p = launch(urls[rank], job, rank, out, env, steps=steps, sleep_s=sleep_s,
                       spares=spares, job_args=job_args, launcher_args=("--grow-back",))
            launchers.append(p)
            return p

        yield Job(store, launchers, nodes, world0, relaunch)
    finally:
        for p in launchers:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        for rec in nodes.values():
            sweep(rec["shm_prefix"])


def run(cluster_url: str, kill_member, out: str, victim_runs: str, *, steps: int = 10,
        sleep_s: float = 0.3, kill_after: int = 3, spares: int = 0,
        job_args: Sequence[str] = ()) -> Outcome:
    """Runs the job (`tests.jobs.mp_resilient_job` with ``job_args``), kills the node that
    runs (or not) world 0's coordination service and one etcd member (``kill_member()``),
    waits for the survivor; ends every process."""
    with started(cluster_url, out, steps=steps, sleep_s=sleep_s, spares=spares,
                 job_args=job_args) as job:
        wait(lambda: any(len(s) >= kill_after for s in step_times(out).values()), 120,
             f"{kill_after} steps")
        host_node = job.world0["host_node"]
        victim = host_node if victim_runs == "coordination_service" else 1 - host_node
        killed_at = time.time()
        os.kill(job.nodes[victim]["pid"], signal.SIGKILL)  # the whole node at once
        for pid in job.nodes[victim]["agent_pids"].values():  # each agent's group + worker
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        kill_member()  # and an etcd member, during the recovery
        rc = job.launchers[1 - victim].wait(timeout=240)
        survivor_shm = sweep(job.nodes[1 - victim]["shm_prefix"])  # its launcher swept
        return Outcome(rc, victim, killed_at, summary(job.store, NPROC), job.nodes,
                       survivor_shm)


def recoveries(out: str, worker: int) -> list[dict[str, Any]]:
    """The recovery events in ``worker``'s event log."""
    with open(os.path.join(out, f"mnemojax-events-w{worker}.jsonl")) as f:
        return [e for e in map(json.loads, f) if e.get("kind") == "recovery"]


def run_spares(cluster_url: str, out: str, *, steps: int = 14, sleep_s: float = 0.3,
               kills: list[float] | None = None, job_args: Sequence[str] = (),
               second_kill: bool = True
               ) -> tuple[list[int], dict[str, Any], list[int], list[str]]:
    """One spare per node. Kills worker 0's host (agent and worker: it owns every shard
    of the data-parallel state) once worker 0 has logged step 3, then (``second_kill``),
    once the spare that took its place has stepped twice, that spare's host: its state
    must come from the replica it re-created. Before the first kill, an outsider without
    the job secret sends forged requests to node 1's launcher (a ``hello``, an ``agree``)
    and to worker 2's agent (an ``alloc``, a ``get``).

    Returns both launchers' exit statuses, the final summary, the processes left and what
    the forged requests got back; appends the kills' times to ``kills``."""
    kills = [] if kills is None else kills
    with started(cluster_url, out, steps=steps, sleep_s=sleep_s, spares=1,
                 job_args=job_args) as job:
        agent_pid = {int(w): p for rec in job.nodes.values()
                     for w, p in rec["agent_pids"].items()}
        wait(lambda: len(step_times(out).get(0, ())) >= 3, 120, "three steps")
        answered = forged_requests_answered(job.nodes[1]["control"], [
            wire.Hello(worker_id=2, address="127.0.0.1:1", pid=1),
            wire.Agree(worker_id=2, generation=0, last_step=0)]) + forged_requests_answered(
            job.store.get(job.store.key("agents", 2)),
            [wire.Alloc(nbytes=4096, budget_bytes=None), wire.Get(origin=2, step=1)])
        kills.append(time.time())
        os.killpg(agent_pid[0], signal.SIGKILL)
        world1 = wait(lambda: job.store.get(job.store.key("world", 1)), 120, "world 1")
        if second_kill:
            spare = next(w for w in world1["members"] if w >= 2 * NPROC)
            wait(lambda: len(step_times(out).get(spare, ())) >= 2, 120,
                 "two steps of the spare")
            kills.append(time.time())
            os.killpg(agent_pid[spare], signal.SIGKILL)
        codes = [p.wait(timeout=240) for p in job.launchers]
        return codes, summary(job.store, NPROC), leftover_pids(job.nodes), answered


def run_grow_back(cluster_url: str, out: str, *, steps: int = 24, sleep_s: float = 0.3,
                  job_args: Sequence[str] = ()
                  ) -> tuple[list[int], dict[str, Any], list[int], list[dict[str, Any]]]:
    """Kills the whole node that does not run world 0's coordination service (the other
    recovers in place, on half the mesh), then, once that world is decided, starts the
    node again with ``--grow-back``: its processes wait as spares with fresh ids, and the
    job re-forms at world 0's size.

    Returns the exit statuses (the surviving launcher's, then the restarted one's), the
    final summary, the processes left and each world's record."""
    with started(cluster_url, out, steps=steps, sleep_s=sleep_s, job_args=job_args) as job:
        wait(lambda: any(len(s) >= 3 for s in step_times(out).values()), 120, "3 steps")
        victim = 1 - job.world0["host_node"]
        os.kill(job.nodes[victim]["pid"], signal.SIGKILL)  # the whole node at once
        for pid in job.nodes[victim]["agent_pids"].values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        wait(lambda: job.store.get(job.store.key("world", 1)), 120, "world 1")
        again = job.relaunch(victim)
        rejoined = wait(lambda: job.store.get(job.store.key("nodes", victim)), 120,
                        "the node again")
        job.nodes[2] = rejoined  # swept and checked with the others
        codes = [job.launchers[1 - victim].wait(timeout=240), again.wait(timeout=240)]
        worlds = [rec for _, rec in sorted(
            (int(k.split("/")[1]), v) for k, v in job.store.items("world/").items())]
        return codes, summary(job.store, NPROC), leftover_pids(job.nodes), worlds


def leftover_pids(nodes: dict[int, dict[str, Any]]) -> list[int]:
    pids = [rec["pid"] for rec in nodes.values()] + [
        p for rec in nodes.values() for p in rec["agent_pids"].values()]
    return [p for p in pids if process_alive(p)]


def main() -> None:
    from tests.etcd_cluster import etcd_cluster
    parser = argparse.ArgumentParser()
    parser.add_argument("--victim", choices=(*VICTIMS, "spares"), default="coordination_service",
                        help="spares: one spare per node, worker 0's host killed, then the "
                             "spare's that replaced it")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-after", type=int, default=10)
    args = parser.parse_args()
    figures = []
    for i in range(args.repeat):
        with etcd_cluster(3) as cluster, tempfile.TemporaryDirectory() as out:
            if args.victim == "spares":
                kills: list[float] = []
                codes, final, _, _ = run_spares(cluster.url, out, steps=args.steps, sleep_s=0.1,
                                             kills=kills)
                survivor = step_times(out)[1]  # in every world
                recovered = [e["time"] for e in recoveries(out, 1)]  # when each ended
                times = [min(t for _, t in survivor
                             if t >= min(r for r in recovered if r > k)) - k for k in kills]
                figures += times
                print(f"run {i}: rc {codes}, worlds {final['worlds']}, kill -> worker 1's "
                      "next good step: " + ", ".join(f"{t:.2f} s" for t in times), flush=True)
                continue
            o = run(cluster.url, lambda: cluster.kill(0), out, args.victim, steps=args.steps,
                    sleep_s=0.1, kill_after=args.kill_after)
            times = o.next_good_step_s(out)
            figures += times
            print(f"run {i}: rc {o.rc}, world {o.final['generation']} {o.final['members']}, "
                  f"kill -> next good step per survivor: "
                  + ", ".join(f"{t:.2f} s" for t in times), flush=True)
    if figures:
        print(f"median {statistics.median(figures):.2f} s over {len(figures)} survivors")


if __name__ == "__main__":
    main()
