"""What jaxlib does with a host array written after it was handed to ``device_put`` (why
`replay.ReplayBuffer` keeps fresh copies; session 12 in WORKSPACE_NOTES.md).

    PYTHONPATH=. python -m tests.jobs.device_put_reuse [--tries 200]

One process, 2 CPU devices, a 256x64 array read back by a jitted sum. For float32 and float64, on a sharded and a replicated
`NamedSharding`, counts (1) *stale*: a second ``device_put`` of the same array, refilled
in place while the first result lives, places the first values; (2) *late read*: a refill
right after ``device_put`` (no block) shows up in the placed array.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    import jax
    import jax.numpy as jnp
    import numpy as np

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    for spec in (jax.P("data"), jax.P()):
        sharding = jax.sharding.NamedSharding(mesh, spec)
        for dtype in (np.float32, np.float64):
            stale = late = 0
            for i in range(args.tries):
                host = np.full((256, 64), 1.0, dtype)
                first = jax.device_put(host, sharding)
                host[:] = 2.0  # refilled in place, `first` alive
                second = jax.device_put(host, sharding)
                stale += float(jnp.sum(second)) != 2.0 * host.size
                fresh = np.full((256, 64), float(i), dtype)
                placed = jax.device_put(fresh, sharding)
                fresh[:] = -1.0  # right after the put, no block
                late += float(jnp.sum(placed)) != float(i) * fresh.size
                del first
            print(f"{dtype.__name__:8} {str(spec):10} stale second put: {stale}/{args.tries}"
                  f"   refill read late: {late}/{args.tries}", flush=True)


if __name__ == "__main__":
    main()
