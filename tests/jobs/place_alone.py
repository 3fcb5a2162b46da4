"""One process of a two-process check that `ResilientStep.place` makes no collective (run by
`tests/distributed/place_test.py`, 2 CPU devices each, a mesh over all 4).

    python -m tests.jobs.place_alone PROCESS_ID COORDINATOR OUT_DIR

Both processes run one resilient step together. Then process 0 alone places a host batch
with `place`, before and after the step was built, and checks its own devices' rows, while
process 1 only waits for process 0's file saying it is done: a collective in `place` would
wait for process 1, which never comes (``jax.device_put`` of host data checks the value
across the processes: the job would hang, and the test's timeout end it). Writes
OUT_DIR/pPROCESS_ID.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

WAIT_S = 60.0


def main() -> None:
    pid, coordinator, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, 2, pid, initialization_timeout=60)
    import mnemojax
    from tests import helpers as h

    done = os.path.join(out_dir, "p0.done")
    mesh = h.mesh_of((2, 2))  # every device of both processes
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=mesh, options=h.no_precompile())
    seen: dict[str, object] = {}
    try:
        if pid == 0:
            placed = [step.place(h.EVAL_BATCH)]  # before the step is built
        step(model, optimizer, h.make_batches(1)[0])  # together: a collective
        if pid == 0:
            placed.append(step.place(h.EVAL_BATCH))  # alone, on the built step's layer
            for i, batch in enumerate(placed):
                for name, want in h.EVAL_BATCH.items():
                    x = batch[name]
                    assert x.shape == want.shape and x.sharding.spec == jax.P("data"), x
                    for shard in x.addressable_shards:
                        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
                    seen[f"{i}/{name}"] = len(x.addressable_shards)
            with open(done, "w") as f:
                f.write("done")
        else:
            deadline = time.monotonic() + WAIT_S
            while not os.path.exists(done):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"process 0 did not place its batch in {WAIT_S:.0f} s")
                time.sleep(0.05)
    finally:
        step.close()
    with open(os.path.join(out_dir, f"p{pid}.json"), "w") as f:
        json.dump(seen, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
