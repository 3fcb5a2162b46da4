"""Plain JAX, no mnemojax: a stream of jitted calls with collectives across processes,
dispatched without waiting, deadlocks in XLA:CPU's gloo collectives.

Found by a user trial (a long eval between mnemojax steps) and reproduced here without
mnemojax: ``python -m tests.jobs.xla_gloo_stall`` starts 3 processes x 2 CPU devices
(``jax.distributed`` on 127.0.0.1, gloo), each in its own session as a launcher starts
them (``start_new_session``: its own scheduling group under the kernel's autogroup), and
``--busy`` CPU busy loops beside them. Each process runs ``--calls`` calls of a jitted MLP
evaluation (a ``fori_loop`` of 200 forward passes: per pass one all-reduce between the two
devices of a process, one across the processes), without waiting between calls. It prints
each process's exit status, the time the calls took and a verdict (``deadlocked`` when
gloo's receive timeout, "Timed out waiting 20000ms for recv operation to complete", ended
the calls). On the 2-core VM of 2026-12-06 (jax/jaxlib 0.10.2) it deadlocked in each of 7
runs (the defaults 3, ``--no-setsid`` 1, ``--busy 0`` 3; in the trial's job gdb showed
every device thread idle in ``gloo::allreduce``); with ``--sync`` (wait for each call) it
ran (2 of 2: 33.5 s, and 54 s beside a helper's jobs), and with ``--devices 1`` (one
device per process, so no collective between a process's own devices) too (2 of 2).
Every process it starts is ended, with a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def _worker(args: argparse.Namespace) -> None:
    os.environ["XLA_FLAGS"] = ("--xla_cpu_collective_timeout_seconds=20 "
                               "--xla_cpu_collective_call_terminate_timeout_seconds=20")
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((args.processes, args.devices), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def put(x: np.ndarray, spec: P) -> jax.Array:
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                            lambda idx: x[idx])

    rng = np.random.default_rng(0)
    w1 = put(rng.normal(size=(16, 64)).astype(np.float32) / 4, P(None, "model"))
    w2 = put(rng.normal(size=(64, 4)).astype(np.float32) / 8, P("model", None))
    x = put(rng.normal(size=(240, 16)).astype(np.float32), P("data"))

    @jax.jit
    def evaluate(w1, w2, x):
        def body(i, acc):
            h = jax.nn.relu((x * (1.0 + 1e-3 * i)) @ w1)
            return acc + jnp.mean(jax.nn.logsumexp(h @ w2, axis=-1))
        return jax.lax.fori_loop(0, 200, body, jnp.zeros((), jnp.float32)) / 200.0

    float(evaluate(w1, w2, x))  # compiled, and every process past its compile
    t0 = time.perf_counter()
    total = jnp.zeros(())
    for _ in range(args.calls):
        total = total + evaluate(w1, w2, x)
        if args.sync:
            total.block_until_ready()
    print(f"process {args.process}: {args.calls} calls in {time.perf_counter() - t0:.1f} s, "
          f"mean {float(total) / args.calls:.6f}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile(mode="w+"))
                for _ in range(args.processes)]
        codes = _run_processes(args, logs)
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
    print(f"exit statuses {codes} (None: still running at {args.timeout_s:.0f} s)")
    for text in texts:
        print(*[line for line in text.splitlines() if "calls in" in line])
    if all(c == 0 for c in codes):
        print("verdict: ran")
        return 0
    timed_out = sum("Timed out waiting" in t and "for recv" in t for t in texts)
    if timed_out:
        print(f"verdict: deadlocked (gloo's receive timeout in {timed_out} of "
              f"{len(texts)} processes)")
    else:
        print("verdict: failed otherwise; the last lines of each process:")
        for text in texts:
            print("\n".join(text.splitlines()[-5:]))
    return 1


def _run_processes(args: argparse.Namespace, logs: list) -> list[int | None]:
    """Starts the busy loops and the processes (output to ``logs``), waits for them;
    their exit statuses. Ends every one of them."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    port = _free_port()
    procs = []
    try:
        for p in range(args.processes):
            cmd = [sys.executable, "-m", "tests.jobs.xla_gloo_stall", "--worker",
                   "--process", str(p), "--processes", str(args.processes),
                   "--port", str(port), "--calls", str(args.calls),
                   "--devices", str(args.devices)]
            if args.sync:
                cmd.append("--sync")
            procs.append(subprocess.Popen(cmd, start_new_session=not args.no_setsid,
                                          stdout=logs[p], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout_s
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes
    finally:
        for proc in procs + busy:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=70)
    parser.add_argument("--busy", type=int, default=2, help="CPU busy loops beside")
    parser.add_argument("--sync", action="store_true", help="wait for each call")
    parser.add_argument("--no-setsid", action="store_true",
                        help="start the processes in this session")
    parser.add_argument("--timeout-s", type=float, default=180.0)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    return _launch(args)


if __name__ == "__main__":
    sys.exit(main())
