"""Micro-benchmarks behind design decisions in WORKSPACE_NOTES.md, side by side in one run.

    python -m mnemojax._src.bench.micro

1. NNX state plumbing per call: ``nnx.split`` + ``nnx.update``, the live ``Variable``
   objects through ``get_value``/``set_value``, and the resilient step's `NnxForm`
   (``state_of`` before the step, ``result`` after it).
2. The step's finiteness check: none, per-device flags (what the step compiles) and one
   global ``jnp.all`` per leaf (a cross-device reduction per leaf).
3. After a recovery: the failed step's whole call against the runtime's ``total_s`` (the
   background compiles start only after the commit, so the two should be close).

Tiny GPT (470 k params), mesh data=4 x model=2, 8 CPU devices. Medians; rounds alternate.
"""

from __future__ import annotations

import statistics
import time


def _median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from flax import nnx

    import mnemojax
    from mnemojax._src import compiler
    from mnemojax._src.step_forms import NnxForm
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step

    cfg = GPTConfig()
    corpus = BigramCorpus(cfg.vocab_size, cfg.seq_len)
    batches = [corpus.batch(i, 24) for i in range(42)]
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    # 1. state plumbing
    model, optimizer = build_gpt(cfg)
    live = jax.tree.leaves(nnx.state((model, optimizer)),
                           is_leaf=lambda x: isinstance(x, nnx.Variable))
    form = NnxForm(lm_train_step, model, optimizer)

    def split_update():
        _, state = nnx.split((model, optimizer))
        nnx.update((model, optimizer), state)

    def get_set():
        for v in live:
            v.set_value(v.get_value())

    state_args = (model, optimizer)

    def read_write():
        form.result(state_args, form.state_of(state_args), None)

    plumbing = {"nnx.split + nnx.update": _median_ms(split_update, 200),
                "Variable get_value/set_value": _median_ms(get_set, 200),
                "NnxForm.state_of+result (used)": _median_ms(read_write, 200)}

    # 2. finiteness check variants
    per_device = compiler.StepCompiler._checked_for

    def global_per_leaf(self, mesh_):
        def checked(leaves, batch):
            new, metrics = self._pure(leaves, batch)
            flags = [jnp.all(jnp.isfinite(x)) for x in new
                     if jnp.issubdtype(x.dtype, jnp.inexact)]
            return new, metrics, jnp.reshape(jnp.all(jnp.stack(flags)), (1,))
        return checked

    def no_check(self, mesh_):
        def checked(leaves, batch):
            new, metrics = self._pure(leaves, batch)
            return new, metrics, jnp.ones((1,), bool)
        return checked

    options = mnemojax.ResilienceOptions(
        snapshot=mnemojax.SnapshotOptions(every_steps=0, unreplicated_every_steps=0),
        compile=mnemojax.CompileOptions(precompile=False, cache_dir=None))
    variants = {"no check": no_check, "per-device flags (used)": per_device,
                "global jnp.all per leaf": global_per_leaf}
    check_ms: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3):
        for name, make in variants.items():
            compiler.StepCompiler._checked_for = make
            m, o = build_gpt(cfg)
            step = mnemojax.resilient(lm_train_step, mesh=mesh, options=options)
            step(m, o, batches[0])
            it = iter(batches[1:])
            check_ms[name].append(_median_ms(lambda s=step, m=m, o=o, it=it: float(
                s(m, o, next(it))["loss"]), 40))
            step.close()
    compiler.StepCompiler._checked_for = per_device

    # 3. the failed step's call against total_s
    m, o = build_gpt(cfg)
    faults = mnemojax.testing.FaultInjector().lose_devices(8, [3])
    step = mnemojax.resilient(lm_train_step, mesh=mesh, fault_injector=faults)
    calls = []
    for i, batch in enumerate(batches[:12]):
        t = time.perf_counter()
        step(m, o, batch)
        calls.append(time.perf_counter() - t)
        if i == 0:
            step.wait_precompiled()
    [rec] = step.statistics.recoveries
    step.close()

    print("1. NNX state plumbing per call (median of 200; demo GPT, 92 variables)")
    for name, ms in plumbing.items():
        print(f"   {name:<32} {ms:8.3f} ms")
    print("2. step time by finiteness check (median of 40 steps; three alternating rounds)")
    base = statistics.median(check_ms["no check"])
    for name, ms in check_ms.items():
        med = statistics.median(ms)
        print(f"   {name:<32} {med:8.2f} ms   x{med / base:.3f}   rounds "
              + ", ".join(f"{x:.2f}" for x in ms))
    print("3. recovery of a device lost in step 8 (executable compiled ahead)")
    print(f"   whole call of step 8         {1e3 * calls[7]:8.1f} ms")
    print(f"   runtime total_s              {1e3 * rec.total_s:8.1f} ms")
    print(f"   steady step (median 2-7)     {1e3 * statistics.median(calls[1:7]):8.1f} ms")


if __name__ == "__main__":
    main()
