"""Run (e)'s worker: the bench's GPT as a ``@mnemojax.resilient`` job under ``mnemojax launch``.

``mnemojax launch --nproc N --devices-per-proc D -- python -m
mnemojax._src.bench.mp_resilient_worker --preset tiny --out DIR`` trains the preset's model
on the preset's mesh over the global devices of the N processes, with the same batches as
every other run, and the runtime's default options (only the compilation cache directory
is the bench's, so that every invocation starts cold). Each process appends a ``step``
event per step to ``DIR/events.jsonl`` (stamped with its worker id and pid); when a peer
is killed, the call of the failed step returns once the survivors have recovered and
replayed it. Process 0 of the final world writes ``DIR/final.npz`` and ``DIR/stats.json``.
"""

from __future__ import annotations

import time

_T_MAIN = time.time()  # before the heavy imports below (inside main)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mnemojax._src.bench.mp_resilient_worker")
    p.add_argument("--preset", required=True, help="bench preset name or TOML path")
    p.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    p.add_argument("--out", required=True, help="events.jsonl, final.npz, stats.json")
    p.add_argument("--run", default="e_mnemojax_processes", help="run id in the event log")
    p.add_argument("--compile-cache", default=None, help="CompileOptions.cache_dir")
    p.add_argument("--ahead-compilers", type=int, default=None,
                   help="CompileOptions.ahead_compilers (default: its default)")
    p.add_argument("--ahead-losses", type=int, default=1,
                   help="CompileOptions.ahead_losses (default: its default, 1)")
    p.add_argument("--no-compile-process", action="store_true",
                   help="CompileOptions(compile_process=False): compiles ahead on a thread")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    import mnemojax

    session = mnemojax.initialize()  # joins the launcher's world: before any JAX use
    t_joined = time.time()
    import jax
    import numpy as np
    from flax import nnx

    from mnemojax._src.bench.config import load_preset
    from mnemojax._src.chaos_worker import finish_job
    from mnemojax._src.events import EventLog
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step

    cfg = load_preset(args.preset, steps=args.steps)
    me = session.world.stable_id if session is not None else 0
    tag = {"pid": os.getpid(), "worker": me}
    events = EventLog(os.path.join(args.out, "events.jsonl"), args.run)
    mesh = jax.make_mesh(cfg.mesh, ("data", "model"),
                         devices=jax.devices()[:int(np.prod(cfg.mesh))],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, optimizer = build_gpt(GPTConfig(**cfg.model), seed=cfg.seed,
                                 learning_rate=cfg.learning_rate)
    compile_kw = {} if args.compile_cache is None else {"cache_dir": args.compile_cache}
    options = mnemojax.ResilienceOptions(compile=mnemojax.CompileOptions(
        ahead_compilers=args.ahead_compilers, ahead_losses=args.ahead_losses,
        compile_process=not args.no_compile_process, **compile_kw))
    step = mnemojax.resilient(lm_train_step, mesh=mesh, options=options)
    t_init = time.time()
    events.emit("startup", duration_s=t_init - _T_MAIN, time_s=t_init, phase="start+init",
                join_s=t_joined - _T_MAIN, **tag)
    corpus = BigramCorpus(cfg.model["vocab_size"], cfg.model["seq_len"], seed=cfg.seed)
    for i in range(cfg.steps):
        t0 = time.time()
        n_before = len(step.statistics.recoveries)
        loss = float(step(model, optimizer, corpus.batch(i, cfg.batch_size))["loss"])
        end = time.time()
        recovered = len(step.statistics.recoveries) > n_before
        events.emit("step", step=i + 1, time_s=end, duration_s=end - t0, loss=loss,
                    after_recovery=recovered, **tag)
    events.emit("run_end", step=cfg.steps, steps=cfg.steps,
                exports_taken=step.statistics.exports_taken, **tag)
    events.close()
    finish_job(args.out, nnx.state((model, optimizer)), step, session)
    return 0


if __name__ == "__main__":
    sys.exit(main())
