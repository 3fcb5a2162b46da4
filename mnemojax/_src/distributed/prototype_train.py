"""Prototype worker: a tiny MLP, data-parallel over every process's devices, that survives
the loss of a peer process in-process (run it under ``mnemojax launch``).

Parameters are sharded along the data axis where a dimension divides (FSDP-like), so each
worker owns distinct shards and a replicated leaf is owned by one worker only; losing a
worker therefore loses state that only its agent and its buddy still hold. Every step is
snapshotted into the agent's shared memory. On a collective failure the worker runs
`recovery.recover_world`, rebuilds the mesh over the new world's devices, restores the
agreed step, compiles, waits at a barrier and replays with the same global batches.

Events (wall times) go to ``--out/events-w{worker_id}.jsonl``; world 0's rank-0 writes the
final parameters to ``--out/final.npz``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

IN, HIDDEN, OUT, BATCH = 8, 48, 8, 48


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"b1": np.zeros(HIDDEN, np.float32), "b2": np.zeros(OUT, np.float32),
            "w1": (rng.standard_normal((IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
            "w2": (rng.standard_normal((HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32)}


def batch_for(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step`` (the same in every process and every run)."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    return x, np.tanh(x @ np.ones((IN, OUT), np.float32) / IN).astype(np.float32)


def make_step():
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.adam(1e-2)

    def loss_fn(p, x, y):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    def step(state, x, y):
        params, opt = state
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), loss

    return tx, step


def reference_params(steps: int) -> dict[str, np.ndarray]:
    """The failure-free result on one device (no distributed runtime)."""
    import jax

    tx, step = make_step()
    params = jax.tree.map(jax.numpy.asarray, init_params())
    state = (params, tx.init(params))
    f = jax.jit(step)
    for s in range(1, steps + 1):
        state, _ = f(state, *batch_for(s))
    return {k: np.asarray(v) for k, v in state[0].items()}


def _spec_for(shape, n):
    from jax.sharding import PartitionSpec as P
    for d in reversed(range(len(shape))):
        if shape[d] % n == 0 and shape[d] >= n:
            return P(*([None] * d + ["data"]))
    return P()


class Trainer:
    """The worker's model, mesh and compiled step for one world."""

    def __init__(self, generation: int):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from mnemojax._src.distributed import coordination
        self.tx, step = make_step()
        devices = jax.devices()
        self.mesh = jax.make_mesh((len(devices),), ("data",), devices=devices,
                                  axis_types=(jax.sharding.AxisType.Auto,))
        params = init_params()
        abstract = jax.eval_shape(lambda: (params, self.tx.init(params)))
        self.treedef = jax.tree.structure(abstract)
        leaves = jax.tree.leaves(abstract)
        self.shardings = [NamedSharding(self.mesh, _spec_for(a.shape, len(devices)))
                          for a in leaves]
        shard_tree = jax.tree.unflatten(self.treedef, self.shardings)
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        rep = NamedSharding(self.mesh, P())
        x, y = batch_for(1)
        t = time.perf_counter()
        self.compiled = jax.jit(step, in_shardings=(shard_tree, self.batch_sharding,
                                                    self.batch_sharding),
                                out_shardings=(shard_tree, rep)).lower(
            abstract, jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(y.shape, y.dtype)).compile()
        self.compile_s = time.perf_counter() - t
        coordination.barrier(f"compiled-{generation}")  # no peer still compiling (DESIGN §4)

    def initial_state(self):
        import jax
        params = init_params()
        host = jax.tree.leaves((params, self.tx.init(params)))
        return [jax.make_array_from_callback(np.shape(v), s, lambda i, v=v: np.asarray(v)[i])
                for v, s in zip(host, self.shardings, strict=True)]

    def run_step(self, leaves, step: int):
        import jax
        x, y = batch_for(step)
        xs = jax.make_array_from_callback(x.shape, self.batch_sharding, lambda i: x[i])
        ys = jax.make_array_from_callback(y.shape, self.batch_sharding, lambda i: y[i])
        state, loss = self.compiled(jax.tree.unflatten(self.treedef, leaves), xs, ys)
        loss = float(loss)  # blocks: a failure surfaces within its own step
        return jax.tree.leaves(state), loss


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mnemojax._src.distributed.prototype_train")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True)
    p.add_argument("--step-sleep-s", type=float, default=0.0, help="pace steps (demos)")
    p.add_argument("--hang-worker", type=int, default=-1, help="this worker hangs ...")
    p.add_argument("--hang-at-step", type=int, default=-1, help="... before this step")
    args = p.parse_args(argv)

    from mnemojax._src.distributed import coordination, snapshot_codec, state_transfer
    from mnemojax._src.distributed.agent_client import AgentClient
    from mnemojax._src.distributed.agreement import LauncherCoordinator
    from mnemojax._src.distributed.recovery import recover_world

    world = coordination.initialize_worker()
    wid = world.stable_id
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"events-w{wid}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def event(op, **kw):
        log.write(json.dumps({"op": op, "t": time.time(), "worker_id": wid, **kw}) + "\n")

    agent = AgentClient(world.agent) if world.agent else None
    coordinator = LauncherCoordinator(world.control, wid) if world.control else None
    if agent:
        agent.phase("compile")
    trainer = Trainer(world.generation)
    event("compiled", generation=world.generation, compile_s=trainer.compile_s)
    leaves, step = trainer.initial_state(), 0
    if agent:
        agent.phase("train")
    while step < args.steps:
        if wid == args.hang_worker and step + 1 == args.hang_at_step and world.generation == 0:
            event("hanging", step=step + 1)
            time.sleep(3600)
        try:
            leaves, loss = trainer.run_step(leaves, step + 1)
            error = None
        except Exception as e:  # a peer failure surfaces as a JaxRuntimeError from gloo
            if coordinator is None:
                raise
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            event("detect", step=step + 1, error=error[:400])
            if agent:
                agent.phase("recover")
            # Drop every array of the old world before detaching: the backend (and its gloo
            # sockets) is freed only then, which fails peers still blocked on us at once.
            leaves = trainer = None
            gc.collect()
            rec = recover_world(coordinator, world, last_step=step, reason=error,
                                own_agent=world.agent)
            world = rec.world
            event("reinitialized", generation=world.generation, process_id=world.process_id,
                  resume_step=rec.agreement.resume_step, phases=rec.phases,
                  fetched_from={str(k): v for k, v in rec.fetched_from.items()})
            t = time.perf_counter()
            trainer = Trainer(world.generation)
            leaves = state_transfer.restore_leaves(rec.payloads, trainer.shardings)
            step = rec.agreement.resume_step
            event("rebuilt", generation=world.generation, compile_s=trainer.compile_s,
                  rebuild_s=time.perf_counter() - t)
            if agent:
                agent.phase("train")
            continue
        step += 1
        if agent:
            agent.publish(step, snapshot_codec.pack(step, wid, state_transfer.local_shards(leaves)))
        event("step", step=step, loss=loss, generation=world.generation)
        if args.step_sleep_s:
            time.sleep(args.step_sleep_s)
    if agent:
        agent.phase("finish")
    from jax.experimental import multihost_utils
    params = jax_tree_params(trainer, leaves)
    full = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for k, v in params.items()}
    if world.process_id == 0:
        np.savez(os.path.join(args.out, "final.npz"), **full)
    coordination.barrier(f"done-{world.generation}")
    event("done", step=step, generation=world.generation)
    return 0


def jax_tree_params(trainer: Trainer, leaves):
    import jax
    return jax.tree.unflatten(trainer.treedef, leaves)[0]


if __name__ == "__main__":
    sys.exit(main())
