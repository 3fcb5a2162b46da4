"""The per-host agent: the out-of-process half of the device proxy (no JAX import).

One agent runs beside each worker and is the worker's parent, so a worker's exit is seen at
once (``poll`` every 10 ms). It:

* owns the worker's snapshot buffer (`shm.SnapshotBuffer`), which survives the worker;
* watches the worker: exit, step progress (a message per published snapshot) and a hang
  watchdog (`watchdog.HangWatchdog`); a hung worker is killed and reported as failed;
* replicates every published snapshot to its ring successor's agent and keeps its
  predecessor's copies (`watchdog.ReplicaStore`), so losing a whole host loses no state;
* serves snapshots (its own worker's and the replicas) to any survivor on request;
* reports to the launcher over one persistent connection and obeys its commands (start,
  restart, kill the worker, change buddy, shut down).

Transport: plain TCP on loopback, framed by `protocol`. TCP works unchanged across hosts on a
cluster, has flow control, and needs nothing from JAX, whose collectives belong to the very
world that is failing (a gloo all-gather would die with the peer it is meant to survive).
Shared memory is used only between a worker and its own agent (same host, zero network).

Run as ``python -m mnemojax._src.distributed.agent --worker-id I --launcher HOST:PORT -- CMD``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from mnemojax._src.distributed import protocol
from mnemojax._src.distributed.agreement import CopyInfo
from mnemojax._src.distributed.env import AGENT
from mnemojax._src.distributed.errors import ChecksumError
from mnemojax._src.distributed.shm import SnapshotBuffer
from mnemojax._src.distributed.snapshot_codec import read_meta
from mnemojax._src.distributed.watchdog import HangWatchdog, ReplicaStore

logger = logging.getLogger("mnemojax")
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """This process gets SIGKILL when its parent dies (Linux PDEATHSIG), so nothing leaks.

    Called in the child itself (never as ``preexec_fn``: forking a multithreaded parent,
    like a JAX process, and running Python before ``exec`` can deadlock).
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


# Runs the worker command under PDEATHSIG, then execs it (same pid, same process group).
_EXEC_SHIM = ("import ctypes, os, signal, sys; "
              "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
              "os.getppid() == int(sys.argv[1]) or os._exit(1); "
              "os.execvp(sys.argv[2], sys.argv[2:])")


