"""What the watch for world reads costs a trace (`compiler._world_reads_while`).

    PYTHONPATH=. python -m tests.jobs.watched_trace [--rounds 4]

One process, 8 CPU devices: the bench's tiny GPT train step (`configs/bench_tiny.toml`)
exported with ``jax.export`` plainly and under the watch, alternating, JAX's caches cleared
before each. Prints every time and the medians. Why process 0 watches its first compile
rather than its first export: that export is on every process's path to the candidate
worlds (WORKSPACE_NOTES.md, session 14).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import tomllib
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.jobs.watched_trace")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax import export as jax_export

    from mnemojax._src.compiler import _world_reads_while
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step

    preset = Path(__file__).resolve().parents[2] / "configs" / "bench_tiny.toml"
    cfg = tomllib.loads(preset.read_text())
    model, optimizer = build_gpt(GPTConfig(**cfg["model"]), seed=0, learning_rate=3e-3)
    graphdef, state = nnx.split((model, optimizer))

    def pure(state, batch):
        m, o = nnx.merge(graphdef, state)
        metrics = lm_train_step(m, o, batch)
        return nnx.state((m, o)), metrics

    corpus = BigramCorpus(cfg["model"]["vocab_size"], cfg["model"]["seq_len"], seed=0)
    batch = jax.tree.map(jnp.asarray, corpus.batch(0, cfg["batch_size"]))
    times: dict[str, list[float]] = {"plain": [], "watched": []}
    for _ in range(args.rounds):
        for mode in times:
            jax.clear_caches()
            t = time.perf_counter()
            export = jax_export.export(jax.jit(pure))
            if mode == "plain":
                export(state, batch)
            else:
                _, reads = _world_reads_while(lambda e=export: e(state, batch))
                assert not reads, reads
            times[mode].append(time.perf_counter() - t)
    for mode, ts in times.items():
        print(f"{mode:8s} export: {' '.join(f'{t:.3f}' for t in ts)} s, "
              f"median {statistics.median(ts):.3f} s")
    ratio = statistics.median(times["watched"]) / statistics.median(times["plain"])
    print(f"watched / plain: {ratio:.2f}x")


if __name__ == "__main__":
    main()
