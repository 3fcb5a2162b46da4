"""The worker process an agent runs: its child, so its exit is seen at once (``poll``).

Its standard error reaches the launcher's through the agent, each line prefixed with
``[worker N]`` (several workers share one terminal or log: a warning, a traceback must
say whose it is); its standard output is left alone (a program's own output, parsed by
whatever reads it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import BinaryIO

# Runs the worker command under PDEATHSIG, then execs it (same pid, same process group).
# In the child, never as ``preexec_fn``: forking a multithreaded parent and running
# Python before ``exec`` can deadlock.
_EXEC_SHIM = ("import ctypes, os, signal, sys; "
              "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
              "os.getppid() == int(sys.argv[1]) or os._exit(1); "
              "os.execvp(sys.argv[2], sys.argv[2:])")


class WorkerProcess:
    """At most one running worker; it dies with the agent (PDEATHSIG).

    Args:
        command: the worker's command line.
        worker_id: prefixes each line of its standard error (``[worker N] ``).
    """

    def __init__(self, command: Sequence[str], worker_id: int):
        self.command = list(command)
        self.prefix = f"[worker {worker_id}] ".encode()
        self._proc: subprocess.Popen[bytes] | None = None
        self._relays: list[threading.Thread] = []

    @property
    def running(self) -> bool:
        """A worker was started and its exit has not been collected yet."""
        return self._proc is not None

    def spawn(self, env: Mapping[str, str]) -> int:
        """Starts the worker with ``env`` added to this process's environment; its pid."""
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_SHIM, str(os.getpid()), *self.command],
            env={**os.environ, **env}, stderr=subprocess.PIPE)
        assert self._proc.stderr is not None
        relay = threading.Thread(target=_relay, args=(self._proc.stderr, self.prefix),
                                 name="mnemojax-worker-stderr", daemon=True)
        relay.start()
        self._relays = [t for t in self._relays if t.is_alive()] + [relay]
        return self._proc.pid

    def flush(self, timeout_s: float = 1.0) -> None:
        """Waits up to ``timeout_s`` for what ended workers wrote to reach this process's
        standard error (their last lines: a traceback)."""
        for relay in self._relays:
            relay.join(timeout=timeout_s)

    def collect_exit(self) -> tuple[int, int] | None:
        """(exit status, pid) once the worker has exited (then it is forgotten), else None."""
        if self._proc is None or (code := self._proc.poll()) is None:
            return None
        pid, self._proc = self._proc.pid, None
        return code, pid

    def kill(self) -> None:
        """SIGKILLs a running worker and reaps it (`collect_exit` still returns its exit)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _relay(pipe: BinaryIO, prefix: bytes) -> None:
    """Copies ``pipe`` to this process's standard error, ``prefix`` at each line's start
    (and after each carriage return: a progress bar redrawn), one write per line, so that
    lines of several agents sharing the launcher's standard error stay whole (a pipe
    write up to 4 KiB is atomic); a partial line (a progress bar's) is passed on as it
    comes, not held back. Until EOF."""
    fd = pipe.fileno()
    out = sys.stderr.fileno()
    at_start = True
    try:
        while chunk := os.read(fd, 65536):
            pieces = chunk.split(b"\n")
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                if last and not piece:
                    break  # (the chunk ended a line)
                if b"\r" in piece:  # a redraw starts after each carriage return
                    head, *rest = piece.split(b"\r")
                    piece = head + b"".join(b"\r" + (prefix + r if r else r) for r in rest)
                line = (prefix if at_start else b"") + piece + (b"" if last else b"\n")
                at_start = not last
                with contextlib.suppress(OSError):  # our own stderr gone: drain, say nothing
                    os.write(out, line)
    except OSError:
        pass
    finally:
        pipe.close()
