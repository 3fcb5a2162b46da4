"""Which threads an XLA:CPU compile runs on, and whether niceness on the compiling thread
reaches them (issue 13: the slow steps beside background compiles).

    PYTHONPATH=. python -m tests.jobs.compile_threads [--niceness 0,10] [--compiles 4]

One process, 8 CPU devices. For each niceness: a small jitted step runs in a loop on the
main thread while another thread (given that Linux niceness first, as a background
compiler would be) compiles ``--compiles`` larger programs. Prints the step's median
before and during the compiles, its worst time, and every thread seen meanwhile by name
and niceness (from ``/proc/self/task``): the compile's worker threads are created outside
the compiling thread, so they keep the process's niceness.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time


def _threads() -> dict[tuple[str, int], int]:
    """(thread name, niceness) -> how many threads of this process have them."""
    out: dict[tuple[str, int], int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        niceness = int(stat[stat.rindex(")") + 2:].split()[16])
        out[(name, niceness)] = out.get((name, niceness), 0) + 1
    return out


def measure(niceness: int, compiles: int) -> None:
    import jax
    import jax.numpy as jnp

    def big(x):
        for i in range(80):
            x = jnp.tanh(x @ x.T) + i
        return x

    step = jax.jit(lambda x: jnp.tanh(x @ x) * 0.5)
    x = jnp.ones((700, 700))
    step(x).block_until_ready()

    def compile_in_background() -> None:
        if niceness:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        for k in range(compiles):
            jax.jit(big).lower(jnp.ones((256 + k + 100 * niceness, 256))).compile()

    def timed() -> float:
        t = time.perf_counter()
        step(x).block_until_ready()
        return time.perf_counter() - t

    before = statistics.median(timed() for _ in range(20))
    compiler = threading.Thread(target=compile_in_background)
    compiler.start()
    during, seen = [], {}
    while compiler.is_alive():
        during.append(timed())
        for key, n in _threads().items():
            seen[key] = max(seen.get(key, 0), n)
    compiler.join()
    print(f"compiling thread niceness {niceness}: step median {before * 1e3:.1f} ms before, "
          f"{statistics.median(during) * 1e3:.1f} ms during ({len(during)} steps, worst "
          f"{max(during) * 1e3:.1f} ms); threads (name, niceness): count = {seen}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--niceness", default="0,10")
    parser.add_argument("--compiles", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    for niceness in (int(n) for n in args.niceness.split(",")):
        measure(niceness, args.compiles)


if __name__ == "__main__":
    main()
