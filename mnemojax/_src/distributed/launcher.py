"""The launcher: hosts the coordination service, starts one agent per worker, coordinates.

`Launcher.run` is the whole job: start the control endpoint and the agents, wait for every
agent's hello, start the recoverable coordination service of world 0, tell each agent to
start its worker (environment: `env.WorldSpec` fields) and who its ring buddy is, then serve
agent events and the survivors' agreement calls (`agreement` module docstring) until the
current world's workers have all exited. Every agent runs in its own session (process
group) and its worker in the same group, both with PDEATHSIG (set in the child): cleanup kills the groups
(SIGTERM, then SIGKILL after a grace period), so nothing outlives the launcher.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from mnemojax._src.distributed import coordination, env, protocol
from mnemojax._src.distributed.agent import agent_command
from mnemojax._src.distributed.agreement import AgreementBook, CopyInfo, agreement_to_json
from mnemojax._src.distributed.errors import AgreementError, DistributedError
from mnemojax._src.distributed.shm import sweep
from mnemojax._src.errors import InvalidOptionError

logger = logging.getLogger("mnemojax")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How to launch. Durations in seconds.

    Attributes:
        nproc: worker processes (one agent each, one "host" each).
        devices_per_proc: CPU devices per worker.
        heartbeat_s: coordination-service heartbeat timeout (>= 10 on 2 cores, DESIGN §4).
        collective_timeout_s: bound on a gloo collective; a survivor blocked on a dead peer
            learns of the failure after at most this long.
        hang_factor: hang = no step for this multiple of the median step time.
        hang_min_s: floor of the hang threshold; raised to ``collective_timeout_s + 10`` so a
            survivor blocked on a dead peer's collective is never mistaken for a hung one.
        agree_timeout_s: members not at the agreement barrier by then are evicted (killed);
            half of it is how long survivors wait to join the new world before agreeing
            again (a member died after the decision).
        recover: False: any worker failure ends the job (the failure's exit status).
        job_timeout_s: kill everything after this long (None: no limit).
        grace_s: SIGTERM-to-SIGKILL grace at cleanup.
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

    def __post_init__(self):
        for name in ("nproc", "devices_per_proc", "heartbeat_s", "collective_timeout_s"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name}={getattr(self, name)} is invalid: expected >= 1")
        if self.hang_factor <= 1 or self.agree_timeout_s <= 0 or self.grace_s < 0:
            raise InvalidOptionError("hang_factor must be > 1, agree_timeout_s > 0, grace_s >= 0")


class Launcher:
    """Runs one job. ``on_event(event)`` sees every agent event (tests and demos use it).

    Attributes:
        events: every event received, each with ``t`` (``time.time()``).
        agents: worker id -> agent ``Popen``; ``worker_pids``: worker id -> worker pid.
    """

    def __init__(self, options: LaunchOptions, command: Sequence[str], *,
                 extra_env: dict[str, str] | None = None,
                 on_event: Callable[[dict], None] | None = None):
        self.options, self.command = options, list(command)
        self.extra_env = dict(extra_env or {})
        self.on_event = on_event
        self.events: list[dict] = []
        self.agents: dict[int, subprocess.Popen] = {}
        self.worker_pids: dict[int, int] = {}
        self.agent_addr: dict[int, str] = {}
        self.exit_codes: dict[int, int] = {}
        self._links: dict[int, socket.socket] = {}
        self._cv = threading.Condition()
        self._services: dict[int, coordination.CoordinationService] = {}
        self._book = AgreementBook(0, range(options.nproc))
        self._worlds: dict[int, tuple[int, ...]] = {0: self._book.members}  # gen -> members
        self._failed_code: int | None = None
        self._server, self.control = protocol.listen()
        self.shm_prefix = f"mnjx{os.getpid()}_{secrets.token_hex(3)}_"

    # -- event and request handling ---------------------------------------------------------
    def _record(self, event: dict) -> None:
        event = {**event, "t": time.time()}
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def _accept(self) -> None:
        protocol.accept_loop(self._server, self._handle)

    def _handle(self, conn: socket.socket) -> None:
        try:
            header, _ = protocol.recv_msg(conn)
        except (OSError, ConnectionError):
            conn.close()
            return
        if header["op"] == "hello":
            self._agent_link(conn, header)
            return
        with conn:
            try:
                reply = self._request(header)
            except AgreementError as e:
                reply = {"op": "error", "message": str(e)}
            with contextlib.suppress(OSError):
                protocol.send_msg(conn, reply)

    def _agent_link(self, conn: socket.socket, hello: dict) -> None:
        w = hello["worker_id"]
        with self._cv:
            self._links[w], self.agent_addr[w] = conn, hello["address"]
            self._cv.notify_all()
        self._record(hello)
        try:
            while True:
                event, _ = protocol.recv_msg(conn)
                self._record(event)
                with self._cv:
                    if event["op"] == "worker_started":
                        self.worker_pids[w] = event["pid"]
                    elif event["op"] == "worker_exit":
                        self._worker_gone(w, event["code"])
                    self._cv.notify_all()
        except (OSError, ConnectionError):
            self._record({"op": "agent_lost", "worker_id": w})
            with self._cv:
                self._links.pop(w, None)
                self.agent_addr.pop(w, None)
                self._worker_gone(w, -signal.SIGKILL)
                self._cv.notify_all()
            self._kill_group(w, signal.SIGKILL)  # fence a worker whose agent vanished

    def _worker_gone(self, w: int, code: int) -> None:
        if w in self.exit_codes:
            return
        self.exit_codes[w] = code
        if code != 0:
            self._book.mark_dead(w)
            for m in self._links:  # survivors may now block for up to the collective timeout
                if m != w:
                    self._command(m, {"op": "pause_watchdog"})
            self._failed_code = 128 - code if code < 0 else code  # the newest failure

    def _request(self, h: dict) -> dict:
        op, w = h["op"], h["worker_id"]
        if op == "report_failure":
            self._record(h)
            return {"op": "ok"}
        if op == "agree":
            self._record(h)
            return {"op": "agreement", "agreement": agreement_to_json(self._agree(w, h))}
        raise AgreementError(f"unknown op {op!r}", generation=-1)

    def _agree(self, w: int, h: dict):
        with self._cv:
            book = self._book
            book.arrive(w, h["generation"], h["last_step"], h.get("first_replayable"))
            self._cv.notify_all()
            deadline = time.monotonic() + self.options.agree_timeout_s
            while book.decision is None and not book.complete():
                left = deadline - time.monotonic()
                if left <= 0:
                    for m in book.missing():  # evict: it can never join a later world
                        self._record({"op": "evicted", "worker_id": m})
                        book.mark_dead(m)
                        self._command(m, {"op": "kill_worker"})
                    break
                self._cv.wait(timeout=min(left, 0.5))
            if book.decision is None:
                self._decide(book)
            if w not in book.decision:  # it died while waiting: it is not in the new world
                raise AgreementError(f"worker {w} died during the agreement",
                                     generation=book.generation)
            return book.decision[w]

    def _holdings(self) -> dict[str, list[CopyInfo]]:
        """Asks every live agent, at once, for its copies (each CRC-checked by the agent)."""
        def ask(addr):
            try:
                return protocol.request(addr, {"op": "holdings"}, timeout_s=60)[0]
            except (OSError, ConnectionError, protocol.ProtocolError):
                return None  # an agent that cannot answer holds nothing we can use
        addrs = list(self.agent_addr.values())
        with concurrent.futures.ThreadPoolExecutor(max(1, len(addrs))) as pool:
            replies = list(pool.map(ask, addrs))
        holdings = {}
        for addr, reply in zip(addrs, replies, strict=True):
            if reply is None:
                continue
            holdings[addr] = [CopyInfo.from_meta(c["origin"], c) for c in reply["copies"]]
            for bad in reply["corrupt"]:
                self._record({"op": "corrupt_copy", "agent": addr, **bad})
        return holdings

    def _decide(self, book: AgreementBook) -> None:
        holdings = self._holdings()
        survivors = [m for m in book.members if m in book.arrived]
        service = self._start_service(book.generation + 1, len(survivors))
        try:
            decision = book.decide(coordinator=service.address, holdings=holdings,
                                   homes=self.agent_addr, members_of=self._worlds)
        except AgreementError:
            self._services.pop(book.generation + 1, None)
            service.shutdown()
            raise
        first = decision[survivors[0]]
        self._record({"op": "decided", "generation": book.generation + 1,
                      "survivors": survivors, "resume_step": first.resume_step,
                      "lost": list(first.lost)})
        self._book = AgreementBook(book.generation + 1, survivors)
        self._worlds[book.generation + 1] = tuple(survivors)
        old = self._services.pop(book.generation, None)
        if old is not None:  # service last: every survivor detached before it arrived
            old.shutdown()
            self._record({"op": "old_service_stopped", "generation": book.generation})
        live = [m for m in survivors if m in self._links]
        for i, m in enumerate(live):  # the new ring over the survivors' agents
            self._command(m, {"op": "set_buddy", "buddy": self.agent_addr[live[(i + 1) % len(live)]]
                              if len(live) > 1 else None})
        self._cv.notify_all()

    # -- processes -----------------------------------------------------------------------------
    def _command(self, w: int, cmd: dict) -> None:
        conn = self._links.get(w)
        if conn is not None:
            with contextlib.suppress(OSError):
                protocol.send_msg(conn, cmd)

    def _start_service(self, generation: int, n: int) -> coordination.CoordinationService:
        svc = coordination.start_service(protocol.free_port(), n,
                                         heartbeat_s=self.options.heartbeat_s)
        self._services[generation] = svc
        return svc

    def worker_env(self, w: int, service: coordination.CoordinationService) -> dict[str, str]:
        o = self.options
        return {**self.extra_env, env.COORDINATOR: service.address, env.PROCESS_ID: str(w),
                env.NUM_PROCESSES: str(o.nproc), env.WORKER_ID: str(w), env.GENERATION: "0",
                env.DEVICES_PER_PROC: str(o.devices_per_proc), env.HEARTBEAT_S: str(o.heartbeat_s),
                env.COLLECTIVE_TIMEOUT_S: str(o.collective_timeout_s), env.CONTROL: self.control,
                # Half the agreement deadline: a survivor that could not fetch the agreed
                # state agrees again at once, and the deadline of that next agreement must
                # not run out before the others' connect has timed out.
                env.ATTACH_TIMEOUT_S: str(max(1, round(o.agree_timeout_s / 2))),
                "JAX_PLATFORMS": "cpu"}

    def _start(self) -> None:
        o = self.options
        threading.Thread(target=self._accept, daemon=True).start()
        for w in range(o.nproc):
            self.agents[w] = subprocess.Popen(
                agent_command(
                    "--worker-id", str(w), "--launcher", self.control,
                    "--parent-pid", str(os.getpid()), "--shm-prefix", self.shm_prefix,
                    "--hang-factor", str(o.hang_factor),
                    "--hang-min-s", str(max(o.hang_min_s, o.collective_timeout_s + 10)),
                    "--", *self.command),
                start_new_session=True)
        with self._cv:
            if not self._cv.wait_for(lambda: len(self.agent_addr) == o.nproc, timeout=60):
                raise DistributedError(f"only {len(self.agent_addr)}/{o.nproc} agents said hello")
        service = self._start_service(0, o.nproc)
        for w in range(o.nproc):
            buddy = self.agent_addr[(w + 1) % o.nproc] if o.nproc > 1 else None
            self._command(w, {"op": "start", "env": self.worker_env(w, service), "buddy": buddy})

    def _finished(self) -> int | None:
        if self._failed_code is not None and not self.options.recover:
            return self._failed_code
        current = [m for m in self._book.members if m not in self._book.dead]
        if not current:
            return self._failed_code if self._failed_code is not None else 1
        if all(self.exit_codes.get(m) == 0 for m in current):
            return 0
        return None

    def run(self) -> int:
        """Runs the job; returns its exit status (0 when the final world's workers all exit 0)."""
        t_end = None if self.options.job_timeout_s is None else (
            time.monotonic() + self.options.job_timeout_s)
        try:
            self._start()
            with self._cv:
                while (rc := self._finished()) is None:
                    if t_end is not None and time.monotonic() > t_end:
                        self._record({"op": "job_timeout"})
                        return 124
                    self._cv.wait(timeout=0.2)
            return rc
        except KeyboardInterrupt:
            return 130
        finally:
            self.cleanup()

    def _kill_group(self, w: int, sig: int) -> None:
        proc = self.agents.get(w)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def cleanup(self) -> None:
        """Ends every agent and worker (process groups), then the services. Idempotent."""
        for w in list(self._links):
            self._command(w, {"op": "shutdown"})
        deadline = time.monotonic() + self.options.grace_s
        for proc in self.agents.values():  # let them end their workers and segments
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for w, proc in self.agents.items():
                if proc.poll() is None or sig == signal.SIGKILL:
                    self._kill_group(w, sig)  # the group also holds the worker
            for proc in self.agents.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            deadline = time.monotonic() + self.options.grace_s
        self._server.close()
        for name in sweep(self.shm_prefix):  # segments of agents that were SIGKILLed
            logger.info("removed leftover shared memory %s", name)
        for svc in list(self._services.values()):
            svc.shutdown()
        self._services.clear()
