"""A @mnemojax.resilient job for the lifecycle tests (`tests/e2e/lifecycle_test.py`).

python -m mnemojax launch --nproc 3 --devices-per-proc 2 -- \
    python -m tests.jobs.mp_lifecycle_job --out DIR [--steps N] \
    [--raise-worker W --raise-at-step K --raise-in loop|step|oom] [--no-initialize] \
    [--ckpt DIR] [--marker-at-step K]

``--raise-in loop``: worker W raises ``RuntimeError`` in the training loop after step K;
``--raise-in step``: it calls the step with a batch of the wrong width at step K (the
step raises inside the call); ``--raise-in oom``: its step K fails with an injected
``RESOURCE_EXHAUSTED`` (`FaultInjector.out_of_memory`). ``--no-initialize``: the worker never calls
`mnemojax.initialize()`. ``--ckpt``: the persistent tier (its just-in-time checkpoint
on SIGTERM). ``--marker-at-step K``: worker 0 writes DIR/step-K after step K. Process 0 of the final world writes DIR/final.npz and
DIR/stats.json, as `tests.jobs.mp_resilient_job` does.
"""

import argparse
import os
import sys
import time

import mnemojax
import mnemojax.testing

# Joins the launcher's world, before any JAX use (unless the test leaves it out).
session = None if "--no-initialize" in sys.argv else mnemojax.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mnemojax._src.chaos_worker import finish_job  # noqa: E402
from tests import helpers as h  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--step-sleep-s", type=float, default=0.2)
    parser.add_argument("--raise-worker", type=int, default=-1)
    parser.add_argument("--raise-at-step", type=int, default=-1)
    parser.add_argument("--raise-in", choices=("loop", "step", "oom"), default="loop")
    parser.add_argument("--no-initialize", action="store_true")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--marker-at-step", type=int, default=-1)
    args = parser.parse_args()
    me = session.world.stable_id if session is not None else 0
    model_axis = 2 if jax.device_count() % 2 == 0 else 1  # 1 device without initialize()
    mesh = h.mesh_of((jax.device_count() // model_axis, model_axis))
    model, optimizer = h.make_mlp()
    faults = None
    if me == args.raise_worker and args.raise_in == "oom":
        faults = mnemojax.testing.FaultInjector().out_of_memory(args.raise_at_step)
    step = mnemojax.resilient(h.train_step, mesh=mesh, fault_injector=faults,
                              options=h.no_precompile(
                                  persistent=mnemojax.PersistentOptions(directory=args.ckpt)))
    for k, batch in enumerate(h.make_batches(args.steps), start=1):
        if me == args.raise_worker and k == args.raise_at_step:
            if args.raise_in == "loop":
                raise RuntimeError(f"user bug in worker {me} at step {k}")
            if args.raise_in == "step":
                batch = {"x": np.concatenate([batch["x"], batch["x"]], axis=1),
                         "y": batch["y"]}
        step(model, optimizer, batch)
        if me == 0 and k == args.marker_at_step:
            open(os.path.join(args.out, f"step-{k}"), "w").close()
        time.sleep(args.step_sleep_s)
    finish_job(args.out, nnx.state((model, optimizer)), step, session)


if __name__ == "__main__":
    main()
