"""XLA compiles ahead of time in a process of their own: paused while a recovery compiles,
killed at exit, at a lower priority if asked.

XLA:CPU compiles on a pool of threads of its own, so lowering the priority of the thread
that asks for a compile changes nothing (WORKSPACE_NOTES, sessions 11 and 20), and a
compile cannot be cancelled. A compile ahead of time (`compiler.StepCompiler.precompile`)
therefore shared the cores with a recovery's own compile when a second fault came before
it ended (issue 13 item 5: x1.78 of one cold compile, ``python -m
mnemojax._src.bench.micro 8``), held a world's end until it was done, and the exit too.

Here only its XLA part moves: the compile thread traces and lowers as before, then JAX's
backend compile (`jax_private.compiles_elsewhere`) sends the module's bytecode, its
serialized compile options and the device ids to a child process (`compile_worker`),
which compiles and answers with the serialized executable; the thread loads it (as JAX
loads a persistent-cache entry), and JAX caches it as usual (the entry holds the child's
bytes). A compile on a recovery's path stops the child (SIGSTOP) until it is done
(`paused`), so it has the cores alone; the compile ahead then resumes where it was. A
world's end waits for a compile running there, as for one on a thread
(`StepCompiler.close`: left running, the new world's other processes compiled the same
plan on the recovery's path); the interpreter's exit kills the child (`abandon`). The
child's nice value (`CompileOptions.compile_process_nice`, 0 by default) trades the
steps' speed beside the compiles ahead against how soon those are ready (``python -m
mnemojax._src.bench.micro 9``): at 19 the steps beside them ran x1.15 of steady against
x1.57 at 0, but they were ready in 29 s instead of 14 s, and a real kill in that window
compiled on the recovery's path (``tests.jobs.two_kills``: 2.6-4.4 s to the next good
step instead of 0.8-1.3 s). A terminal's ``fg`` after Ctrl-Z sends SIGCONT to the whole
process group, the child too, even while a recovery holds it paused (it then shares the
cores again; results are unchanged).

Scope: CPU devices, in one process or under ``jax.distributed`` (the child, never
distributed itself, has as many CPU devices as the world, the backend's devices in id
order mapped onto its own: an XLA:CPU executable does not depend on which process
compiled it, WORKSPACE_NOTES "One cache key for every process"), modules without host
callbacks. Whatever fails in the child (its start, a crash, a compile error, a load)
makes the thread compile that module itself, so a compile error is raised by JAX as
without the child; a child that ended (killed by the kernel's OOM killer, a crash) is
started again at the next compile, up to `MAX_STARTS` children ended that way, after
which the thread compiles (logged). One child per nice value: a step built with another
`compile_process_nice` gets a child of its own, and the idle children of other values end
(`shared`). The child
costs ~0.2 GB of host memory and ~2 s of CPU to start (when the step is built, in a
process that compiles ahead). Off: ``CompileOptions(compile_process=False)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from mnemojax._src import compile_worker, spawner

log = logging.getLogger("mnemojax")

_LOADER = ("import importlib.util, sys; "
           "spec = importlib.util.spec_from_file_location('mnemojax_compile_worker', sys.argv[1]); "
           "worker = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker); "
           "worker.serve(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))")


# Children of one compile process (one nice value) that may end other than by `retire`:
# one that keeps dying (a module that crashes XLA, a host short of memory) leaves the
# compiles to the thread from then on.
MAX_STARTS = 3


class CompileAbandoned(Exception):
    """The compile process was killed (`abandon`, at exit) while it compiled this module:
    nothing is compiled."""


class CompileProcess:
    """One child process compiling for this process's CPU devices (and, under
    ``jax.distributed``, its peers'), one module at a time."""

    def __init__(self, num_devices: int, nice: int = 0):
        self.num_devices = num_devices
        self.nice = nice
        self._owner = os.getpid()  # a forked copy of this object never talks to the child
        self._request_lock = threading.Lock()  # one request on the pipes at a time
        self._lock = threading.Lock()  # the fields below
        self._proc: subprocess.Popen | None = None
        self._pauses = 0
        self._abandoned = False
        self.ended: str | None = None  # why the child is gone for good
        self.starts = 0  # children started
        self.retired = 0  # of them, ended by `retire` (not counted against `MAX_STARTS`)
        self.compiled = 0  # modules compiled there and loaded here

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    def compile(self, backend: Any, code: bytes, executable_devices: Any, options: Any
                ) -> tuple[Any, bytes] | None:
        """The loaded executable of module `code`, compiled in the child, and its serialized
        form; None where it was not (the caller compiles it).
        `jax_private.compiles_elsewhere`'s callback.

        Raises:
            CompileAbandoned: the child was killed at exit during this compile.
        """
        if self._abandoned or _abandoned.is_set():  # (at exit: nothing more is compiled)
            raise CompileAbandoned("the compile process was killed at exit")
        if os.getpid() != self._owner or self.ended is not None:
            return None
        placed = _in_child_ids(backend, executable_devices, options, self.num_devices)
        if placed is None:
            return None
        ids, child_options = placed
        request = pickle.dumps((code, child_options.SerializeAsString(), ids),
                               protocol=pickle.HIGHEST_PROTOCOL)
        with self._request_lock:
            answer = self._ask(request)
        if answer is None:
            return None
        if answer[0] != "ok":
            log.warning("mnemojax: the compile process failed to compile a step (%s); "
                        "compiling it in this process", answer[1])
            return None
        try:
            executable = backend.deserialize_executable(answer[1], executable_devices, options)
        except Exception as e:  # noqa: BLE001 - compiled here instead
            log.warning("mnemojax: loading what the compile process compiled failed (%s: %s); "
                        "compiling it in this process", type(e).__name__, e)
            return None
        with self._lock:
            self.compiled += 1
        return executable, answer[1]

    def start(self) -> None:
        """Starts the child now (it imports JAX, ~2 s) rather than at the first compile."""
        if os.getpid() == self._owner:
            self._started()

    def _ask(self, request: bytes) -> tuple | None:
        proc = self._started()
        if proc is None:
            return None
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(compile_worker.HEADER.pack(len(request)) + request)
            proc.stdin.flush()
            body = compile_worker.read_frame(proc.stdout)
        except (OSError, ValueError):
            body = None
        if body is not None:
            return pickle.loads(body)
        with self._lock:
            abandoned = self._abandoned
        if abandoned:
            raise CompileAbandoned("the compile process was killed at exit")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        self._lost(proc, f"it ended (exit status {proc.returncode}) before answering a "
                         "compile")
        return None

    def _started(self) -> subprocess.Popen | None:
        with self._lock:
            if self.ended is not None or self._abandoned:
                return None
            if self._proc is not None:
                return self._proc
            try:
                self._proc = _spawn([sys.executable, "-c", _LOADER, compile_worker.__file__,
                                     str(self.num_devices), str(os.getpid()), str(self.nice)])
                self.starts += 1
            except OSError as e:
                self.ended = f"it could not start ({e})"
                log.warning("mnemojax: compiles ahead of time run in this process: the "
                            "compile process %s", self.ended)
                return None
            if self._pauses:
                self._signal(signal.SIGSTOP)
            log.info("mnemojax: compiles ahead of time run in process %d (nice %d)",
                     self._proc.pid, self.nice)
            return self._proc

    def _lost(self, proc: subprocess.Popen, why: str) -> None:
        """The child `proc` ended: the next compile starts another, unless `MAX_STARTS`
        were started (then the thread compiles from now on)."""
        with self._lock:
            if self._proc is not proc or self.ended is not None:
                return
            self._proc = None
            if self.starts - self.retired >= MAX_STARTS:
                self.ended = why
            again = self.ended is None
        if again:
            log.warning("mnemojax: the compile process is gone (%s); this compile runs in "
                        "this process, the next one in a new compile process", why)
        else:
            log.warning("mnemojax: the compile process is gone (%s), the last of the %d "
                        "this process starts; compiles ahead of time run in this process "
                        "from now on", why, MAX_STARTS)
        _kill(proc)

    def _signal(self, sig: int) -> None:  # (with self._lock held)
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, sig)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The child stopped (SIGSTOP) in this block, where the cores are needed: a compile
        on a recovery's path. Blocks nest across threads; the last one out resumes it."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def pause(self) -> None:
        """`paused`'s start (counted: the last `resume` continues the child)."""
        with self._lock:
            self._pauses += 1
            if self._pauses == 1:
                self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        with self._lock:
            self._pauses -= 1
            if self._pauses == 0:
                self._signal(signal.SIGCONT)

    def retire(self) -> bool:
        """Ends the child if it is idle (no compile in flight); the next compile starts
        another. Whether it was idle."""
        if not self._request_lock.acquire(blocking=False):
            return False
        try:
            with self._lock:
                proc, self._proc = self._proc, None
                if proc is not None:
                    self.retired += 1
            if proc is not None:
                log.info("mnemojax: compile process %d (nice %d) ended: idle, and a step "
                         "asked for another", proc.pid, self.nice)
                _kill(proc)
            return True
        finally:
            self._request_lock.release()

    def abandon(self) -> None:
        """Kills the child (a compile in flight raises `CompileAbandoned` on its thread);
        this object starts none again."""
        with self._lock:
            self._abandoned = True
            proc, self._proc = self._proc, None
        if proc is not None:
            _kill(proc)


