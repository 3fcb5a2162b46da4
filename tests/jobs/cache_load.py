"""How long loading a step's executable from JAX's persistent compilation cache takes, and
where the time goes (issue 13: the ``compile`` phase of a recovery whose executable is
``cached``).

    PYTHONPATH=. python -m tests.jobs.cache_load [--loads 3]

One process, 8 CPU devices: the bench's tiny GPT train step on a (3, 2) mesh (the world of
3 processes that the two-kill job forms after its first kill) is compiled once into a fresh
cache directory, then, after ``jax.clear_caches()``, lowered and compiled again ``--loads``
times, each a cache hit. Prints each load's lower and compile times and the top of a
`cProfile` of the last compile (``get_executable_and_time`` is XLA deserialising it).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.jobs.cache_load")
    p.add_argument("--loads", type=int, default=3)
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    from flax import nnx

    from mnemojax._src.bench.config import load_preset
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step

    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="mnemojax-cl-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cfg = load_preset("tiny")
    mesh = jax.make_mesh((3, 2), ("data", "model"), devices=jax.devices()[:6],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    model, optimizer = build_gpt(GPTConfig(**cfg.model), seed=0, learning_rate=1e-3)
    batch = BigramCorpus(cfg.model["vocab_size"], cfg.model["seq_len"], seed=0).batch(
        0, cfg.batch_size)
    graph, state = nnx.split((model, optimizer))

    def pure(state, batch):
        model, optimizer = nnx.merge(graph, state)
        metrics = lm_train_step(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    def struct(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

    profile = cProfile.Profile()
    for i in range(args.loads + 1):
        jax.clear_caches()
        with jax.set_mesh(mesh):
            t0 = time.perf_counter()
            lowered = jax.jit(pure).lower(struct(state), struct(batch))
            t1 = time.perf_counter()
            if i == args.loads:
                profile.enable()
            lowered.compile()
            profile.disable()
            t2 = time.perf_counter()
        what = "first compile (writes the entry)" if i == 0 else f"load {i} from the cache"
        print(f"{what}: lower {t1 - t0:.3f} s, compile {t2 - t1:.3f} s")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
