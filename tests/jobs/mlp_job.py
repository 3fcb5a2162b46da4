"""A small training job run as a real subprocess by the persistent-tier tests.

python -m tests.jobs.mlp_job --ckpt DIR --steps N --out FINAL.npz [--events LOG]
Prints "step K" after each step (flushed), restores the newest checkpoint first, and
writes the final state to --out.
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import mnemojax  # noqa: E402
from tests import helpers as h  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--events")
    parser.add_argument("--step-sleep-s", type=float, default=0.0)
    args = parser.parse_args()
    options = mnemojax.ResilienceOptions(
        compile=mnemojax.CompileOptions(precompile=False, cache_dir=None),
        persistent=mnemojax.PersistentOptions(directory=args.ckpt, every_steps=0),
        event_log=args.events, run_name="mlp_job")
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=options)
    start = step.restore(model, optimizer)
    print(f"restored {start}", flush=True)
    import time

    for k, batch in enumerate(h.make_batches(args.steps)[start:], start=start + 1):
        step(model, optimizer, batch)
        print(f"step {k}", flush=True)
        time.sleep(args.step_sleep_s)
    step.close()
    np.savez(args.out, *h.host_state(model, optimizer))
    print("done", flush=True)


if __name__ == "__main__":
    main()
