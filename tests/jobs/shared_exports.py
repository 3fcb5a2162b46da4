"""One process of a two-process check of the shared exports (`compiler.ExportSharing`
over `coordination.SharedExports`), run by `tests/distributed/shared_exports_test.py`,
2 CPU devices each.

    python -m tests.jobs.shared_exports PROCESS_ID COORDINATOR CACHE_DIR OUT_DIR

Both processes build a `StepCompiler` of the same small step (its batch a custom pytree
that jax.export cannot serialise, and metrics in a dict) and compile it on demand over all
4 devices, as a world's first step does. Then both precompile a candidate mesh: process 0
traces and exports the step and publishes it (in 4 KiB pieces here, so that it travels in
many), process 1 takes it and compiles from it without tracing. Both then take the
candidate's executable and run it on the same values. A second candidate goes as on one
host by default (`CompileOptions.ahead_compilers` 1): process 1 only keeps the export it
takes, and once process 0 has compiled it, loads process 0's persistent-cache entry. Each
writes its traces, the exports it took, where each candidate's executable came from, and
the results' error against numpy to OUT_DIR/pPROCESS_ID.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys


@dataclasses.dataclass
class Batch:  # a pytree node of the program's own, as a user's batch class would be
    x: object


def main() -> None:
    pid, coordinator, cache_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    out = os.path.join(sys.argv[4], f"p{pid}.json")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    jax.tree_util.register_dataclass(Batch, data_fields=["x"], meta_fields=[])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, 2, pid, initialization_timeout=60)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from mnemojax._src.compiler import ExportedSteps, ExportSharing, StepCompiler
    from mnemojax._src.distributed import jax_private
    from mnemojax._src.distributed.worker import coordination
    from mnemojax._src.topology import MeshPlan

    coordination._EXPORT_CHUNK = 4096
    traces = [0]

    def pure(leaves, batch):
        traces[0] += 1
        w = leaves[0]
        y = batch.x @ w
        return [w - 0.1 * batch.x.T @ y / batch.x.shape[0]], {"loss": jnp.mean(y * y)}

    exports = ExportedSteps()
    compiler = StepCompiler(pure, [P(None, "model")], [((4, 4), np.dtype(np.float32))],
                            batch_axes=("data",), donate=False, exports=exports)
    ids = np.arange(4).reshape(2, 2) + np.array([[0], [2048 - 2]])  # 2048 * process + rank
    world = MeshPlan(ids, ("data", "model"), "unchanged")
    candidate = MeshPlan(ids.reshape(4, 1), ("data", "model"), "unchanged")
    struct = Batch(jax.ShapeDtypeStruct((8, 4), np.float32))
    compiler.get(world, struct)
    first_traces = traces[0]
    sharing = ExportSharing(coordination.SharedExports("test/exports/1"), publish=pid == 0)
    compiler.precompile([candidate], struct, sharing=sharing)
    finished = compiler.wait_precompiled(timeout_s=120)
    exe, where = compiler.get(candidate, struct)

    w = np.arange(16, dtype=np.float32).reshape(4, 4) / 16
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    y = x @ w

    def error_of(exe) -> float:
        state = [jax.make_array_from_callback(w.shape, exe.state_shardings[0], lambda i: w[i])]
        batch = Batch(jax.make_array_from_callback(x.shape, exe.batch_shardings.x,
                                                   lambda i: x[i]))
        new, metrics, _, _ = exe.compiled(state, batch)
        error = max(float(np.abs(np.asarray(s.data) - (w - 0.1 * x.T @ y / 8)[s.index]).max())
                    for s in new[0].addressable_shards)
        return max(error, abs(float(np.asarray(metrics["loss"].addressable_shards[0].data))
                              - float(np.mean(y * y))))

    error = error_of(exe)
    # The second candidate as on one host: process 1 keeps the export, loads the entry.
    second = MeshPlan(ids.reshape(1, 4), ("data", "model"), "unchanged")
    sharing = ExportSharing(coordination.SharedExports("test/exports/2"), publish=pid == 0)
    compiler.precompile([second], struct, export_only=pid == 1, sharing=sharing)
    finished = compiler.wait_precompiled(timeout_s=120) and finished
    client = jax_private.global_state().client
    if pid == 0:
        client.key_value_set("second-compiled", "1")
    else:
        client.blocking_key_value_get("second-compiled", 120_000)
    exe2, where2 = compiler.get(second, struct)
    with open(out, "w") as f:
        json.dump({"finished": finished, "where": where, "from_export": exe.exported,
                   "where_second": where2, "second_from_export": exe2.exported,
                   "traces_after_first": traces[0] - first_traces, "taken": exports.taken,
                   "max_error": max(error, error_of(exe2))}, f)
    compiler.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