def _spawn(args: list[str]) -> subprocess.Popen:
    """Starts the child from a thread that lives as long as this process
    (`spawner.popen`): the child's PR_SET_PDEATHSIG fires when the thread that started it
    ends, and a compile thread ends with its step (`StepCompiler.close`)."""
    return spawner.popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)


def _in_child_ids(backend: Any, executable_devices: Any, options: Any, child_devices: int
                  ) -> tuple[list[int], Any] | None:
    """The device ids of a compile in the child, and its compile options with them: the
    backend's devices in id order are the child's 0, 1, ... (under ``jax.distributed``
    CPU ids are not 0..n-1: 2048 * process + local). None where the child has too few
    devices, or where the options' device assignment is not one computation over
    ``executable_devices`` in their order (what ``jax.jit`` compiles; anything else is
    compiled in this process)."""
    from jax._src.lib import xla_client  # pyright: ignore[reportPrivateImportUsage]

    order = {d: i for i, d in enumerate(sorted(d.id for d in backend.devices()))}
    ids = [d.id for d in executable_devices]
    if len(order) > child_devices or options.num_replicas != 1 or len(set(ids)) != len(ids):
        return None
    try:
        assignment = xla_client.DeviceAssignment.create(np.array([ids]))
        if assignment.serialize() != options.device_assignment.serialize():
            return None
        child_options = xla_client.CompileOptions.ParseFromString(options.SerializeAsString())
        mapped = [order[i] for i in ids]
        child_options.device_assignment = xla_client.DeviceAssignment.create(np.array([mapped]))
    except Exception as e:  # noqa: BLE001 - compiled in this process
        log.debug("mnemojax: a compile kept in this process (%s: %s)", type(e).__name__, e)
        return None
    return mapped, child_options


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


