"""The compile process's main loop (`compile_process`): run as a file, not as part of the
package (``python -c`` loads it by path), so its start-up imports JAX and nothing else.

It sets its nice value first (`CompileOptions.compile_process_nice`), asks the kernel to
kill it when its parent dies, ignores the terminal's keys, makes ``num_devices`` CPU
devices (the parent's device ids map onto them), then answers requests until its input
ends. A request and its answer are one pickled tuple each, framed by an 8-byte little-endian length, on the
parent's pipes: ``(module bytecode, serialized CompileOptions, device ids)`` in,
``("ok", serialized executable, compile seconds)`` or ``("error", text)`` out. Anything
printed goes to stderr: stdout carries only the answers.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import time

HEADER = struct.Struct("<Q")


def _die_with_parent(parent: int) -> None:
    """PR_SET_PDEATHSIG (Linux): SIGKILL when the parent's thread that started this process
    ends (`compile_process._spawn`: one that lives as long as the parent), even
    mid-compile or stopped. Elsewhere the end of the input stops the loop after the
    compile in flight."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # (died before the call above)
        os._exit(0)


def read_frame(stream) -> bytes | None:
    """One length-framed message from `stream` (both ends use it); None at its end."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (n,) = HEADER.unpack(header)
    body = stream.read(n)
    return body if len(body) == n else None


def serve(num_devices: int, parent: int, nice: int) -> None:
    os.nice(nice)  # (first: every thread XLA starts later inherits it)
    _die_with_parent(parent)
    # In the parent's process group, so in its session and scheduling group (where Linux
    # groups by session, a session of its own would get an equal share of the CPU beside
    # the parent's whatever its nice value), but out of reach of the terminal's keys: the
    # parent decides when it ends, stops and resumes.
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP):
        signal.signal(sig, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what JAX or XLA print reaches stderr, never the answers
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", num_devices)
    # Private on purpose: JAX's own MLIR context and XLA client types, for the parent's
    # module and compile options (`jax_private.compiles_elsewhere`).
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client  # pyright: ignore[reportPrivateImportUsage]
    from jax._src.lib.mlir import ir  # pyright: ignore[reportPrivateImportUsage]

    backend = jax.devices()[0].client
    by_id = {d.id: d for d in backend.devices()}
    requests = sys.stdin.buffer
    while (body := read_frame(requests)) is not None:
        try:
            code, options, ids = pickle.loads(body)
            t0 = time.perf_counter()
            with mlir.make_ir_context():
                module = ir.Module.parse(code)
                executable = backend.compile_and_load(
                    module, executable_devices=xla_client.DeviceList(tuple(by_id[i] for i in ids)),
                    compile_options=xla_client.CompileOptions.ParseFromString(options))
            answer: tuple = ("ok", executable.serialize(), time.perf_counter() - t0)
            del executable
        except Exception as e:  # noqa: BLE001 - the parent compiles it itself then
            answer = ("error", f"{type(e).__name__}: {e}"[:2000])
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        answers.write(HEADER.pack(len(data)) + data)
        answers.flush()
