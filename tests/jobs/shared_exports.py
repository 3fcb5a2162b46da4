"""One process of a two-process check of the shared exports (`compiler.ExportSharing`
over `coordination.SharedExports`), run by `tests/distributed/shared_exports_test.py`,
2 CPU devices each.

    python -m tests.jobs.shared_exports PROCESS_ID COORDINATOR CACHE_DIR OUT_DIR

Both processes build a `StepCompiler` of the same small step (its batch a custom pytree
that jax.export cannot serialise, and metrics in a dict) and compile it on demand over all
4 devices, as a world's first step does. Then both precompile a candidate mesh: process 0
traces and exports the step and publishes it (in 4 KiB pieces here, so that it travels in
many), process 1 takes it and compiles from it without tracing. Both then take the
candidate's executable and run it on the same values; each writes its traces, the exports
it took, whether the executable came from the export, and the result's error against
numpy to OUT_DIR/pPROCESS_ID.json.
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
    sharing = ExportSharing(coordination.SharedExports("test/exports"), publish=pid == 0)
    compiler.precompile([candidate], struct, sharing=sharing)
    finished = compiler.wait_precompiled(timeout_s=120)
    exe, where = compiler.get(candidate, struct)

    w = np.arange(16, dtype=np.float32).reshape(4, 4) / 16
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    state = [jax.make_array_from_callback(w.shape, exe.state_shardings[0], lambda i: w[i])]
    batch = Batch(jax.make_array_from_callback(x.shape, exe.batch_shardings.x, lambda i: x[i]))
    new, metrics, _ = exe.compiled(state, batch)
    y = x @ w
    error = max(
        float(np.abs(np.asarray(s.data) - (w - 0.1 * x.T @ y / 8)[s.index]).max())
        for s in new[0].addressable_shards)
    error = max(error, abs(float(np.asarray(metrics["loss"].addressable_shards[0].data))
                           - float(np.mean(y * y))))
    with open(out, "w") as f:
        json.dump({"finished": finished, "where": where, "from_export": exe.exported,
                   "traces_after_first": traces[0] - first_traces, "taken": exports.taken,
                   "max_error": error}, f)
    compiler.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
