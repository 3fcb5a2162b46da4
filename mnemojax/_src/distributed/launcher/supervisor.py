"""The agent processes: started by the launcher, each in its own process group.

Every agent runs in its own session (process group) and its worker in the same group, both
with PDEATHSIG (set in the child): cleanup kills the groups (SIGTERM, then SIGKILL after a
grace period), so nothing outlives the launcher. Shared-memory segments carry the job's
prefix, so the ones of agents that were SIGKILLed (no cleanup runs) are swept at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

from mnemojax._src import spawner
from mnemojax._src.distributed import auth
from mnemojax._src.distributed.agent.bootstrap import agent_command
from mnemojax._src.distributed.launcher.options import LaunchOptions
from mnemojax._src.distributed.shm import sweep

logger = logging.getLogger("mnemojax")


class AgentSupervisor:
    """Starts one agent per worker and ends them all.

    Args:
        options: the job's options (count, hang rule, grace).
        command: the worker command each agent runs.
        control: the launcher's control endpoint (``host:port``).
        shm_prefix: the job's shared-memory prefix.
        secret: the job secret, handed to each agent in its environment (never its
            command line, which other users can read in ``/proc``).

    Attributes:
        agents: worker id -> agent ``Popen`` (its pid is its process group's id).
    """

    def __init__(self, options: LaunchOptions, command: Sequence[str], *, control: str,
                 shm_prefix: str, secret: bytes):
        self.options, self.command = options, list(command)
        self.control, self.shm_prefix = control, shm_prefix
        self._secret = secret
        self.agents: dict[int, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        for w in self.options.local_agents:
            self.start_agent(w)

    def start_agent(self, w: int) -> None:
        """Starts the agent of worker ``w`` (it says hello to the launcher, then waits to
        be told to start its worker)."""
        o = self.options
        # (From the spawning thread: the agent's PDEATHSIG would fire when the thread that
        # started it ends, e.g. the link thread of the dead agent whose worker it restarts.)
        self.agents[w] = spawner.popen(
            agent_command(
                "--worker-id", str(w), "--launcher", self.control,
                "--parent-pid", str(os.getpid()), "--shm-prefix", self.shm_prefix,
                "--hang-factor", str(o.hang_factor), "--hang-min-s", str(o.hang_floor_s),
                "--host", o.host,
                "--", *self.command),
            env={**os.environ, **auth.secret_env(self._secret)},
            start_new_session=True)

    def kill_group(self, worker_id: int, sig: int) -> None:
        """Signals an agent's process group (the agent and its worker)."""
        proc = self.agents.get(worker_id)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def stop(self) -> None:
        """Waits ``grace_s`` for the agents (told to shut down) to end their workers and
        segments, then SIGTERMs, then SIGKILLs every group. Idempotent."""
        deadline = time.monotonic() + self.options.grace_s
        for proc in self.agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for w, proc in self.agents.items():
                if proc.poll() is None or sig == signal.SIGKILL:
                    self.kill_group(w, sig)  # the group also holds the worker
            for proc in self.agents.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            deadline = time.monotonic() + self.options.grace_s

    def sweep_segments(self) -> None:
        """Removes the job's leftover segments (of agents that were SIGKILLed), not its
        lock file (the launcher releases it after)."""
        for name in sweep(self.shm_prefix, with_lock=False):
            logger.info("removed leftover shared memory %s", name)