_latest: CompileProcess | None = None  # the one asked for last (`current`)
_shared_lock = threading.Lock()
_abandoned = threading.Event()  # `abandon` ran (at exit): nothing is compiled there again
_pause_depth = 0  # `paused` blocks open: a process made inside one starts paused as often
# Every one made, oldest first (the newest of a nice value serves it; those replaced
# stay: paused and abandoned with the others).
_made: list[CompileProcess] = []


def shared(num_devices: int, nice: int = 0) -> CompileProcess:
    """This process's compile process at nice value `nice`, for at least `num_devices`
    CPU devices (started at its first compile; a later world with fewer devices uses
    it): one per nice value (XLA's compile threads take the nice value their process
    starts with). When one is made (a new value, or more devices than the one of that
    value has), the idle children of the others end (each is started again if its
    value is asked for later; one with a compile in flight is left to finish it). After
    `abandon`, one whose compiles raise `CompileAbandoned`."""
    global _latest
    pid = os.getpid()
    with _shared_lock:
        _made[:] = [p for p in _made if p._owner == pid]  # (a forked copy's: never used)
        process = next((p for p in reversed(_made) if p.nice == nice), None)
        others: list[CompileProcess] = []
        if process is None or process.num_devices < num_devices:
            others = list(_made)
            process = CompileProcess(num_devices, nice)
            _made.append(process)
            for _ in range(_pause_depth):
                process.pause()
        _latest = process
    for other in others:
        other.retire()
    return process


def retire_idle() -> None:
    """Ends every idle child of this process; each starts again at its next compile."""
    for process in _all():
        process.retire()


def current() -> CompileProcess | None:
    """The compile process asked for last in this process, if any."""
    with _shared_lock:
        return _latest if _latest is not None and _latest._owner == os.getpid() else None


def _all() -> list[CompileProcess]:
    with _shared_lock:
        return _mine()


def _mine() -> list[CompileProcess]:  # (with _shared_lock held)
    return [p for p in _made if p._owner == os.getpid()]


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """This process's compile processes paused in this block (`CompileProcess.paused`),
    those made inside it too; nothing where there is none."""
    global _pause_depth
    with _shared_lock:
        _pause_depth += 1
        for process in _mine():
            process.pause()
    try:
        yield
    finally:
        with _shared_lock:
            _pause_depth -= 1
            for process in _mine():
                process.resume()


def abandon() -> None:
    """Kills this process's compile process, if any, and starts none again (at the
    interpreter's exit): a compile ahead that reaches its XLA part later raises
    `CompileAbandoned` rather than start a child or compile on its thread."""
    _abandoned.set()
    for process in _all():
        process.abandon()
