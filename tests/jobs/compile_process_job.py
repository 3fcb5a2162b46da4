"""One process of a two-process check of `compile_process` under ``jax.distributed`` (run
by `tests/compile_process_test.py`, 2 CPU devices each).

    python -m tests.jobs.compile_process_job PROCESS_ID COORDINATOR OUT_DIR

Both processes compile the toy step of `tests.compiler_test` ahead of time for a (2, 2)
mesh over all 4 devices (global ids 0, 1, 2048, 2049) in their compile process (never
distributed itself: 4 CPU devices of its own, the ids mapped onto them), and on demand in
the process; both executables run the step (its loss a mean across the two processes)
and their outputs are compared. Writes what it saw to OUT_DIR/pPROCESS_ID.json.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    pid, coordinator = int(sys.argv[1]), sys.argv[2]
    out = os.path.join(sys.argv[3], f"p{pid}.json")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, 2, pid, initialization_timeout=60)

    from mnemojax._src import compile_process
    from mnemojax._src.topology import MeshPlan
    from tests import compiler_test as ct

    ids = np.array([d.id for d in jax.devices()]).reshape(2, 2)
    plan = MeshPlan(ids, ("data", "model"), "unchanged")
    ahead, here = ct._compiler(in_child=True), ct._compiler()
    ahead.precompile([plan], ct.BATCH)
    assert ahead.wait_precompiled(timeout_s=120)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    x = rng.standard_normal((12, 8)).astype(np.float32)
    results = []
    for compiler in (ahead, here):
        exe, where = compiler.get(plan, ct.BATCH)
        leaves = [jax.make_array_from_callback(a.shape, s, lambda i, a=a: a[i])
                  for a, s in zip((w, b), exe.state_shardings, strict=True)]
        batch = {"x": jax.make_array_from_callback(x.shape, exe.batch_shardings["x"],
                                                   lambda i: x[i])}
        new, metrics, _, _ = exe.compiled(leaves, batch)
        results.append((where, [np.asarray(jax.experimental.multihost_utils.process_allgather(
            a, tiled=True)).tolist() for a in (*new, metrics["loss"])]))
    child = compile_process.current()
    report = {"in_child": ahead.compiled_in_child, "where": [r[0] for r in results],
              "equal": results[0][1] == results[1][1],
              "loss": results[0][1][2], "want_loss": float(np.mean((x @ w + b) ** 2)),
              "devices": [int(i) for i in ids.flat],
              "child_devices": child.num_devices if child else None}
    ahead.close()
    here.close()
    compile_process.abandon()
    with open(out, "w") as f:
        json.dump(report, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    import jax.experimental.multihost_utils  # noqa: F401 - (process_allgather above)

    main()
