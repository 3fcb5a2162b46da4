"""Where a new world's first execution goes (issue 13, item 4): per executable, or per
collective context?

    PYTHONPATH=. python -m tests.jobs.first_execution            # both parts
    PYTHONPATH=. python -m tests.jobs.first_execution --part one # one process only

``one``: one process, 8 CPU devices, the bench's tiny GPT train step compiled for three
fresh meshes; on two of them a small program first runs psums and all-gathers over the
same mesh axes (the collective cliques the step will use). Prints each step's first three
calls: if the cliques were the cost, the warmed meshes' first calls would be as fast as
their second.

``gloo``: 3 processes x 2 CPU devices under `mnemojax.testing.run_scenario` (gloo
collectives, as a new world after a kill), cold and warm alternately, twice: ``warm``
first runs a tiny psum program over data, model and both (gloo connects its contexts
lazily, on first use); then, in both modes, a matmul program with the same reductions,
three calls each. Prints the first calls of each, per process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _calls(compiled, args, n: int) -> list[float]:
    import jax

    out = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        out.append(round((time.perf_counter() - t) * 1e3, 1))
    return out


def _collectives(mesh, *, gather: bool):
    """A jitted program of psums (and all-gathers) over the mesh's axes."""
    import jax
    from jax.sharding import PartitionSpec as P

    def body(x):
        out = [jax.lax.psum(x, "data"), jax.lax.psum(x, "model"),
               jax.lax.psum(x, ("data", "model"))]
        if gather:
            out += [jax.lax.all_gather(x, "data", tiled=True),
                    jax.lax.all_gather(x, "model", tiled=True)]
        return tuple(out)

    specs = (P("data", "model"),) * 3 + ((P(None, "model"), P("data", None)) if gather else ())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"),
                                 out_specs=specs, check_vma=False))


def one_process() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mnemojax._src.bench.config import load_preset
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step

    preset = load_preset("tiny")
    cfg = GPTConfig(**preset.model)
    graphdef, state = nnx.split(build_gpt(cfg))
    state = jax.tree.map(np.asarray, state)

    def step(state, batch):
        m, o = nnx.merge(graphdef, state)
        metrics = lm_train_step(m, o, batch)
        return nnx.state((m, o)), metrics

    print("one process, tiny GPT step, first three calls on a fresh mesh (ms):")
    for shape, devices, warm in [((2, 3), range(6), True), ((2, 2), range(2, 6), False),
                                 ((3, 2), range(1, 7), True)]:
        mesh = jax.make_mesh(shape, ("data", "model"),
                             devices=[jax.devices()[i] for i in devices],
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        replicated = jax.sharding.NamedSharding(mesh, jax.P())
        rows = jax.sharding.NamedSharding(mesh, jax.P("data"))
        zeros = np.zeros((preset.batch_size, cfg.seq_len), np.int32)
        batch = {"inputs": jax.device_put(zeros, rows), "targets": jax.device_put(zeros, rows)}
        compiled = jax.jit(step).lower(jax.device_put(state, replicated), batch).compile()
        cliques = None
        if warm:
            x = jax.device_put(jnp.ones(shape, jnp.float32),
                               jax.sharding.NamedSharding(mesh, jax.P("data", "model")))
            cliques = _calls(_collectives(mesh, gather=True).lower(x).compile(), (x,), 1)[0]
        calls = [_calls(compiled, (jax.device_put(state, replicated), batch), 1)[0]
                 for _ in range(3)]
        print(f"  mesh {shape}: step {calls}"
              + (f" after a psum/all-gather program over the mesh ({cliques} ms)"
                 if warm else " (nothing before)"))


def gloo_worker(out: str, mode: str) -> None:
    import mnemojax

    session = mnemojax.initialize()
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    spec = NamedSharding(mesh, P("data", "model"))
    tiny = jax.device_put(jnp.ones((mesh.shape["data"], 2), jnp.float32), spec)
    big = jax.device_put(jnp.ones((mesh.shape["data"] * 256, 512), jnp.float32), spec)
    warmup = _collectives(mesh, gather=False).lower(tiny).compile()

    def body(w):
        y = jnp.tanh(w @ w.T)
        return (jax.lax.psum(y, "data") + jax.lax.psum(y, "model")
                + jax.lax.pmean(y, ("data", "model")))

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"),
                                    out_specs=P("data", "model"))).lower(big).compile()
    if session is not None:
        session.compiled()  # every process compiled: no compile skew in the timings
    result = {"warm-up": _calls(warmup, (tiny,), 2) if mode == "warm" else None,
              "program": _calls(program, (big,), 3)}
    with open(os.path.join(out, f"{mode}-p{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)
    if session is not None:
        session.finish()


def gloo() -> None:
    from mnemojax.testing import run_scenario

    print("3 processes x 2 devices (gloo), per process: [first, second, ...] call (ms):")
    for mode in ("cold", "warm", "cold", "warm"):
        out = tempfile.mkdtemp(prefix="mnemojax-first-exec-")
        report = run_scenario([sys.executable, "-m", "tests.jobs.first_execution",
                               "--worker", out, mode], nproc=3, devices_per_proc=2,
                              job_timeout_s=240)
        if report["rc"] != 0:
            raise SystemExit(f"{mode}: the job failed (exit {report['rc']})")
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name)) as f:
                r = json.load(f)
            warm = f"tiny psum program {r['warm-up']}, then " if r["warm-up"] else ""
            print(f"  {mode} {name.split('-')[1][:-5]}: {warm}matmul program {r['program']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.jobs.first_execution")
    p.add_argument("--part", choices=("one", "gloo", "both"), default="both")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        gloo_worker(*args.worker)
        return 0
    if args.part in ("one", "both"):
        one_process()
    if args.part in ("gloo", "both"):
        gloo()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
