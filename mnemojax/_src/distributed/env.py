"""The world a worker belongs to, read from the environment (no JAX import).

`mnemojax launch` sets ``MNEMOJAX_*`` variables; on a SLURM cluster the same code falls back
to ``SLURM_*`` (one task per host, coordinator on the first node of the job).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping

from mnemojax._src.distributed import auth
from mnemojax._src.errors import WorldConfigError

COORDINATOR = "MNEMOJAX_COORDINATOR"
PROCESS_ID = "MNEMOJAX_PROCESS_ID"
NUM_PROCESSES = "MNEMOJAX_NUM_PROCESSES"
DEVICES_PER_PROC = "MNEMOJAX_DEVICES_PER_PROC"
HEARTBEAT_S = "MNEMOJAX_HEARTBEAT_S"
COLLECTIVE_TIMEOUT_S = "MNEMOJAX_COLLECTIVE_TIMEOUT_S"
CONTROL = "MNEMOJAX_CONTROL"  # launcher's agreement endpoint, host:port
AGENT = "MNEMOJAX_AGENT"  # this worker's agent, host:port
GENERATION = "MNEMOJAX_GENERATION"
WORKER_ID = "MNEMOJAX_WORKER_ID"  # stable id of the host slot (process id at launch)
ATTACH_TIMEOUT_S = "MNEMOJAX_ATTACH_TIMEOUT_S"
PEER_WATCH = "MNEMOJAX_PEER_WATCH"  # "0": no `worker.peer_watch` (collective timeout only)
# A worker restarted into a running job (its previous process died with its world's
# coordination service): the agreement of the world it joins, as `wire.AgreementReply`
# JSON. `ResilientStep.restore` takes the agreed state from the agents' copies.
RESUME = "MNEMOJAX_RESUME"
# "1": this process is a warm spare: `initialize` waits (`wire.AwaitJoin`) until a world
# takes it in, then joins it as with RESUME.
SPARE = "MNEMOJAX_SPARE"
# "1": every process of the job runs on one host (the launcher's ``--nnodes 1``), so they
# share one persistent compilation cache directory (`CompileOptions.ahead_compilers`).
ONE_HOST = "MNEMOJAX_ONE_HOST"
SLURM_DEFAULT_PORT = 8476


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldSpec:
    """One worker's place in the job.

    Attributes:
        coordinator: ``host:port`` of the JAX coordination service.
        process_id: this worker's rank, ``0 <= process_id < num_processes``.
        num_processes: number of worker processes in the world.
        devices_per_proc: CPU devices per process (None: leave JAX's default).
        heartbeat_s: coordination-service heartbeat timeout.
        collective_timeout_s: bound on a CPU (gloo) collective.
        control: ``host:port`` of the launcher's agreement endpoint (None outside a launch).
        agent: ``host:port`` of this worker's agent (None outside a launch).
        generation: world generation (0 at launch, +1 per re-initialisation).
        worker_id: stable id of this worker's host slot (its process id at launch; kept
            when a re-initialisation renumbers the processes). None: same as process_id.
        attach_timeout_s: how long joining a survivors' world may wait for its members;
            when one died after the agreement, the others agree again after this long.
        secret: the job secret that authenticates every connection to the launcher and
            the agents (``MNEMOJAX_JOB_SECRET``, `auth`); required with ``control`` or
            ``agent``. Never shown by ``repr``.
    """

    coordinator: str
    process_id: int
    num_processes: int
    devices_per_proc: int | None = None
    heartbeat_s: int = 10
    collective_timeout_s: int = 20
    control: str | None = None
    agent: str | None = None
    generation: int = 0
    worker_id: int | None = None
    attach_timeout_s: int = 60
    secret: bytes | None = dataclasses.field(default=None, repr=False)

    @property
    def stable_id(self) -> int:
        """The worker id, or the process id when none was given."""
        return self.process_id if self.worker_id is None else self.worker_id

    def __post_init__(self):
        if self.num_processes < 1:
            raise WorldConfigError(f"num_processes={self.num_processes} is invalid: expected >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise WorldConfigError(
                f"process_id={self.process_id} is invalid: expected 0 <= id < {self.num_processes}")
        if self.devices_per_proc is not None and self.devices_per_proc < 1:
            raise WorldConfigError(
                f"devices_per_proc={self.devices_per_proc} is invalid: expected >= 1")
        if self.heartbeat_s < 1 or self.collective_timeout_s < 1:
            raise WorldConfigError("heartbeat_s and collective_timeout_s must be >= 1 s")
        split_address(self.coordinator)
        if (self.control or self.agent) and not self.secret:
            raise WorldConfigError(f"{auth.JOB_SECRET} is not set: the launcher's and the "
                                   "agents' connections need the job secret")


def one_host(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher runs every process of the job on this one host (`ONE_HOST`)."""
    return (os.environ if environ is None else environ).get(ONE_HOST) == "1"


def split_address(address: str) -> tuple[str, int]:
    """Splits ``host:port`` (IPv6 hosts in brackets) into (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise WorldConfigError(f"address={address!r} is invalid: expected host:port")
    return host.strip("[]"), int(port)


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise WorldConfigError(f"{name}={raw!r} is invalid: expected an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist: ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise WorldConfigError(f"SLURM_JOB_NODELIST={nodelist!r} is invalid")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def world_from_env(env: Mapping[str, str] | None = None) -> WorldSpec:
    """Reads the worker's world from ``MNEMOJAX_*``, else ``SLURM_*``.

    Args:
        env: the environment (default ``os.environ``).

    Returns:
        The validated `WorldSpec`.

    Raises:
        WorldConfigError: neither source describes a complete world, or a value is invalid.
    """
    env = os.environ if env is None else env
    world = functools.partial(
        WorldSpec,
        devices_per_proc=_int(env, DEVICES_PER_PROC),
        heartbeat_s=_int(env, HEARTBEAT_S) or 10,
        collective_timeout_s=_int(env, COLLECTIVE_TIMEOUT_S) or 20,
        control=env.get(CONTROL) or None,
        agent=env.get(AGENT) or None,
        generation=_int(env, GENERATION) or 0,
        worker_id=_int(env, WORKER_ID),
        attach_timeout_s=_int(env, ATTACH_TIMEOUT_S) or 60,
        secret=auth.secret_from_env(env),
    )
    if env.get(COORDINATOR):
        pid, n = _int(env, PROCESS_ID), _int(env, NUM_PROCESSES)
        if pid is None or n is None:
            raise WorldConfigError(f"{COORDINATOR} is set but {PROCESS_ID} or {NUM_PROCESSES} is not")
        return world(coordinator=env[COORDINATOR], process_id=pid, num_processes=n)
    if env.get("SLURM_JOB_ID"):
        pid = _int(env, "SLURM_PROCID")
        n = _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if pid is None or n is None or not nodelist:
            raise WorldConfigError("SLURM_JOB_ID is set but SLURM_PROCID/SLURM_NTASKS/"
                                   "SLURM_JOB_NODELIST are incomplete")
        port = SLURM_DEFAULT_PORT + int(env["SLURM_JOB_ID"]) % 1000
        return world(coordinator=f"{first_slurm_host(nodelist)}:{port}", process_id=pid,
                     num_processes=n)
    raise WorldConfigError(f"no world in the environment: set {COORDINATOR}, {PROCESS_ID} and "
                           f"{NUM_PROCESSES} (mnemojax launch does), or run under SLURM")
