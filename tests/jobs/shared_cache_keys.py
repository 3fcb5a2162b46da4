"""One process of a two-process check of `jax_private.cache_entries_from_this_process`'s
shared cache keys (run by `tests/distributed/jax_private_test.py`, 2 CPU devices each).

    python -m tests.jobs.shared_cache_keys PROCESS_ID COORDINATOR CACHE_DIR OUT_DIR

Both processes lower the same program over all 4 devices and record the persistent-cache
key JAX looks up, once as JAX computes it and once inside the context. Then process 0
alone compiles a second program inside the context (writing its entry), and process 1,
once told, compiles it too: it should load process 0's entry. Both then run it (a
reduction across the two processes) and compare with numpy. Then a third program goes
the way a new world's step does on one host (`coordination.OneCompile`): process 0 claims
its compile, process 1 finds the claim, misses, waits for process 0's compile and reads its
entry. Writes what it
saw to
OUT_DIR/pPROCESS_ID.json.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    pid, coordinator, cache_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    out = os.path.join(sys.argv[4], f"p{pid}.json")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, 2, pid, initialization_timeout=60)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    import jax.numpy as jnp
    from jax._src import compiler
    from jax._src import distributed as jax_distributed

    from mnemojax._src.distributed import jax_private

    keys: list[str] = []
    hits: list[bool] = []
    read = compiler._cache_read

    def recording_read(module_name, cache_key, *args, **kwargs):
        keys.append(cache_key)
        found = read(module_name, cache_key, *args, **kwargs)
        hits.append(found[0] is not None)
        return found

    compiler._cache_read = recording_read
    client = jax_distributed.global_state.client
    mesh = jax.make_mesh((4,), ("d",))
    rows = jax.sharding.NamedSharding(mesh, jax.P("d"))
    replicated = jax.sharding.NamedSharding(mesh, jax.P())
    x = jax.make_array_from_callback((8,), rows, lambda i: np.arange(8, dtype=np.float32)[i])

    def f(v):
        return jnp.tanh(v) * 2

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)  # JAX writes nothing
    jax.jit(f, out_shardings=rows).lower(x).compile()
    jax.clear_caches()  # the same program again: not from JAX's in-memory caches
    with jax_private.cache_entries_from_this_process():
        jax.jit(f, out_shardings=rows).lower(x).compile()
    plain, shared = keys[-2], keys[-1]

    def g(v):
        return v * 3 + jnp.sum(jnp.sin(v))  # the sum reduces across both processes

    if pid == 1:
        client.blocking_key_value_get("g-written", 60_000)
    with jax_private.cache_entries_from_this_process():
        compiled = jax.jit(g, out_shardings=replicated).lower(x).compile()
    g_hit = hits[-1]
    if pid == 0:
        client.key_value_set("g-written", "1")
    y = compiled(x)
    expected = np.arange(8, dtype=np.float32) * 3 + np.sin(np.arange(8, dtype=np.float32)).sum()
    error = float(np.abs(np.asarray(y.addressable_shards[0].data) - expected).max())
    g_key = keys[-1]

    def h(v):
        return jnp.cos(v) - jnp.max(v)  # another reduction across both processes

    from mnemojax._src.distributed.worker.coordination import OneCompile

    one = OneCompile("test/compile", cache_dir)
    reads = len(hits)
    if pid == 1:
        client.blocking_key_value_get("h-claimed", 60_000)  # process 0 claims first
    claimed = one.claim()
    with jax_private.cache_entries_from_this_process():
        if claimed:
            client.key_value_set("h-claimed", "1")
            client.blocking_key_value_get("h-missed", 60_000)  # so process 1 misses first
            with jax_private.counting_cache_writes() as written:
                compiled_h = jax.jit(h, out_shardings=replicated).lower(x).compile()
            one.done(written() > 0)
        else:
            def missed_then_wait() -> bool:
                client.key_value_set("h-missed", "1")
                return one.wait()

            with jax_private.before_compiling_a_miss(missed_then_wait):
                compiled_h = jax.jit(h, out_shardings=replicated).lower(x).compile()
    y = compiled_h(x)
    expected = np.cos(np.arange(8, dtype=np.float32)) - 7.0
    error = max(error, float(np.abs(np.asarray(y.addressable_shards[0].data) - expected).max()))
    with open(out, "w") as f_out:
        json.dump({"plain_key": plain, "shared_key": shared, "g_hit": g_hit,
                   "g_key": g_key, "h_claimed": claimed, "h_reads": hits[reads:],
                   "max_error": error}, f_out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
