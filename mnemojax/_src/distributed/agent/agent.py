"""The per-host agent: the out-of-process half of the device proxy (no JAX import).

One agent runs beside each worker and is the worker's parent, so a worker's exit is seen at
once (``poll`` every 10 ms). It:

* owns the worker's snapshot slots, which survive the worker (`snapshots.SnapshotHolder`);
* watches the worker: exit, step progress (a message per published snapshot) and a hang
  watchdog (`watchdog.HangWatchdog`); a hung worker is killed and reported as failed;
* replicates every published snapshot to its ring successor's agent
  (`replication.Replicator`) and keeps its predecessor's copies, so losing a whole host
  loses no state;
* serves snapshots (its own worker's and the replicas) to any survivor on request
  (`server.AgentServer`);
* reports to the launcher over one persistent connection and obeys its commands (start
  the worker, kill it, change buddy, pause the watchdog, shut down) (`launcher_link`).

Shared memory is used only between a worker and its own agent (same host, zero network).
Started by the launcher through `bootstrap.agent_command`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence

from mnemojax._src.distributed import shm, wire
from mnemojax._src.distributed.agent.launcher_link import LauncherLink
from mnemojax._src.distributed.agent.replication import Replicator
from mnemojax._src.distributed.agent.server import AgentServer
from mnemojax._src.distributed.agent.snapshots import SnapshotHolder
from mnemojax._src.distributed.agent.watchdog import HangWatchdog
from mnemojax._src.distributed.agent.worker_process import WorkerProcess
from mnemojax._src.distributed.env import AGENT


class Agent:
    """One agent: its parts, and `run`, its main loop (commands, exit polling, watchdog).

    Args:
        worker_id: its worker's stable id.
        launcher: the launcher's control endpoint (``host:port``).
        command: the worker's command line.
        hang_factor, hang_min_s: the hang rule (`watchdog.HangWatchdog`).
        shm_prefix: the job's shared-memory prefix.
        secret: the job secret (`auth`): proves every connection it opens and is required
            of every connection it accepts. Its worker inherits it with the environment.
        host: the address it serves copies on (other nodes' agents and launchers reach it
            there; loopback on one machine).
    """

    def __init__(self, *, worker_id: int, launcher: str, command: Sequence[str],
                 hang_factor: float = 10.0, hang_min_s: float = 5.0, shm_prefix: str = "mnjx_",
                 secret: bytes, host: str = "127.0.0.1"):
        self.worker_id = worker_id
        self._stop = threading.Event()
        self._stop_requested = False  # set by `stop` (a signal handler): no lock taken
        self.watchdog = HangWatchdog(factor=hang_factor, min_s=hang_min_s)
        self.link = LauncherLink(launcher, on_lost=self._stop.set, secret=secret)
        self._shm_prefix = shm_prefix
        self._launcher_pid = os.getppid()  # (the launcher starts its agents)
        self.snapshots = SnapshotHolder(worker_id, shm_prefix=shm_prefix,
                                        report=self.link.report)
        self.replicator = Replicator(worker_id, self.snapshots, self._stop, secret=secret)
        self.worker = WorkerProcess(command, worker_id)
        self.server = AgentServer(worker_id, holder=self.snapshots, replicator=self.replicator,
                                  watchdog=self.watchdog, report=self.link.report,
                                  stop=self._stop, secret=secret, host=host)
        self.address = self.server.address

    def stop(self) -> None:
        """Asks the main loop to end (it kills the worker and removes the segment).

        Safe in a signal handler (SIGTERM, also the PDEATHSIG when the launcher dies): it
        only sets a flag. Setting the `threading.Event` there could deadlock, when the
        handler interrupts the main thread while it holds that event's lock (it sets it
        itself when the launcher's link breaks).
        """
        self._stop_requested = True

    def run(self) -> int:
        """Main loop: hello, then commands, exit polling and the watchdog, until shutdown."""
        self.server.start()
        self.link.start()
        threading.Thread(target=self.replicator.run, daemon=True).start()
        self.link.report(wire.Hello(worker_id=self.worker_id, address=self.address,
                                    pid=os.getpid()))
        try:
            while not self._stop.is_set() and not self._stop_requested:
                try:
                    command = self.link.commands.get(timeout=0.01)
                except queue.Empty:
                    command = None
                if command is not None and self._obey(command):
                    break
                if (ended := self.worker.collect_exit()) is not None:
                    code, pid = ended
                    self.link.report(wire.WorkerExit(worker_id=self.worker_id, code=code,
                                                     pid=pid))
                idle = self.watchdog.hung(time.monotonic()) if self.worker.running else None
                if idle is not None:
                    self.link.report(wire.Hang(worker_id=self.worker_id, idle_s=idle,
                                               median_s=self.watchdog.median_s(),
                                               step=self.watchdog.step))
                    self.worker.kill()  # a hung worker is a failed worker (fenced)
        finally:
            self._stop.set()
            self.worker.kill()
            self.worker.flush()  # its last lines (a traceback) before this process ends
            self.server.close()
            self.snapshots.close()
            # The launcher killed first (this is its PDEATHSIG): the last agent out removes
            # what is left of the job's shared memory, its lock file at least. The signal
            # may come before the dying launcher's last thread lets go of the lock.
            # A signal (the PDEATHSIG) may also come from the end of the launcher's thread
            # that started this agent while the rest of the dying launcher still holds the
            # lock (its parent pid unchanged yet): wait for the lock then too.
            launcher_gone = os.getppid() != self._launcher_pid or self._stop_requested
            shm.sweep_if_orphaned(self._shm_prefix, wait_s=2.0 if launcher_gone else 0.0)
        return 0

    def _obey(self, command: wire.Command) -> bool:
        """Carries out a launcher command; True: shut down."""
        if isinstance(command, wire.Start):
            self.worker.kill()
            self.replicator.set_buddy(command.buddy)
            self.watchdog.reset()
            pid = self.worker.spawn({**command.env, AGENT: self.address})
            self.link.report(wire.WorkerStarted(worker_id=self.worker_id, pid=pid))
        elif isinstance(command, wire.SetBuddy):
            if command.keep_from is not None:
                self.snapshots.replicas.forget_before(command.keep_from,
                                                      resumed=command.resume_step)
            self.replicator.set_buddy(command.buddy, resume_step=command.resume_step)
        elif isinstance(command, wire.PauseWatchdog):  # a peer failed: we may block a while
            self.watchdog.set_phase("recover", time.monotonic())
        elif isinstance(command, wire.KillWorker):
            self.worker.kill()
        elif isinstance(command, wire.Shutdown):
            return True
        return False
