"""Does a background XLA:CPU compile stall executions in the same process? One process, 8 CPU
devices: a small jitted program with a cross-device reduction, dispatched and waited for one
call at a time, timed alone and while another thread compiles three larger programs
(session 16: a user trial's long eval failed beside mnemojax's background compile).

    python tests/jobs/compile_stall.py
"""

from __future__ import annotations

import os
import statistics
import threading
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def _big(v):
    for i in range(60):
        v = jnp.tanh(v @ v.T @ v + i) * 0.5
    return v


def _median_max_ms(times: list[float]) -> tuple[float, float]:
    return round(1e3 * statistics.median(times), 2), round(1e3 * max(times), 1)


def main() -> None:
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.ones((8, 256)), NamedSharding(mesh, P("d")))
    small = jax.jit(lambda v: jnp.tanh(v * 2).sum() + v.mean())
    small(x).block_until_ready()

    def calls(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            small(x).block_until_ready()
            times.append(time.perf_counter() - t)
        return times

    alone = calls(200)
    done = threading.Event()

    def compile_three() -> None:
        for k in range(3):
            jax.jit(_big).lower(jnp.ones((256 + k, 256 + k))).compile()
        done.set()

    compiler = threading.Thread(target=compile_three)
    t0 = time.perf_counter()
    compiler.start()
    during: list[float] = []
    while not done.is_set():
        during += calls(5)
    compiler.join()
    print(f"alone: median/max {_median_max_ms(alone)} ms; during {time.perf_counter() - t0:.1f} "
          f"s of compiles: median/max {_median_max_ms(during)} ms over {len(during)} calls")


if __name__ == "__main__":
    main()