class Agent:
    """The agent's state and threads. `run` is its main loop (spawns, polls, watches)."""

    def __init__(self, *, worker_id: int, launcher: str, command: list[str],
                 hang_factor: float = 10.0, hang_min_s: float = 5.0, shm_prefix: str = "mnjx_"):
        self.worker_id, self.command = worker_id, command
        self.shm_prefix, self._segments = shm_prefix, 0
        self.watchdog = HangWatchdog(factor=hang_factor, min_s=hang_min_s)
        self.replicas = ReplicaStore()
        self.buffer: SnapshotBuffer | None = None
        self.budget_bytes: int | None = None  # host memory for snapshots (from the worker)
        self._refused_replicas = False
        self.worker: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._commands: queue.Queue = queue.Queue()
        self._publish = threading.Condition()
        self._published: int | None = None
        self._buddy: str | None = None
        self._stop = threading.Event()
        self._server, self.address = protocol.listen()
        self._launcher = protocol.connect(launcher, timeout_s=30)
        self._launcher.settimeout(None)
        self._send_lock = threading.Lock()

    def stop(self) -> None:
        """Asks the main loop to end (it kills the worker and removes the segment)."""
        self._stop.set()

    # -- launcher link -------------------------------------------------------------------
    def report(self, op: str, **fields) -> None:
        with self._send_lock:
            try:
                protocol.send_msg(self._launcher, {"op": op, "worker_id": self.worker_id,
                                                   **fields})
            except OSError:
                self._stop.set()  # the launcher is gone: nothing left to serve

    def _read_launcher(self) -> None:
        try:
            while True:
                self._commands.put(protocol.recv_msg(self._launcher)[0])
        except (OSError, ConnectionError):
            self._commands.put({"op": "shutdown"})

    # -- requests from workers and peer agents --------------------------------------------
    def _serve(self) -> None:
        protocol.accept_loop(self._server, self._handle, stop=self._stop)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    header, payload = protocol.recv_msg(conn)
                    reply = self._dispatch(header, payload)
                    if reply is not None:
                        protocol.send_msg(conn, *reply)
            except (OSError, ConnectionError):
                return

    def _dispatch(self, h: dict, payload: bytearray):
        op, now = h["op"], time.monotonic()
        if op == "alloc":
            with self._lock:
                self.budget_bytes = h.get("budget_bytes")
                if self.buffer is None or self.buffer.slot_bytes < h["nbytes"]:
                    if self.buffer is not None:
                        self.buffer.close()
                    self._segments += 1
                    self.buffer = SnapshotBuffer.create(
                        int(h["nbytes"]),
                        name=f"{self.shm_prefix}w{self.worker_id}_{self._segments}")
                return {"op": "ok", "name": self.buffer.name,
                        "slot_bytes": self.buffer.slot_bytes}, b""
        if op == "published":
            self.watchdog.progress(h["step"], now)
            self.report("progress", step=h["step"])
            with self._publish:
                self._published = h["step"]
                self._publish.notify()
            return None
        if op == "phase":
            self.watchdog.set_phase(h["phase"], now)
            return None
        if op == "replica":
            own = 2 * self.buffer.slot_bytes if self.buffer is not None else 0
            # The new copy is stored before the oldest one is evicted: this is the peak.
            if self.budget_bytes is not None and (
                    own + self.replicas.nbytes() + len(payload) > self.budget_bytes):
                if not self._refused_replicas:
                    self._refused_replicas = True
                    self.report("replica_refused", origin=h["origin"], step=h["step"],
                                budget_bytes=self.budget_bytes)
                return {"op": "error", "message": f"a replica of {len(payload)} bytes would "
                        f"exceed host_memory_budget_bytes={self.budget_bytes}"}, b""
            try:
                self.replicas.put(h["origin"], h["step"], payload, h["crc"])
            except ChecksumError as e:
                return {"op": "error", "message": str(e)}, b""
            return {"op": "ok"}, b""
        if op == "get":
            return self._get(h["origin"], h["step"])
        if op == "holdings":
            copies, corrupt = self._verified_copies()
            return {"op": "holdings", "copies": copies, "corrupt": corrupt}, b""
        return {"op": "error", "message": f"unknown op {op!r}"}, b""

    def _verified_copies(self) -> tuple[list[dict], list[dict]]:
        """Every copy held (own slots, buddies' replicas), each checked against its CRC32
        now, with what it covers; a corrupt copy is listed apart and never counted."""
        found, corrupt = [], []
        with self._lock:
            if self.buffer is not None:
                for step in sorted(self.buffer.holdings()):
                    try:
                        found.append((self.worker_id, self.buffer.read(step)[1]))
                    except (ChecksumError, KeyError) as e:
                        corrupt.append({"origin": self.worker_id, "step": step,
                                        "error": str(e)})
        good, bad = self.replicas.verify()
        found += [(origin, payload) for origin, _, payload in good]
        corrupt += [{"origin": o, "step": s, "error": "replica fails its CRC32 check"}
                    for o, s in bad]
        copies = []
        for origin, payload in found:
            try:
                meta = read_meta(payload)
                CopyInfo.from_meta(origin, meta)  # it must parse; the launcher parses it again
                copies.append({**meta, "origin": origin})
            except (ValueError, KeyError, TypeError) as e:  # not a snapshot payload
                corrupt.append({"origin": origin, "step": None, "error": f"metadata: {e}"})
        for c in corrupt:
            logger.warning("agent %d: corrupt copy of worker %s step %s: %s", self.worker_id,
                           c["origin"], c["step"], c["error"])
        return copies, corrupt

    def _get(self, origin: int, step: int):
        try:
            if origin == self.worker_id:
                with self._lock:
                    if self.buffer is None:
                        raise KeyError(step)
                    got, data, crc = self.buffer.read(step)
            else:
                data, crc = self.replicas.get(origin, step)
        except (KeyError, ChecksumError) as e:
            return {"op": "error", "message": f"no copy of worker {origin} step {step}: {e}"}, b""
        return {"op": "snapshot", "origin": origin, "step": step, "crc": crc}, data

    # -- buddy replication ----------------------------------------------------------------
    def _replicate(self) -> None:
        sock, sent, target = None, None, None
        while not self._stop.is_set():
            with self._publish:
                self._publish.wait_for(lambda last=sent: self._published != last
                                       or self._stop.is_set(), timeout=0.5)
                step, buddy = self._published, self._buddy
            if step is None or step == sent or buddy is None:
                continue
            try:
                with self._lock:
                    step, data, crc = self.buffer.read()
                if sock is None or target != buddy:
                    if sock is not None:
                        sock.close()
                    sock, target = protocol.connect(buddy), buddy
                protocol.send_msg(sock, {"op": "replica", "origin": self.worker_id,
                                         "step": step, "crc": crc}, data)
                protocol.recv_msg(sock)
                sent = step
            except (OSError, ConnectionError, KeyError, ChecksumError) as e:
                logger.warning("agent %d: replication to %s failed: %s", self.worker_id, buddy, e)
                if sock is not None:
                    sock.close()
                sock = None
                time.sleep(0.2)

    # -- the worker -------------------------------------------------------------------------
    def _spawn(self, env: dict[str, str]) -> None:
        full = {**os.environ, **env, AGENT: self.address}
        self.watchdog = HangWatchdog(factor=self.watchdog.factor, min_s=self.watchdog.min_s)
        self.worker = subprocess.Popen(
            [sys.executable, "-c", _EXEC_SHIM, str(os.getpid()), *self.command], env=full)
        self.report("worker_started", pid=self.worker.pid)

    def _kill_worker(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.kill()
            self.worker.wait()

    def run(self) -> int:
        """Main loop: hello, then commands, exit polling and the watchdog, until shutdown."""
        threading.Thread(target=self._serve, daemon=True).start()
        threading.Thread(target=self._read_launcher, daemon=True).start()
        threading.Thread(target=self._replicate, daemon=True).start()
        self.report("hello", address=self.address, pid=os.getpid())
        try:
            while not self._stop.is_set():
                try:
                    cmd = self._commands.get(timeout=0.01)
                except queue.Empty:
                    cmd = None
                if cmd is not None and self._command(cmd):
                    break
                if self.worker is not None and (code := self.worker.poll()) is not None:
                    self.report("worker_exit", code=code, pid=self.worker.pid)
                    self.worker = None
                idle = self.watchdog.hung(time.monotonic()) if self.worker else None
                if idle is not None:
                    self.report("hang", idle_s=idle, median_s=self.watchdog.median_s(),
                                step=self.watchdog.step)
                    self._kill_worker()  # a hung worker is a failed worker (fenced)
        finally:
            self._stop.set()
            self._kill_worker()
            self._server.close()
            with self._lock:
                if self.buffer is not None:
                    self.buffer.close()
        return 0

    def _command(self, cmd: dict) -> bool:
        op = cmd["op"]
        if op in ("start", "restart"):
            self._kill_worker()
            with self._publish:
                self._buddy = cmd.get("buddy", self._buddy)
            self._spawn(cmd["env"])
        elif op == "set_buddy":
            with self._publish:
                self._buddy = cmd["buddy"]
                self._publish.notify()
        elif op == "pause_watchdog":  # a peer failed: this worker may block up to the timeout
            self.watchdog.set_phase("recover", time.monotonic())
        elif op == "kill_worker":
            self._kill_worker()
        elif op == "shutdown":
            return True
        return False


def agent_command(*args: str) -> list[str]:
    """The command line that runs an agent without importing JAX.

    ``python -m mnemojax._src.distributed.agent`` would run ``mnemojax/__init__.py``, which
    imports JAX (about a second and 100+ MB per agent). The bootstrap registers a bare
    ``mnemojax`` package module first, so only this package's light modules are loaded.
    """
    import mnemojax
    pkg_dir = os.path.dirname(os.path.abspath(mnemojax.__file__))
    bootstrap = ("import sys, types; pkg = types.ModuleType('mnemojax'); "
                 f"pkg.__path__ = [{pkg_dir!r}]; sys.modules['mnemojax'] = pkg; "
                 "from mnemojax._src.distributed.agent import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", bootstrap, *args]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mnemojax._src.distributed.agent")
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--launcher", required=True, help="host:port of the launcher")
    p.add_argument("--hang-factor", type=float, default=10.0)
    p.add_argument("--hang-min-s", type=float, default=5.0)
    p.add_argument("--parent-pid", type=int, default=None, help="die with this parent")
    p.add_argument("--shm-prefix", default=f"mnjx{os.getpid()}_")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s agent %(message)s")
    agent = Agent(worker_id=args.worker_id, launcher=args.launcher, command=command,
                  hang_factor=args.hang_factor, hang_min_s=args.hang_min_s,
                  shm_prefix=args.shm_prefix)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())  # the main loop cleans up
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
