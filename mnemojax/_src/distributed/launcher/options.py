"""How a job is launched (`LaunchOptions`) and the environment each worker gets."""

from __future__ import annotations

import dataclasses

from mnemojax._src.distributed import env
from mnemojax._src.errors import InvalidOptionError


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How to launch. Durations in seconds.

    Attributes:
        nproc: worker processes of this node (one agent each).
        devices_per_proc: CPU devices per worker.
        heartbeat_s: coordination-service heartbeat timeout (>= 10 on 2 cores, DESIGN §4).
        collective_timeout_s: bound on a gloo collective. A death the launcher knows of (a
            worker killed, its agent lost, an eviction) reaches every survivor within
            milliseconds (`worker.peer_watch`); this bounds the rest (a peer that is alive
            but never sends).
        hang_factor: hang = no step for this multiple of the median step time.
        hang_min_s: floor of the hang threshold; raised to ``collective_timeout_s + 10`` so a
            survivor blocked on a dead peer's collective is never mistaken for a hung one.
        agree_timeout_s: members not at the agreement barrier by then are evicted (killed);
            half of it is how long survivors wait to join the new world before agreeing
            again (a member died after the decision).
        recover: False: any worker failure ends the job (the failure's exit status).
        job_timeout_s: kill everything after this long (None: no limit).
        grace_s: SIGTERM-to-SIGKILL grace at cleanup; also how long the other workers may
            take to end on their own after one ended the job with an error.
        stop_grace_s: after SIGTERM or SIGINT to the launcher, how long the workers (sent
            SIGTERM: a just-in-time checkpoint where the persistent tier is on) may take to
            exit before everything is killed.
        rdzv: ``etcd://HOST:PORT[,HOST:PORT...]``: the job spans ``nnodes`` launchers that
            meet in this etcd cluster (`plane`); ``etcds://...``: the same over TLS
            (`etcd_store.EtcdTLS`); None: this launcher is the whole job.
        rdzv_id: the job's name in etcd (every node gives the same).
        nnodes, node_rank: how many launchers (nodes), and which one this is. Worker ids
            are global: node r runs ``r * nproc ... (r + 1) * nproc - 1``.
        node_ttl_s: a node whose launcher has not renewed its etcd lease for this long is
            lost (its workers are dead).
        etcd_outage_s: how long a launcher that reaches no etcd member keeps its part of
            the job running (at least ``node_ttl_s``), and an agreement waits for etcd.
            An outage of the cluster itself is ridden out: the leader elected after it
            renews every lease (not so a cluster that stays up while the launchers lose
            their way to it: their leases end). A node cut off alone ends its part once
            etcd answers that its lease expired (the others took it for lost after
            ``node_ttl_s``), or after this long; its writes are refused meanwhile.
        spares: warm spares this node keeps ready (ids after every node's workers): an
            agent and a worker process started with the job, waiting in
            ``mnemojax.initialize()``. A world formed after a loss takes one in place of
            each dead member when there are enough, so it keeps its size; the spare's
            process then joins it and takes the agreed state at ``step.restore()``. On one
            machine (no ``rdzv``) too: the one launcher keeps them.
        max_restarts: a worker whose process crashed (a signal), or left the job (no
            device for it in the new mesh), is started again as a warm spare with a fresh
            id, at most this many times in the job (per node, across nodes: each node's
            launcher restarts its own, the id claimed in etcd); once warm spares can fill
            every rank a shrunk world lost, it re-forms at its first size (`Launcher`). A
            whole node lost is restarted by its scheduler, with ``grow_back``.
        host: the address this node's agents and coordination services listen on and
            advertise (other nodes must reach it). JAX's coordination service authenticates
            no one: across hosts, keep it on a private network.
        grow_back: this node may (re)join a job that is already running (a restarted host):
            all its processes start as warm spares, with fresh ids, and the job grows back
            to world 0's size once there are enough of them (`NodeLauncher`).
        rejoin_first_id: set by the launcher of a node that rejoins a running job: its
            agents' ids start here (all spares).
    """

    nproc: int
    devices_per_proc: int = 1
    heartbeat_s: int = 10
    collective_timeout_s: int = 20
    hang_factor: float = 10.0
    hang_min_s: float = 5.0
    agree_timeout_s: float = 60.0
    recover: bool = True
    job_timeout_s: float | None = None
    grace_s: float = 3.0
    stop_grace_s: float = 60.0
    rdzv: str | None = None
    rdzv_id: str = "mnemojax"
    nnodes: int = 1
    node_rank: int = 0
    node_ttl_s: int = 5
    etcd_outage_s: float = 300.0
    spares: int = 0
    max_restarts: int = 0
    host: str = "127.0.0.1"
    grow_back: bool = False
    rejoin_first_id: int | None = None

    def __post_init__(self):
        for name in ("nproc", "devices_per_proc", "heartbeat_s", "collective_timeout_s"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name}={getattr(self, name)} is invalid: expected >= 1")
        if self.hang_factor <= 1 or self.agree_timeout_s <= 0 or self.grace_s < 0:
            raise InvalidOptionError("hang_factor must be > 1, agree_timeout_s > 0, grace_s >= 0")
        if self.stop_grace_s < 0:
            raise InvalidOptionError(f"stop_grace_s={self.stop_grace_s} is invalid: expected >= 0")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise InvalidOptionError(f"nnodes={self.nnodes}, node_rank={self.node_rank} is "
                                     "invalid: expected nnodes >= 1 and 0 <= node_rank < nnodes")
        if self.rdzv is None and self.nnodes > 1:
            raise InvalidOptionError(f"nnodes={self.nnodes} needs rdzv=etcd://HOST:PORT (the "
                                     "launchers of several nodes meet in etcd)")
        if self.spares < 0:
            raise InvalidOptionError(f"spares={self.spares} is invalid: expected >= 0")
        if self.max_restarts < 0 or (self.max_restarts and (
                self.world_size < 2 or not self.recover)):
            raise InvalidOptionError(f"max_restarts={self.max_restarts} is invalid: expected "
                                     ">= 0, with at least 2 workers in the job and recovery "
                                     "on (a restart joins the survivors)")
        if self.grow_back and self.rdzv is None:
            raise InvalidOptionError("grow_back=True needs rdzv=etcd://HOST:PORT (a node "
                                     "rejoins a job kept in etcd)")
        if self.etcd_outage_s < 0:
            raise InvalidOptionError(f"etcd_outage_s={self.etcd_outage_s} is invalid: "
                                     "expected >= 0")
        if self.node_ttl_s < 2:
            raise InvalidOptionError(f"node_ttl_s={self.node_ttl_s} is invalid: expected >= 2 "
                                     "(etcd's shortest lease)")

    @property
    def world_size(self) -> int:
        """Workers of the whole job (world 0)."""
        return self.nnodes * self.nproc

    @property
    def local_workers(self) -> range:
        """The ids of this node's workers (none when it rejoins a running job)."""
        if self.rejoin_first_id is not None:
            return range(0)
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)

    @property
    def spare_ids(self) -> range:
        """The ids of this node's spares (after every node's workers); every process of a
        node that rejoins a running job."""
        if self.rejoin_first_id is not None:
            return range(self.rejoin_first_id,
                         self.rejoin_first_id + self.nproc + self.spares)
        first = self.world_size + self.node_rank * self.spares
        return range(first, first + self.spares)

    @property
    def local_agents(self) -> list[int]:
        """Every agent this node starts: its workers', then its spares'."""
        return [*self.local_workers, *self.spare_ids]

    @property
    def hang_floor_s(self) -> float:
        """The hang threshold's floor the agents get: a survivor blocked on a dead peer's
        collective must never be taken for a hung worker."""
        return max(self.hang_min_s, self.collective_timeout_s + 10)


def worker_env(options: LaunchOptions, worker_id: int, *, coordinator: str, control: str,
               extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of worker ``worker_id`` at launch (world 0; `env.world_from_env`
    reads it back)."""
    o = options
    return {**(extra_env or {}), env.COORDINATOR: coordinator, env.PROCESS_ID: str(worker_id),
            env.NUM_PROCESSES: str(o.world_size), env.WORKER_ID: str(worker_id),
            env.GENERATION: "0", env.DEVICES_PER_PROC: str(o.devices_per_proc),
            env.HEARTBEAT_S: str(o.heartbeat_s),
            env.COLLECTIVE_TIMEOUT_S: str(o.collective_timeout_s), env.CONTROL: control,
            # Half the agreement deadline: a survivor that could not fetch the agreed
            # state agrees again at once, and the deadline of that next agreement must
            # not run out before the others' connect has timed out.
            env.ATTACH_TIMEOUT_S: str(max(1, round(o.agree_timeout_s / 2))),
            env.ONE_HOST: "1" if o.nnodes == 1 else "0", "JAX_PLATFORMS": "cpu"}
