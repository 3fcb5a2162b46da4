"""Run (f)'s worker: one process of the classical multi-process job, no mnemojax runtime.

``python -m mnemojax._src.bench.mp_classical_worker --preset tiny --coordinator H:P
--process-id I --nproc N --ckpt-dir D --events E --interval K`` is what every process of a
``jax.distributed`` job does on each (re)start: import, join the world
(``jax.distributed.initialize``; process 0 hosts the coordination service), build the
model, restore the latest committed Orbax checkpoint if there is one, compile, and train
to the preset's steps, every process saving asynchronously every K steps (Orbax
coordinates the processes). The supervisor (`multiproc.run_classical_job`) kills it from
outside and restarts every process after any death, as torchrun and JobSet do.

Every phase is an event in the shared JSONL log, stamped with pid, process id and launch.
Process 0 of the last launch writes the final state (gathered) to ``--final-state``.
"""

from __future__ import annotations

import time

_T_MAIN = time.time()  # before the heavy imports below (inside main)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mnemojax._src.bench.mp_classical_worker")
    p.add_argument("--preset", required=True, help="bench preset name or TOML path")
    p.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    p.add_argument("--coordinator", required=True, help="host:port of process 0's service")
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--devices-per-proc", type=int, required=True)
    p.add_argument("--ckpt-dir", required=True, help="Orbax checkpoint directory (shared)")
    p.add_argument("--events", required=True, help="JSONL event log (appended)")
    p.add_argument("--run", default="f_classical_processes", help="run id in the event log")
    p.add_argument("--interval", type=int, required=True, help="checkpoint every K steps")
    p.add_argument("--redo-until", type=int, default=0,
                   help="steps <= this were completed by an earlier launch (redone)")
    p.add_argument("--launched-at", type=float, default=None,
                   help="unix time the supervisor started this process")
    p.add_argument("--launch", type=int, default=0, help="launch number (0 = first)")
    p.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache")
    p.add_argument("--final-state", default=None, help="process 0 writes the final state")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    launched_at = args.launched_at if args.launched_at is not None else _T_MAIN
    from mnemojax._src.bench.config import load_preset
    from mnemojax._src.events import EventLog

    cfg = load_preset(args.preset, steps=args.steps)
    events = EventLog(args.events, args.run)
    tag = {"pid": os.getpid(), "process": args.process_id, "launch": args.launch}

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", args.devices_per_proc)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.experimental import multihost_utils

    from mnemojax._src.bench.baseline_worker import open_and_restore
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step

    t_imported = time.time()
    jax.distributed.initialize(args.coordinator, num_processes=args.nproc,
                               process_id=args.process_id)
    t_joined = time.time()
    mesh = jax.make_mesh(cfg.mesh, ("data", "model"),
                         devices=jax.devices()[:int(np.prod(cfg.mesh))],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, optimizer = build_gpt(GPTConfig(**cfg.model), seed=cfg.seed,
                                 learning_rate=cfg.learning_rate)
    graphdef, host_state = nnx.split((model, optimizer))
    specs = nnx.get_partition_spec(host_state)
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))

    def place(x, sharding):  # every process holds the whole value; it supplies its shards
        value = np.asarray(x)
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

    state = jax.tree.map(place, host_state, shardings)
    jax.block_until_ready(state)
    t_init = time.time()
    events.emit("startup", duration_s=t_init - launched_at, time_s=t_init, phase="start+init",
                process_start_import_s=t_imported - launched_at,
                distributed_init_s=t_joined - t_imported, init_s=t_init - t_joined, **tag)

    manager, start, state = open_and_restore(
        args.ckpt_dir, cfg.checkpoint_max_to_keep, state,
        lambda **fields: events.emit("checkpoint_restore", **fields, **tag))

    def pure_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = lm_train_step(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    corpus = BigramCorpus(cfg.model["vocab_size"], cfg.model["seq_len"], seed=cfg.seed)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    def global_batch(i: int):
        batch = corpus.batch(i, cfg.batch_size)
        return {k: place(v, batch_sharding) for k, v in batch.items()}

    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    t0 = time.time()
    with jax.set_mesh(mesh):
        train_step = jax.jit(pure_step, out_shardings=(state_shardings, None)).lower(
            state, global_batch(start)).compile()
    events.emit("startup", duration_s=time.time() - t0, phase="compile", **tag)

    for step in range(start + 1, cfg.steps + 1):
        t0 = time.time()
        state, metrics = train_step(state, global_batch(step - 1))
        loss = float(metrics["loss"])
        end = time.time()
        events.emit("step", step=step, time_s=end, duration_s=end - t0, loss=loss,
                    replay=step <= args.redo_until, **tag)
        if step % args.interval == 0 and step < cfg.steps:
            t0 = time.time()
            manager.save(step, args=ocp.args.StandardSave(state))
            events.emit("checkpoint_save", step=step, duration_s=time.time() - t0,
                        blocking=True, **tag)
    manager.wait_until_finished()
    manager.close()
    full = [np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for x in jax.tree.leaves(state)]
    if args.process_id == 0 and args.final_state:
        np.savez(args.final_state, *full)
    events.emit("run_end", step=cfg.steps, steps=cfg.steps, **tag)
    events.close()
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
