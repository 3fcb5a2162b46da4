"""One worker of ``mnemojax chaos --processes N`` (the launcher runs it; not by hand).

The chaos model and batches (`chaos.build`, `chaos.clean_batches`) under `@mnemojax.resilient`
on a (processes, 2) data x model mesh. The faults a process does to itself come from the
command line: NaN batches (every worker feeds the same one) and transient errors of one
worker's launches. Process 0 of the final world writes ``final.npz`` (the state, gathered)
and ``stats.json``; every worker writes its event log ``events-w<id>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import mnemojax


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mnemojax._src.chaos_worker")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--nan-steps", default="", help="comma-separated steps fed a NaN batch")
    p.add_argument("--transients", default="",
                   help="comma-separated WORKER:STEP: that worker's launch fails once")
    p.add_argument("--step-sleep-s", type=float, default=0.05)
    args = p.parse_args(argv)
    session = mnemojax.initialize()  # before any JAX use

    import jax
    import numpy as np
    from flax import nnx

    from mnemojax._src import chaos
    from mnemojax.models.tasks import mlp_train_step

    me = session.world.stable_id if session is not None else 0
    nan_steps = {int(k) for k in args.nan_steps.split(",") if k}
    faults = mnemojax.testing.FaultInjector()
    for item in filter(None, args.transients.split(",")):
        worker, step_k = (int(x) for x in item.split(":"))
        if worker == me:
            faults.transient_error(step_k)
    mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, optimizer = chaos.build(args.seed)
    step = mnemojax.resilient(mlp_train_step, mesh=mesh, fault_injector=faults,
                              options=mnemojax.ResilienceOptions(
                                  nonfinite="skip_batch", run_name=f"w{me}",
                                  event_log=os.path.join(args.out, f"events-w{me}.jsonl"),
                                  compile=mnemojax.CompileOptions(precompile=False,
                                                                  cache_dir=None)))
    for k, batch in enumerate(chaos.clean_batches(args.seed, args.steps), start=1):
        if k in nan_steps:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mnemojax.errors.NonFiniteSkipWarning)
                step(model, optimizer, {"x": np.full_like(batch["x"], np.nan),
                                        "y": batch["y"]})
        step(model, optimizer, batch)
        time.sleep(args.step_sleep_s)
    finish_job(args.out, nnx.state((model, optimizer)), step, session)
    return 0


def finish_job(out: str, state, step, session, *, before_close=None) -> None:
    """Ends a multi-process job: process 0 of the final world writes ``out/final.npz`` (the
    state's leaves, gathered) and ``out/stats.json`` (the step's statistics); then
    ``before_close()`` runs, if given, and the step and the session are closed."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    full = [np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for x in jax.tree.leaves(state)]
    if jax.process_index() == 0:
        os.makedirs(out, exist_ok=True)
        np.savez(os.path.join(out, "final.npz"), *full)
        with open(os.path.join(out, "stats.json"), "w") as f:
            json.dump(step.statistics.as_dict(), f, default=list)
    if before_close is not None:
        before_close()
    step.close()
    if session is not None:
        session.finish()


if __name__ == "__main__":
    raise SystemExit(main())
