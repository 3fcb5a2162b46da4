"""The worker process an agent runs: its child, so its exit is seen at once (``poll``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

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
    """

    def __init__(self, command: Sequence[str]):
        self.command = list(command)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """A worker was started and its exit has not been collected yet."""
        return self._proc is not None

    def spawn(self, env: Mapping[str, str]) -> int:
        """Starts the worker with ``env`` added to this process's environment; its pid."""
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_SHIM, str(os.getpid()), *self.command],
            env={**os.environ, **env})
        return self._proc.pid

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
