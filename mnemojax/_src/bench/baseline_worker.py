"""The classical job, as users run it today: one process of plain Flax + optax + Orbax.

``python -m mnemojax._src.bench.baseline_worker --preset tiny --ckpt-dir D --events E
--interval K [--die-at S]`` does what a training job does on every (re)start: import,
initialise the model, restore the latest Orbax checkpoint if there is one, compile, and
train to ``--steps``, saving asynchronously every K steps. No mnemojax runtime is used.

The fault is a real process death: at step ``--die-at`` the worker dispatches the step,
writes a ``fault`` event and sends itself SIGKILL (no cleanup, no final save, an async
save in flight is lost with the process). The orchestrator (`baseline.py`) sees the exit
and starts a new process.

Every phase is an event in the JSONL log (`mnemojax._src.events`), stamped with the pid.
"""

from __future__ import annotations

import time

_T_MAIN = time.time()  # before the heavy imports below (inside main)

import argparse  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402


def open_and_restore(ckpt_dir: str, max_to_keep: int, state, emit):
    """The classical job's Orbax manager (async saves) and the newest committed checkpoint
    restored onto `state`'s shardings (`emit(step=, duration_s=)` after a restore).

    Returns:
        (manager, the step restored or 0, the state).
    """
    import jax
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(
        os.path.abspath(ckpt_dir),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             enable_async_checkpointing=True))
    start = manager.latest_step() or 0
    if start:
        t0 = time.time()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        jax.block_until_ready(state)
        emit(step=start, duration_s=time.time() - t0)
    return manager, start, state

def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mnemojax._src.bench.baseline_worker")
    p.add_argument("--preset", required=True, help="bench preset name or TOML path")
    p.add_argument("--ckpt-dir", required=True, help="Orbax checkpoint directory")
    p.add_argument("--events", required=True, help="JSONL event log (appended)")
    p.add_argument("--run", default="baseline", help="run id in the event log")
    p.add_argument("--interval", type=int, required=True, help="checkpoint every K steps")
    p.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    p.add_argument("--die-at", default="", help="comma-separated steps: SIGKILL itself in "
                   "the first of them after the restored step")
    p.add_argument("--redo-until", type=int, default=0,
                   help="steps <= this were completed by an earlier process (replays)")
    p.add_argument("--launched-at", type=float, default=None,
                   help="unix time the orchestrator started this process")
    p.add_argument("--launch", type=int, default=0, help="launch number (0 = first)")
    p.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache")
    p.add_argument("--final-state", default=None, help="write the final state (.npz)")
    return p.parse_args(argv)


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    VmHWM, not ``ru_maxrss``: Linux keeps ``ru_maxrss`` across fork and execve, so a
    worker would report its parent's peak if the parent's was higher.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    launched_at = args.launched_at if args.launched_at is not None else _T_MAIN
    from mnemojax._src.bench.config import load_preset
    from mnemojax._src.events import EventLog

    cfg = load_preset(args.preset, steps=args.steps)
    if args.interval < 1:
        raise SystemExit(f"--interval={args.interval} is invalid: expected >= 1")
    die_at = sorted(int(s) for s in args.die_at.split(",") if s.strip())
    events = EventLog(args.events, args.run)
    pid = os.getpid()

    import jax

    jax.config.update("jax_num_cpu_devices", cfg.devices)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step, shard_onto

    t_imported = time.time()
    mesh = jax.make_mesh(cfg.mesh, ("data", "model"), devices=jax.devices()[:np.prod(cfg.mesh)],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, optimizer = build_gpt(GPTConfig(**cfg.model), seed=cfg.seed,
                                 learning_rate=cfg.learning_rate)
    shard_onto(model, optimizer, mesh)
    graphdef, state = nnx.split((model, optimizer))
    jax.block_until_ready(state)
    t_init = time.time()
    events.emit("startup", duration_s=t_init - launched_at, time_s=t_init, phase="start+init",
                process_start_import_s=t_imported - launched_at, init_s=t_init - t_imported,
                pid=pid, launch=args.launch)

    manager, start, state = open_and_restore(
        args.ckpt_dir, cfg.checkpoint_max_to_keep, state,
        lambda **fields: events.emit("checkpoint_restore", **fields, pid=pid))

    def pure_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = lm_train_step(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    corpus = BigramCorpus(cfg.model["vocab_size"], cfg.model["seq_len"], seed=cfg.seed)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    t0 = time.time()
    example = jax.device_put(corpus.batch(start, cfg.batch_size), batch_sharding)
    with jax.set_mesh(mesh):
        train_step = jax.jit(pure_step, out_shardings=(state_shardings, None)).lower(
            state, example).compile()
    events.emit("startup", duration_s=time.time() - t0, phase="compile", pid=pid,
                launch=args.launch)

    die = next((s for s in die_at if s > start), None)
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.time()
        batch = jax.device_put(corpus.batch(step - 1, cfg.batch_size), batch_sharding)
        new_state, metrics = train_step(state, batch)
        if step == die:  # the step is in flight: the process dies for real, now
            events.emit("fault", step=step, pid=pid, classification="process_killed",
                        step_started_at=t0, peak_rss_bytes=peak_rss_bytes())
            sys.stdout.flush()
            os.kill(pid, signal.SIGKILL)
        loss = float(metrics["loss"])
        state = new_state
        events.emit("step", step=step, duration_s=time.time() - t0, loss=loss, pid=pid,
                    replay=step <= args.redo_until)
        if step % args.interval == 0 and step < cfg.steps:
            t0 = time.time()
            manager.save(step, args=ocp.args.StandardSave(state))
            events.emit("checkpoint_save", step=step, duration_s=time.time() - t0, pid=pid,
                        blocking=True)
    t0 = time.time()
    manager.wait_until_finished()  # a save still in flight would be lost at exit
    manager.close()
    events.emit("checkpoint_save", step=cfg.steps, duration_s=time.time() - t0, pid=pid,
                blocking=True, drain=True)
    if args.final_state:
        leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
        np.savez(args.final_state, *leaves)
    events.emit("run_end", step=cfg.steps, steps=cfg.steps, pid=pid,
                peak_rss_bytes=peak_rss_bytes())
    events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
