"""One node's launcher of a job that spans several (``mnemojax launch --rdzv etcd://...``).

Like `launcher.Launcher`, it starts this node's agents and workers and serves their events
and requests; unlike it, it decides nothing alone. The job's state lives in etcd
(`plane`): the node registers itself and its agents under a lease, waits for every node,
and world 0 is created once (by the lowest rank; its coordination service runs there).
Every later world is decided by whichever node's survivor completes the barrier first, and
its service runs on that node. So no node is special after world 0: losing any one,
including the one hosting the current coordination service, is a failure the others
recover from.

Each node acts on what the mirror of the keys shows (`NodeLauncher._on_view`): a new world
stops the old world's service where it ran and re-forms this node's part of the buddy
ring; a worker of this node declared dead elsewhere (evicted) is killed; the job's end,
decided on any node, ends this node too (a worker's error status, or a stop signal that
every node forwards to its workers).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from mnemojax._src.distributed import auth, wire
from mnemojax._src.distributed.launcher.etcd_store import EtcdStore, LeaseKeeper
from mnemojax._src.distributed.launcher.launcher import Launcher
from mnemojax._src.distributed.launcher.options import LaunchOptions, worker_env
from mnemojax._src.distributed.launcher.plane import EtcdArbiter, JobView, ring
from mnemojax._src.errors import DistributedError, WorldConfigError

logger = logging.getLogger("mnemojax")

FORM_TIMEOUT_S = 120.0  # every node must have registered by then


def shared_secret(environ: dict[str, str] | None = None) -> bytes:
    """The job secret every node's launcher must be given (the same on each).

    Raises:
        WorldConfigError: it is not set, or not valid.
    """
    secret = auth.secret_from_env(os.environ if environ is None else environ)
    if secret is None:
        raise WorldConfigError(
            f"a job across nodes needs {auth.JOB_SECRET}: the same secret (hex, >= 16 bytes) "
            f"in every launcher's environment, e.g. {auth.JOB_SECRET}=$(openssl rand -hex 32)")
    return secret


class NodeLauncher(Launcher):
    """Runs node ``options.node_rank``'s share of a job over ``options.nnodes`` nodes.

    Args:
        options: with ``rdzv`` set.
        command: the worker command.
        store: the job's keys (default: from ``options.rdzv`` and ``rdzv_id``).
        extra_env, on_event: as `Launcher`.
    """

    def __init__(self, options: LaunchOptions, command: Sequence[str], *,
                 store: EtcdStore | None = None, extra_env: dict[str, str] | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None):
        if options.rdzv is None:
            raise WorldConfigError("NodeLauncher needs options.rdzv (etcd://HOST:PORT)")
        super().__init__(options, command, extra_env=extra_env, on_event=on_event,
                         secret=shared_secret())
        self.store = store if store is not None else EtcdStore.from_url(
            options.rdzv, options.rdzv_id)
        self.plane = EtcdArbiter(
            self.store, node_rank=options.node_rank, nproc=options.nproc,
            agree_timeout_s=options.agree_timeout_s, roster=self.roster,
            services=self.services, record=self._record, on_view=self._on_view)
        self.arbiter = self.plane
        self._lease: LeaseKeeper | None = None
        self._lease_lost = False
        self._world_seen = 0  # world 0's ring is set at the start
        self._dead_seen: set[int] = set()
        self._killed: set[int] = set()
        self._end_seen = False

    # -- the mirror's news (``roster.cv`` held) -----------------------------------------------
    def _on_view(self, view: JobView) -> None:
        o = self.options
        for g in sorted(g for g in view.worlds() if g > self._world_seen):
            self._world_seen = g
            record = view.world(g) or {}
            self._record({"op": "world", "generation": g, "members": record.get("members"),
                          "coordinator": record.get("coordinator"),
                          "host_node": record.get("host_node")})
            logger.info("mnemojax launch: world %d: workers %s, coordination service on "
                        "node %s", g, record.get("members"), record.get("host_node"))
            if self.services.stop(g - 1):  # every survivor detached before agreeing
                self._record({"op": "old_service_stopped", "generation": g - 1})
            self._set_buddies(view, view.worlds()[g])
        dead = view.dead()
        if new := dead - self._dead_seen:
            self._dead_seen |= new
            self._record({"op": "dead", "workers": sorted(new)})
            self.roster.command_all(wire.PauseWatchdog())  # survivors may block a while
        for w in dead & set(o.local_workers):
            if w not in self.roster.exit_codes and w not in self._killed:
                self._killed.add(w)  # evicted by another node: fence it here
                self.roster.command(w, wire.KillWorker())
        end = view.end()
        if end is not None and not self._end_seen:
            self._end_seen = True
            if end.get("node") != o.node_rank:
                self._record({"op": "job_ending", **end})
                if end.get("signal") is not None and not self._stop_signals:
                    self._stop_signals.append(int(end["signal"]))
                elif end.get("code") and self._worker_error is None:
                    self._worker_error = (int(end["worker_id"]), int(end["code"]),
                                          time.monotonic())

    def _set_buddies(self, view: JobView, members: Sequence[int]) -> None:
        """Tells this node's agents their buddies in the ring over ``members``' agents."""
        agents = view.agents()
        order = ring([m for m in members if m in agents], self.options.nproc)
        for i, m in enumerate(order):
            if m in self.roster.links:
                buddy = agents[order[(i + 1) % len(order)]] if len(order) > 1 else None
                self.roster.command(m, wire.SetBuddy(buddy=buddy))

    def _on_lease_lost(self) -> None:
        with self.roster.cv:
            self._lease_lost = True
            self.roster.cv.notify_all()

    # -- the launcher's hooks -----------------------------------------------------------------
    def _worker_gone(self, worker_id: int, code: int) -> None:
        if worker_id not in self.roster.exit_codes:
            self.plane.publish_exit(worker_id, code)
        super()._worker_gone(worker_id, code)
        if code != 0 and not self.options.recover:
            self.plane.end(f"the job is ending: worker {worker_id} failed ({code}) and "
                           "recovery is off", code=128 - code if code < 0 else code,
                           worker_id=worker_id)

    def agent_lost(self, worker_id: int) -> None:
        self.plane.forget_agent(worker_id)
        super().agent_lost(worker_id)

    def _exit_codes(self) -> dict[int, int]:
        return {**self.plane.view.exits(), **self.roster.exit_codes}

    def _finished(self) -> int | None:
        if self._lease_lost:  # the others have declared this node's workers dead
            self._record({"op": "lease_lost"})
            logger.error("mnemojax launch: node %d lost its etcd lease; ending its part",
                         self.options.node_rank)
            return 1
        return super()._finished()

    def _start(self) -> None:
        o, cv = self.options, self.roster.cv
        if self.store.get(self.store.key("end")) is not None:
            raise WorldConfigError(f"rdzv_id={o.rdzv_id!r} names a job that has ended: give "
                                   "each run its own --rdzv-id")
        self._control.start()
        self.supervisor.start()
        with cv:
            if not cv.wait_for(lambda: len(self.roster.addresses) == o.nproc, timeout=60):
                raise DistributedError(
                    f"only {len(self.roster.addresses)}/{o.nproc} agents said hello")
            agents = dict(self.roster.addresses)
        self._lease = LeaseKeeper(self.store, o.node_ttl_s, on_lost=self._on_lease_lost)
        for w, address in agents.items():
            self.store.put(self.store.key("agents", w), address, lease=self._lease.lease)
        self.store.put(self.store.key("nodes", o.node_rank),
                       {"pid": os.getpid(), "control": self.control,
                        "workers": list(o.local_workers), "shm_prefix": self.shm_prefix,
                        "agent_pids": {str(w): p.pid for w, p in self.agents.items()}},
                       lease=self._lease.lease)
        self.plane.start()
        view = self._wait_view(lambda v: len(v.live_nodes()) == o.nnodes
                               or v.world(0) is not None,
                               f"all {o.nnodes} nodes to register")
        if view.world(0) is None and o.node_rank == min(view.live_nodes()):
            service = self.services.start(0, o.world_size)
            if not self.store.create(self.store.key("world", 0), {
                    "members": list(range(o.world_size)), "coordinator": service.address,
                    "host_node": o.node_rank}):
                self.services.stop(0)
        view = self._wait_view(lambda v: v.world(0) is not None, "world 0")
        record = view.world(0) or {}
        self._record({"op": "world", "generation": 0, "members": record["members"],
                      "coordinator": record["coordinator"], "host_node": record["host_node"]})
        everyone = view.agents()
        order = ring(list(range(o.world_size)), o.nproc)
        with cv:
            for w in o.local_workers:
                nxt = order[(order.index(w) + 1) % len(order)]
                self.roster.command(w, wire.Start(
                    env=worker_env(o, w, coordinator=record["coordinator"],
                                   control=self.control, extra_env=self.extra_env),
                    buddy=everyone.get(nxt) if len(order) > 1 else None))

    def _wait_view(self, ready: Callable[[JobView], bool], what: str) -> JobView:
        with self.roster.cv:
            if not self.roster.cv.wait_for(lambda: ready(self.plane.view),
                                           timeout=FORM_TIMEOUT_S):
                raise DistributedError(f"node {self.options.node_rank}: waited "
                                       f"{FORM_TIMEOUT_S:.0f} s for {what} in etcd")
            return self.plane.view

    def cleanup(self) -> None:
        super().cleanup()
        self.plane.join()
        if self._lease is not None:
            self._lease.close(revoke=True)
            self._lease = None
