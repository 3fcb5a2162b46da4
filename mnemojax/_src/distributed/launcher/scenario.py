"""Run a multi-process job under the launcher and inject process faults from outside.

The faults are done to the processes the way real ones happen, never through a hook in the
recovery code: ``kill`` is a SIGKILL of the worker, ``host`` also kills its agent (the whole
host is gone, with its copy of the snapshot), ``hang`` stops the worker (SIGSTOP: no error,
no progress; only the agent's watchdog can notice), ``corrupt`` kills the worker and then
flips a bit in every snapshot its agent holds in shared memory (its own copy must not be
restored), ``kill_in_agreement`` kills the worker when it calls ``agree`` (it may die
before or after the decision), ``kill_after_decision`` kills it as soon as the
launcher has decided a new world that includes it (the others must agree again), and
``kill_in_compile`` kills it as soon as it starts compiling (its agent passes the
worker's ``compile`` phase on to the launcher): the others are compiling too, or waiting
at the barrier after the compile.
``stop_in_agreement`` is the scheduler's preemption notice (SIGTERM to the launcher) as
the victim calls ``agree`` in a recovery. ``freeze_spares`` stops every idle spare
(SIGSTOP) once the victim has published ``at_step``: listed with a kill at the same step,
the spares freeze as the worker dies, still offered to the world formed after it.
``intrude`` harms nothing by itself: an outsider without the job secret connects to the
launcher's port and to the victim's agent and sends forged requests (a ``hello`` that would
replace the agent's link, an ``agree``, an ``alloc`` that would wipe the replicas, a ``get``
that would read a snapshot); every one must be refused and the job must end exact.

A fault fires when its victim has published ``at_step`` (the agent's ``progress`` event);
the two agreement kinds and ``kill_in_compile`` fire at the first agreement (compile)
after every fault listed before them has fired: first listed, ``kill_in_compile`` kills
during the first compile; after a ``kill``, during the recovery's compile. ``python -m mnemojax launch`` is the same launcher without the faults.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence

from mnemojax._src.distributed import transport, wire
from mnemojax._src.distributed.launcher.launcher import Launcher
from mnemojax._src.distributed.launcher.options import LaunchOptions
from mnemojax._src.distributed.shm import SnapshotBuffer
from mnemojax._src.errors import InvalidOptionError, ProtocolError

KINDS = ("kill", "host", "hang", "corrupt", "kill_in_agreement", "kill_after_decision",
         "kill_in_compile", "intrude", "stop_in_agreement", "freeze_spares")
# Kinds that fire on an event of the recovery path, once every earlier fault has fired.
ORDERED_KINDS = ("kill_in_agreement", "kill_after_decision", "kill_in_compile",
                 "stop_in_agreement")


@dataclasses.dataclass(frozen=True)
class ProcessFault:
    """One fault done to worker ``victim`` once it has published step ``at_step``.

    Attributes:
        kind: ``kill``, ``host``, ``hang``, ``corrupt``, ``kill_in_agreement``,
            ``kill_after_decision``, ``kill_in_compile``, ``stop_in_agreement``,
            ``freeze_spares`` or ``intrude`` (module docstring).
        victim: the worker's stable id (its process id at launch).
        at_step: the step after which it fires (ignored by the agreement kinds and
            ``kill_in_compile``).
    """

    kind: str
    victim: int
    at_step: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidOptionError(f"kind={self.kind!r} is not a process fault: "
                                     f"expected one of {KINDS}")
        if self.victim < 0 or self.at_step < 0:
            raise InvalidOptionError(f"victim={self.victim}, at_step={self.at_step}: "
                                     "expected both >= 0")


def corrupt_agent_copies(segment: str, step: int | None = None) -> list[int]:
    """Flips a bit in the snapshots held in an agent's shared-memory segment.

    Args:
        segment: the segment's name (``/dev/shm/<segment>``).
        step: only this step's copy (default: every complete copy).

    Returns:
        The steps whose copies are now corrupt.
    """
    buffer = SnapshotBuffer.attach(segment)
    try:
        return buffer.flip_bit(step)
    finally:
        buffer.close()


def forged_requests_answered(address: str, messages: Sequence[wire.Message]) -> list[str]:
    """Sends each message, on its own raw connection, without the job secret, the way an
    outsider would (it skips the handshake: the server's challenge is read and ignored).

    Returns:
        What came back instead of the connection closing: ``[]`` when all were refused.
    """
    answered = []
    host, _, port = address.rpartition(":")
    for message in messages:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            try:
                transport.recv(sock)  # the challenge
                transport.send(sock, message)
                reply, _ = transport.recv(sock)
                answered.append(f"{message.OP} -> {reply.OP}")
            except (OSError, ConnectionError, ProtocolError):
                pass  # closed: refused
    return answered


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _segment_of(launcher: Launcher, worker: int) -> str | None:
    """The newest shared-memory segment of ``worker``'s agent (it grows by re-creating)."""
    names = glob.glob(f"/dev/shm/{launcher.shm_prefix}w{worker}_*")
    if not names:
        return None
    return os.path.basename(max(names, key=lambda n: int(n.rsplit("_", 1)[1])))


def run_scenario(cmd: Sequence[str], *, nproc: int, devices_per_proc: int = 2,
                 faults: Sequence[ProcessFault] = (), collective_timeout_s: int = 10,
                 heartbeat_s: int = 10, agree_timeout_s: float = 30.0,
                 hang_min_s: float = 3.0, job_timeout_s: float = 280.0,
                 extra_env: dict[str, str] | None = None, spares: int = 0,
                 max_restarts: int = 0) -> dict:
    """Runs ``cmd`` on ``nproc`` workers (and ``spares`` warm spares, ids ``nproc`` on;
    ``max_restarts``: `LaunchOptions.max_restarts`) under the launcher, firing ``faults``.

    Every process is ended by the launcher's cleanup, also on the job timeout.

    Returns:
        ``rc`` (the job's exit status), ``fired`` (each fault with its step and wall time),
        ``events`` (the launcher's), ``steps`` (worker id -> its newest published step),
        ``agents`` (worker id -> agent address), ``pids`` (every
        agent and worker started), ``shm_left`` (segments of this job still in /dev/shm),
        ``t0`` (wall time of the first fault) and ``launcher_knows_s`` (from the first
        fault to the launcher learning of it).
    """
    faults = list(faults)
    pending = list(faults)
    fired: list[dict] = []
    lock = threading.Lock()
    options = LaunchOptions(nproc=nproc, devices_per_proc=devices_per_proc,
                            heartbeat_s=heartbeat_s, collective_timeout_s=collective_timeout_s,
                            agree_timeout_s=agree_timeout_s, hang_factor=10.0,
                            hang_min_s=hang_min_s, job_timeout_s=job_timeout_s,
                            spares=spares, max_restarts=max_restarts)
    launcher = Launcher(options, list(cmd), extra_env=extra_env)

    def fire(fault: ProcessFault, event: dict) -> None:
        record = {"kind": fault.kind, "victim": fault.victim, "step": event.get("step"),
                  "t": time.time()}
        if fault.kind == "stop_in_agreement":  # (as the launcher's SIGTERM handler does)
            with launcher.roster.cv:
                launcher._stop_signals.append(signal.SIGTERM)
                launcher.roster.cv.notify_all()
            fired.append(record)
            return
        if fault.kind == "freeze_spares":
            with launcher.roster.cv:
                idle = [launcher.worker_pids[w] for w in sorted(launcher._idle)
                        if w in launcher.worker_pids]
            for pid in idle:
                os.kill(pid, signal.SIGSTOP)
            record["frozen"] = len(idle)
            fired.append(record)
            return
        if fault.kind == "intrude":
            v = fault.victim
            record["answered"] = forged_requests_answered(launcher.control, [
                wire.Hello(worker_id=v, address="127.0.0.1:1", pid=1),
                wire.Agree(worker_id=v, generation=0, last_step=0)]) + forged_requests_answered(
                launcher.agent_addr[v], [wire.Alloc(nbytes=4096, budget_bytes=None),
                                         wire.Get(origin=v, step=event.get("step") or 0)])
            fired.append(record)
            return
        try:
            worker = launcher.worker_pids[fault.victim]
            os.kill(worker, signal.SIGSTOP if fault.kind == "hang" else signal.SIGKILL)
            if fault.kind == "host":
                os.kill(launcher.agents[fault.victim].pid, signal.SIGKILL)
            if fault.kind == "corrupt":  # after the kill: no publish can follow the bit flip
                segment = _segment_of(launcher, fault.victim)
                record["corrupted_steps"] = corrupt_agent_copies(segment) if segment else []
        except (ProcessLookupError, KeyError) as e:  # the victim was already gone
            record["error"] = f"{type(e).__name__}: {e}"
        fired.append(record)

    def due(fault: ProcessFault, event: dict) -> bool:
        op = event["op"]
        if fault.kind in ORDERED_KINDS:
            earlier = faults[:faults.index(fault)]
            if any(f in pending for f in earlier):
                return False
            if fault.kind in ("kill_in_agreement", "stop_in_agreement"):
                return op == "agree" and event["worker_id"] == fault.victim
            if fault.kind == "kill_in_compile":
                return (op == "worker_phase" and event["worker_id"] == fault.victim
                        and event["phase"] == "compile")
            return op == "decided" and fault.victim in event["survivors"]
        return (op == "progress" and event["worker_id"] == fault.victim
                and event["step"] >= fault.at_step)

    def on_event(event: dict) -> None:
        if event["op"] not in ("progress", "agree", "decided", "worker_phase"):
            return
        with lock:
            for fault in list(pending):
                if due(fault, event):
                    pending.remove(fault)
                    threading.Thread(target=fire, args=(fault, event), daemon=True).start()

    launcher.on_event = on_event
    rc = launcher.run()
    t0 = min((f["t"] for f in fired), default=None)
    knows = [e["t"] for e in launcher.events if t0 is not None and e["t"] >= t0
             and e["op"] in ("worker_exit", "agent_lost", "hang")]
    return {
        "rc": rc, "fired": fired, "unfired": [dataclasses.asdict(f) for f in pending],
        "events": launcher.events, "steps": dict(launcher.steps), "t0": t0,
        "launcher_knows_s": round(min(knows) - t0, 3) if knows else None,
        "agents": {e["worker_id"]: e["address"] for e in launcher.events if e["op"] == "hello"},
        "pids": [p.pid for p in launcher.agents.values()] + list(launcher.worker_pids.values()),
        "shm_left": [n for n in os.listdir("/dev/shm") if n.startswith(launcher.shm_prefix)],
    }
