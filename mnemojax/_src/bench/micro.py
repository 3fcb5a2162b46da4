"""Micro-benchmarks behind design decisions in WORKSPACE_NOTES.md, side by side in one run.

    python -m mnemojax._src.bench.micro            # all sections
    python -m mnemojax._src.bench.micro 4          # only section 4 (any subset of 1-10)

1. NNX state plumbing per call: ``nnx.split`` + ``nnx.update``, the live ``Variable``
   objects through ``get_value``/``set_value``, and the resilient step's `NnxForm`
   (``state_of`` before the step, ``result`` after it, and the check that the objects'
   graph did not change in place, ``changed_in_place``).
2. The step's finiteness check: none, per-device flags (what the step compiles) and one
   global ``jnp.all`` per leaf (a cross-device reduction per leaf).
3. After a recovery: the failed step's whole call against the runtime's ``total_s`` (the
   background compiles start only after the commit, so the two should be close), its
   reshard and replay, without and with `CompileOptions.warm_fallbacks` (and what the
   warm-ups cost the steps before).
4. Every-step snapshots: step time without snapshots and with one every step (blocks of
   steps, the order alternating per round), the snapshot's bytes and copy time (during
   training and alone), and its throughput as a percentage of this machine's memcpy
   bandwidth (``np.copyto`` of the same byte count).

5. Lowering the step for a new mesh (the tracing left on a recovery's critical path after
   compile ahead, issue 13): ``jax.jit(step).lower`` of a fresh jit (as a new world
   does) against lowering a fresh ``jax.jit(exported.call)`` of a ``jax.export`` of the
   same step made earlier (an `Exported` holds the module and its shardings, no device
   or client), and that both compute the same step.

6. The every-step host copy, in the bench's layout (its tiny GPT on the 4 x 2 mesh, where
   the step is short; a plain jitted step): the snapshot store's copy thread reading every
   leaf's shards (what the resilient step does with `SnapshotOptions(pack_copies=False)`),
   the same reading the packs the step also writes (per device, the shards of the leaves
   sharded over the same mesh axes and of one dtype side by side: `compiler.pack_groups`,
   the resilient step's default on CPU), and a step that also returns its new state with
   ``memory_kind="pinned_host"`` shardings (XLA copies it; the last two kept, as the
   store's two slots: a route measured, not used).

7. The first lowering of the step from a deserialised export in a fresh process, cold and
   after `compiler.warm_export_lowering` (what a process that compiled no candidate world
   pays in a new world's compile phase, issue 13): each run in its own process.

8. A second device loss right after a recovery (issue 13, item 5: "a fault soon after a
   recovery costs no more than one cold compile"): device 3 lost in step 8 (its mesh
   compiled ahead), device 5 in step 9, while the new mesh's candidates compile in the
   background; no persistent cache (in a process of its own: an earlier section's step
   turns it on for its process). The second recovery's compile phase and total against
   one cold compile of the same mesh's step alone (caches cleared, nothing in the
   background); with the compiles ahead in the compile process (the default: paused
   while the recovery compiles) and on a thread (``compile_process=False``).

9. Steps beside the compiles ahead (issue 13: after the first step, and after each
   recovery, the candidate meshes compile in the background and the steps share the
   cores with them): each step's time while compiles ahead are pending, and after, with
   them on a thread (``compile_process=False``) and in the compile process at nice 0
   (the default), 10 and 19 (``compile_process_nice``); no persistent cache; in a
   process of its own.

10. Frozen weights (a LoRA fine-tune: four 256 x 256 layers frozen, rank-8 LoRA on each
    trained with Adam, ``nnx.Optimizer(..., wrt=nnx.LoRAParam)``; 84 % of the state
    frozen): every-step snapshots with the frozen base copied once and shared by both
    slots (`SnapshotOptions.share_unchanged_leaves`, the default) against copied every
    time, and no snapshots: step time (alternating blocks), each copy's time, and the
    host memory the snapshots hold.

Sections 1-5 and 7-9: tiny GPT (470 k params), mesh data=4 x model=2, 8 CPU devices. Medians; rounds alternate.
"""

from __future__ import annotations

import argparse
import statistics
import time


def median_ms(fn, n: int) -> float:
    """Median milliseconds of ``n`` calls of ``fn`` (also `gpu_check`)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def _plumbing(cfg) -> list[str]:
    import jax
    from flax import nnx

    from mnemojax._src.step_forms import NnxForm
    from mnemojax.models.tasks import build_gpt, lm_train_step

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

    plumbing = {"nnx.split + nnx.update": median_ms(split_update, 200),
                "Variable get_value/set_value": median_ms(get_set, 200),
                "NnxForm.state_of+result (used)": median_ms(read_write, 200),
                # (each call: did the graph change in place, e.g. a submodule replaced?)
                "NnxForm.changed_in_place (used)": median_ms(form.changed_in_place, 200)}
    lines = ["1. NNX state plumbing per call (median of 200; demo GPT, 92 variables)"]
    lines += [f"   {name:<32} {ms:8.3f} ms" for name, ms in plumbing.items()]
    return lines


def _finiteness_check(cfg, mesh, batches) -> list[str]:
    import jax.numpy as jnp

    import mnemojax
    from mnemojax._src import compiler
    from mnemojax.models.tasks import build_gpt, lm_train_step

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
            check_ms[name].append(median_ms(lambda s=step, m=m, o=o, it=it: float(
                s(m, o, next(it))["loss"]), 40))
            step.close()
    compiler.StepCompiler._checked_for = per_device

    lines = ["2. step time by finiteness check (median of 40 steps; three alternating rounds)"]
    base = statistics.median(check_ms["no check"])
    for name, ms in check_ms.items():
        med = statistics.median(ms)
        lines.append(f"   {name:<32} {med:8.2f} ms   x{med / base:.3f}   rounds "
                     + ", ".join(f"{x:.2f}" for x in ms))
    return lines


def _recovery_call(cfg, mesh, batches) -> list[str]:
    import mnemojax
    from mnemojax.models.tasks import build_gpt, lm_train_step

    lines = ["3. recovery of a device lost in step 8 (executables compiled ahead), without "
             "and with CompileOptions(warm_fallbacks=True)"]
    for warm in (False, True):
        m, o = build_gpt(cfg)
        faults = mnemojax.testing.FaultInjector().lose_devices(8, [3])
        step = mnemojax.resilient(
            lm_train_step, mesh=mesh, fault_injector=faults,
            options=mnemojax.ResilienceOptions(
                compile=mnemojax.CompileOptions(warm_fallbacks=warm)))
        calls, warming = [], []  # per call: seconds, and whether it ran a warm-up
        for i, batch in enumerate(batches[:14]):
            before = step._built.runtime.compiler.warmed if step._built else 0
            t = time.perf_counter()
            step(m, o, batch)
            calls.append(time.perf_counter() - t)
            warming.append(step._require_built().runtime.compiler.warmed > before)
            if i == 0:
                step.wait_precompiled()
        [rec] = step.statistics.recoveries
        warmed = step._require_built().runtime.compiler.warmed
        step.close()
        # On the new mesh, calls that ran no warm-up (the new candidates' warm-ups follow)
        steady = statistics.median([c for c, w in zip(calls[8:], warming[8:], strict=True)
                                    if not w] or calls[8:])
        lines += [
            f"   warm_fallbacks={warm}: {warmed} executables warmed in steps 2-7",
            f"     whole call of step 8       {1e3 * calls[7]:8.1f} ms",
            f"     runtime total_s            {1e3 * rec.total_s:8.1f} ms "
            f"(reshard {1e3 * rec.phases_s['reshard']:.1f}, replay "
            f"{1e3 * rec.phases_s['replay']:.1f}: {rec.phases_s['replay'] / steady:.1f} "
            "step times)",
            f"     steps 2-7 (median, max)    {1e3 * statistics.median(calls[1:7]):8.1f}, "
            f"{1e3 * max(calls[1:7]):.1f} ms",
            f"     steps 9-14 without a warm-up (median) {1e3 * steady:.1f} ms"]
    return lines


def _section_in_child(section: int) -> list[str]:
    """Sections 8 and 9 in a fresh process each: an earlier section's resilient step turns
    JAX's persistent compilation cache on for its process, and their compiles would then
    load its entries (a run of sections 3 and 8 measured a 0.36 s "cold" compile, 1.9 s
    in a process of its own)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mnemojax._src.bench.micro", str(section),
                          "--section-child"], capture_output=True, text=True,
                         check=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])["lines"]


def _loss_after_recovery(cfg, mesh, batches) -> list[str]:
    import jax

    import mnemojax
    from mnemojax._src.replay import batch_struct
    from mnemojax.models.tasks import build_gpt, lm_train_step
    from mnemojax.testing import FaultInjector

    lines = ["8. a second device loss right after a recovery (no persistent cache)"]
    for in_child in (True, False):
        jax.clear_caches()
        m, o = build_gpt(cfg)
        faults = FaultInjector().lose_devices(8, [3]).lose_devices(9, [5])
        step = mnemojax.resilient(
            lm_train_step, mesh=mesh, fault_injector=faults,
            options=mnemojax.ResilienceOptions(compile=mnemojax.CompileOptions(
                cache_dir=None, compile_process=in_child)))
        for i, batch in enumerate(batches[:11]):
            step(m, o, batch)
            if i == 0:
                step.wait_precompiled()
        first, second = step.statistics.recoveries
        runtime = step._require_built().runtime
        compiler, plan = runtime.compiler, runtime.proxy.plan
        step.wait_precompiled()
        jax.clear_caches()
        t = time.perf_counter()
        compiler._compile(plan, batch_struct(step._batches.last, plan.examples_per_step),
                          ahead=False)
        cold = time.perf_counter() - t
        in_child_n = compiler.compiled_in_child
        step.close()
        lines += [
            f"   compile_process={in_child} ({in_child_n} compiles ahead ran in the child)",
            f"   first recovery (step 8)    total {first.total_s:6.2f} s, compile "
            f"{first.phases_s.get('compile', 0.0):.2f} s, executable {first.executable}",
            f"   second recovery (step 9)   total {second.total_s:6.2f} s, compile "
            f"{second.phases_s.get('compile', 0.0):.2f} s, executable {second.executable}",
            f"   one cold compile of mesh {dict(plan.shape)} alone: {cold:.2f} s; second "
            f"recovery / cold compile = x{second.total_s / cold:.2f}"]
    return lines


def _steps_beside_compiles(cfg, mesh, batches, *, rounds: int = 2) -> list[str]:
    import jax

    import mnemojax
    from mnemojax._src import compile_process
    from mnemojax.models.tasks import build_gpt, lm_train_step

    modes = {"on a thread": (False, 0), "child, nice 0": (True, 0),
             "child, nice 10": (True, 10), "child, nice 19": (True, 19)}
    runs: dict[str, list[tuple[float, int, float, float, int]]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            in_child, nice = modes[mode]
            compile_process.retire_idle()  # (each round starts its child afresh)
            jax.clear_caches()
            m, o = build_gpt(cfg)
            step = mnemojax.resilient(
                lm_train_step, mesh=mesh, options=mnemojax.ResilienceOptions(
                    compile=mnemojax.CompileOptions(cache_dir=None, compile_process=in_child,
                                                    compile_process_nice=nice)))
            step(m, o, batches[0])
            compiler = step._require_built().runtime.compiler
            during, i, t0 = [], 1, time.perf_counter()
            while compiler.pending() and i < 2000:
                t = time.perf_counter()
                jax.block_until_ready(step(m, o, batches[i % len(batches)]))
                during.append(time.perf_counter() - t)
                i += 1
            ready = time.perf_counter() - t0
            steady = []
            for j in range(20):
                t = time.perf_counter()
                jax.block_until_ready(step(m, o, batches[(i + j) % len(batches)]))
                steady.append(time.perf_counter() - t)
            runs[mode].append((statistics.median(during), len(during), ready,
                               statistics.median(steady), compiler.compiled_in_child))
            step.close()
    lines = [f"9. steps beside the compiles ahead after the first step (no persistent cache; "
             f"{rounds} rounds, the order reversed each; medians)"]
    for mode, rs in runs.items():
        during = statistics.median(r[0] for r in rs)
        steady = statistics.median(r[3] for r in rs)
        lines += [
            f"   {mode:<15} step during {1e3 * during:6.1f} ms, after {1e3 * steady:6.1f} ms "
            f"(x{during / steady:.2f}); compiles ahead ready in "
            f"{statistics.median(r[2] for r in rs):5.1f} s, over "
            f"{statistics.median(r[1] for r in rs):.0f} steps ({min(r[4] for r in rs)}-"
            f"{max(r[4] for r in rs)} in the child)"]
    return lines


def _snapshot_overhead(cfg, mesh, batches, *, rounds: int, block_steps: int) -> list[str]:
    import numpy as np

    import mnemojax
    from mnemojax._src.checksum import checksum
    from mnemojax._src.device_layer import JaxDeviceLayer
    from mnemojax._src.snapshot import SnapshotStore
    from mnemojax._src.timing import interleaved_block_means
    from mnemojax.models.tasks import build_gpt, lm_train_step

    configs = {"no snapshots": mnemojax.SnapshotOptions(every_steps=0,
                                                        unreplicated_every_steps=0),
               "snapshot every step": mnemojax.SnapshotOptions(every_steps=1,
                                                               unreplicated_every_steps=1)}
    runs = {}
    for name, snap in configs.items():
        options = mnemojax.ResilienceOptions(
            snapshot=snap, compile=mnemojax.CompileOptions(precompile=False, cache_dir=None))
        m, o = build_gpt(cfg)
        step = mnemojax.resilient(lm_train_step, mesh=mesh, options=options)
        float(step(m, o, batches[0])["loss"])
        runs[name] = (step, m, o)

    cpu_s: dict[str, list[float]] = {name: [] for name in runs}

    def run_block(name: str, r: int) -> int:
        step, m, o = runs[name]
        cpu0 = time.process_time()
        for i in range(block_steps):
            float(step(m, o, batches[1 + (r * block_steps + i) % (len(batches) - 1)])["loss"])
        step.wait_snapshots()  # a copy still in flight belongs to this block
        cpu_s[name].append((time.process_time() - cpu0) / block_steps)
        return block_steps

    means = interleaved_block_means(list(runs), rounds, run_block)
    stats = runs["snapshot every step"][0].statistics
    nbytes, in_training_s = stats.snapshot_bytes, stats.snapshot_copy_median_s
    # The same copy with nothing else running: after each step of the run without
    # snapshots, a copy of its fresh output (JAX builds an output's per-device arrays on
    # first use, so copying one state over and over would flatter the copy), once the
    # step's threads have gone idle (XLA's CPU thread pool spins for a while after a step).
    step, m, o = runs["no snapshots"]
    store = None
    for i in range(30):
        float(step(m, o, batches[1 + i % (len(batches) - 1)])["loss"])
        time.sleep(0.05)
        leaves = step._built.last_written  # noqa: SLF001 - our own package's bench
        if store is None:
            store = SnapshotStore(JaxDeviceLayer(), ["state"] * len(leaves),
                                  budget_bytes=1 << 40)
        store.submit(i, leaves)
        store.wait_idle()
    assert store is not None
    store.close()
    alone_s = store.median_copy_s()
    for step, _, _ in runs.values():
        step.close()
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    memcpy_ms = median_ms(lambda: np.copyto(dst, src), 50)
    checksum_ms = median_ms(lambda: checksum(dst), 50)

    base = statistics.median(means["no snapshots"])
    per_round = [b / a for a, b in zip(means["no snapshots"], means["snapshot every step"],
                                       strict=True)]
    lines = [f"4. every-step snapshots (median of {rounds} alternating blocks of "
             f"{block_steps} steps)"]
    for name, ms in means.items():
        med = statistics.median(ms)
        lines.append(f"   {name:<32} {1e3 * med:8.2f} ms   x{med / base:.3f}   blocks "
                     + ", ".join(f"{1e3 * x:.1f}" for x in ms))
    lines += [
        f"   ratio per round (median)         x{statistics.median(per_round):.3f}   "
        f"min x{min(per_round):.3f} max x{max(per_round):.3f}",
        "   process CPU per step (median)    "
        + " -> ".join(f"{1e3 * statistics.median(c):.1f} ms" for c in cpu_s.values())
        + "   (all threads: the copy competes with the step for the cores)",
        f"   snapshot bytes                   {nbytes / 1e6:8.2f} MB",
        f"   copy, during training (median)   {1e3 * in_training_s:8.2f} ms   "
        f"{nbytes / in_training_s / 1e9:5.2f} GB/s   "
        f"{100 * memcpy_ms / (1e3 * in_training_s):5.1f} % of memcpy",
        f"   copy, alone (median of 30)       {1e3 * alone_s:8.2f} ms   "
        f"{nbytes / alone_s / 1e9:5.2f} GB/s   {100 * memcpy_ms / (1e3 * alone_s):5.1f} % of memcpy",
        f"   memcpy of the same bytes         {memcpy_ms:8.2f} ms   "
        f"{nbytes / memcpy_ms / 1e6:5.2f} GB/s   (np.copyto, median of 50)",
        f"   checksum of the same bytes       {checksum_ms:8.2f} ms   (one buffer)",
    ]
    return lines


def _frozen_weights(mesh, *, rounds: int, block_steps: int) -> list[str]:
    import numpy as np

    import mnemojax
    from mnemojax._src.timing import interleaved_block_means
    from mnemojax.models.tasks import build_lora_mlp, lora_train_step

    width, layers, rank = 256, 4, 8
    widths = (width,) * (layers + 1)

    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(64, width)).astype(np.float32),
                "y": rng.normal(size=(64, width)).astype(np.float32)} for _ in range(16)]
    configs = {"no snapshots": mnemojax.SnapshotOptions(every_steps=0,
                                                        unreplicated_every_steps=0),
               "every step, base copied each time": mnemojax.SnapshotOptions(
                   every_steps=1, unreplicated_every_steps=1, share_unchanged_leaves=False),
               "every step, base copied once": mnemojax.SnapshotOptions(
                   every_steps=1, unreplicated_every_steps=1)}
    runs = {}
    for name, snap in configs.items():
        options = mnemojax.ResilienceOptions(
            snapshot=snap, compile=mnemojax.CompileOptions(precompile=False, cache_dir=None))
        model, optimizer = build_lora_mlp(widths=widths, rank=rank, learning_rate=1e-3)
        step = mnemojax.resilient(lora_train_step, mesh=mesh, options=options)
        float(step(model, optimizer, batches[0])["loss"])
        runs[name] = (step, model, optimizer)

    def run_block(name: str, r: int) -> int:
        step, m, o = runs[name]
        for i in range(block_steps):
            float(step(m, o, batches[1 + (r * block_steps + i) % (len(batches) - 1)])["loss"])
        step.wait_snapshots()  # a copy still in flight belongs to this block
        return block_steps

    means = interleaved_block_means(list(runs), rounds, run_block)
    base = statistics.median(means["no snapshots"])
    lines = [f"10. frozen weights, every-step snapshots (LoRA MLP {layers} x {width}^2 frozen, "
             f"rank {rank}; median of {rounds} alternating blocks of {block_steps} steps)"]
    for name, ms in means.items():
        med = statistics.median(ms)
        stats = runs[name][0].statistics
        extra = "" if not stats.snapshot_bytes else (
            f"   copy {1e3 * stats.snapshot_copy_median_s:6.2f} ms   snapshot "
            f"{stats.snapshot_bytes / 1e6:.2f} MB (frozen {stats.snapshot_shared_bytes / 1e6:.2f}"
            f" MB shared)   host {stats.snapshot_host_bytes / 1e6:.2f} MB")
        lines.append(f"   {name:<34} {1e3 * med:7.2f} ms   x{med / base:.3f}{extra}")
    for step, _, _ in runs.values():
        step.close()
    return lines


def _host_outputs(mesh, *, rounds: int, block_steps: int) -> list[str]:
    import jax
    import numpy as np
    from flax import nnx

    from mnemojax._src.bench.config import load_preset
    from mnemojax._src.compiler import pack_groups, packer
    from mnemojax._src.device_layer import JaxDeviceLayer
    from mnemojax._src.snapshot import Packed, SnapshotStore
    from mnemojax._src.timing import interleaved_block_means
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig
    from mnemojax.models.tasks import build_gpt, lm_train_step, shard_onto

    # The bench's tiny GPT in the bench's layout: a short step, where bench (b)/(a) shows
    # the snapshot's cost.
    preset = load_preset("tiny")
    cfg = GPTConfig(**preset.model)
    corpus = BigramCorpus(cfg.vocab_size, cfg.seq_len)
    batches = [corpus.batch(i, preset.batch_size) for i in range(42)]
    model, optimizer = build_gpt(cfg)
    shard_onto(model, optimizer, mesh)
    graphdef, state = nnx.split((model, optimizer))
    leaves, treedef = jax.tree.flatten(state)
    shardings = [x.sharding for x in leaves]
    specs = [s.spec for s in shardings]
    # As the resilient step packs (`SnapshotOptions.pack_copies`): leaves sharded over the
    # same mesh axes, of one dtype, side by side in one array per device.
    groups = pack_groups(specs, [(x.shape, x.dtype) for x in leaves], mesh)
    assert groups is not None
    packers = [packer(mesh, [specs[i] for i in members], axes) for axes, members in groups]
    members = [m for _, m in groups]
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
    placed = [jax.device_put(b, batch_sharding) for b in batches]

    def step(leaves, batch):
        m, o = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        metrics = lm_train_step(m, o, batch)
        return jax.tree.leaves(nnx.state((m, o))), metrics

    def step_and_copy(leaves, batch):
        new, metrics = step(leaves, batch)
        return new, metrics, new

    def step_and_pack(leaves, batch):
        new, metrics = step(leaves, batch)
        return new, metrics, [pack(*(new[i] for i in m)) for pack, m in zip(
            packers, members, strict=True)]

    # No donation (the resilient step's default): the store's copy thread reads the
    # outputs while the next step runs.
    plain = jax.jit(step, out_shardings=(shardings, None)).lower(leaves, placed[0]).compile()
    copying = jax.jit(step_and_copy, out_shardings=(
        shardings, None, [s.with_memory_kind("pinned_host") for s in shardings])).lower(
            leaves, placed[0]).compile()
    packing = jax.jit(step_and_pack, out_shardings=(shardings, None, None)).lower(
        leaves, placed[0]).compile()
    texts = plain.as_text() or "", packing.as_text() or ""
    moved = {c for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce")
             if texts[0].count(c) != texts[1].count(c)}  # (packing moves no data)
    store = SnapshotStore(JaxDeviceLayer(), ["state"] * len(leaves), budget_bytes=1 << 40)
    packed_store = SnapshotStore(JaxDeviceLayer(), ["state"] * len(leaves),
                                 budget_bytes=1 << 40, name="packed")
    names = ("plain", "store", "packed", "host")
    live = {name: list(leaves) for name in names}
    kept: list = []  # the host copies of the last two steps (two slots, as the store)

    def run_block(name: str, r: int) -> int:
        for i in range(block_steps):
            batch = placed[1 + (r * block_steps + i) % (len(placed) - 1)]
            if name == "host":
                live[name], metrics, copy = copying(live[name], batch)
                kept[:] = [*kept[-1:], copy]
            elif name == "packed":
                live[name], metrics, packs = packing(live[name], batch)
                packed_store.submit(r * block_steps + i, live[name], Packed(packs, members))
            else:
                live[name], metrics = plain(live[name], batch)
                if name == "store":
                    store.submit(r * block_steps + i, live[name])
            float(metrics["loss"])
        store.wait_idle()
        packed_store.wait_idle()
        return block_steps

    means = interleaved_block_means(list(names), rounds, run_block)
    # The host copy is the state of its step, in host memory.
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        kept[-1], live["host"], strict=True))
    kinds = {x.sharding.memory_kind for x in kept[-1]}
    per_leaf, packed_copy = store.latest(), packed_store.latest()
    assert per_leaf is not None and packed_copy is not None
    copies = {"store": len(per_leaf.fills), "packed": len(packed_copy.pack_fills)}
    same = same and all(np.array_equal(snap.assemble(i), np.asarray(live[name][i]))
                        for snap, name in ((per_leaf, "store"), (packed_copy, "packed"))
                        for i in range(len(leaves)))
    store.close()
    packed_store.close()
    base = statistics.median(means["plain"])
    labels = {"plain": "jitted step, no snapshot",
              "store": "+ store's copy per leaf",
              "packed": "+ packs, store's copy (default)",
              "host": "+ pinned_host outputs (XLA)"}
    lines = [f"6. every-step host copy: the snapshot store's copy thread against copies "
             f"made by the compiled step (packed, pinned_host) (median of {rounds} "
             f"alternating blocks of {block_steps} steps; a plain jitted step, no resilient "
             f"wrapper; the bench's tiny GPT on mesh {dict(mesh.shape)})"]
    for name, ms in means.items():
        med = statistics.median(ms)
        lines.append(f"   {labels[name]:<32} {1e3 * med:8.2f} ms   x{med / base:.3f}   blocks "
                     + ", ".join(f"{1e3 * x:.1f}" for x in ms))
    lines.append(f"   buffers the store copies per step: {copies['store']} per leaf (a shard "
                 f"per leaf and device, replica 0), {copies['packed']} packed ({len(groups)} "
                 f"packs by mesh axes and dtype); collectives the packing adds: "
                 f"{sorted(moved) or 'none'}")
    lines.append(f"   host copies: memory kind {sorted(kinds)}; every variant's last copy "
                 f"equal to its live state: {same}")
    return lines


def _step_to_lower(cfg, mesh, batches):
    """The tiny GPT's pure step, its shardings on `mesh` and abstract arguments, a lowering
    of any function of them (a fresh jit each time) and the initial leaves."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mnemojax.models.tasks import build_gpt, lm_train_step

    graphdef, state = nnx.split(build_gpt(cfg))
    leaves, treedef = jax.tree.flatten(state)
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    in_shardings = ([rep] * len(leaves), jax.tree.map(lambda _: rows, batches[0]))

    def pure(leaves, batch):
        m, o = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        metrics = lm_train_step(m, o, batch)
        return jax.tree.leaves(nnx.state((m, o))), metrics

    args = ([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep) for x in leaves],
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows),
                         batches[0]))

    def lower(fn):
        with jax.set_mesh(mesh):  # a fresh jit each time: nothing cached by the object
            return jax.jit(fn, in_shardings=in_shardings, donate_argnums=(0,)).lower(*args)

    return pure, in_shardings, args, lower, leaves


def _lowering(cfg, mesh, batches, *, rounds: int = 5) -> list[str]:
    import jax
    import numpy as np
    from jax import export
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    pure, in_shardings, args, lower, leaves = _step_to_lower(cfg, mesh, batches)
    rep = NamedSharding(mesh, P())
    t = time.perf_counter()
    with jax.set_mesh(mesh):
        exported = export.export(jax.jit(pure, in_shardings=in_shardings))(*args)
    export_s = time.perf_counter() - t
    direct, via_export = [], []
    for _ in range(rounds):
        # A new function each time for the direct path: JAX caches traces by function,
        # and a new world's step is traced anew.
        for fn, times in ((lambda *a: pure(*a), direct), (exported.call, via_export)):
            t = time.perf_counter()
            lower(fn)
            times.append(time.perf_counter() - t)
    placed = [jax.device_put(x, rep) for x in leaves]
    batch = jax.device_put(batches[1], in_shardings[1])
    outs = [lower(fn).compile()([jax.numpy.copy(x) for x in placed], batch)
            for fn in (pure, exported.call)]
    same = all(np.allclose(np.asarray(a), np.asarray(b), atol=1e-6)
               for a, b in zip(*(jax.tree.leaves(o) for o in outs), strict=True))
    return [f"5. lowering the step for a mesh (median of {rounds}, a fresh jit each)",
            f"   trace + lower, as a new world does    {1e3 * statistics.median(direct):8.1f} ms"
            f"   first {1e3 * direct[0]:.1f} ms",
            f"   lower jax.jit(exported.call)           "
            f"{1e3 * statistics.median(via_export):8.1f} ms   first {1e3 * via_export[0]:.1f} ms"
            f"   (export made once before: {1e3 * export_s:.1f} ms)",
            f"   ratio (median)                        "
            f"x{statistics.median(direct) / statistics.median(via_export):.1f}",
            f"   the same step computed both ways       {same}"]


def _first_export_lowering_child(cfg, mesh, batches, warm: bool) -> float:
    """In a fresh process: seconds of the first lowering of the step from a deserialised
    export (as a new world's lowering in a process that compiled none), after
    `compiler.warm_export_lowering` and `jax.clear_caches` when ``warm``."""
    import jax
    from jax import export

    from mnemojax._src import compiler

    pure, in_shardings, args, lower, _ = _step_to_lower(cfg, mesh, batches)
    with jax.set_mesh(mesh):
        blob = export.export(jax.jit(pure, in_shardings=in_shardings))(*args).serialize()
    if warm:
        compiler.warm_export_lowering()
        jax.clear_caches()  # as a new world's attach does
    exported = export.deserialize(blob)
    t = time.perf_counter()
    lower(exported.call)
    return time.perf_counter() - t


def _first_export_lowering(*, rounds: int = 3) -> list[str]:
    import json
    import subprocess
    import sys

    times: dict[str, list[float]] = {"cold": [], "warm": []}
    for _ in range(rounds):
        for mode in times:  # alternating, each in a fresh process
            out = subprocess.run([sys.executable, "-m", "mnemojax._src.bench.micro",
                                  "7", "--first-lowering-child", mode], check=True, timeout=300,
                                 capture_output=True, text=True).stdout
            times[mode].append(json.loads(out.strip().splitlines()[-1])["s"])
    cold, warm = (statistics.median(times[m]) for m in ("cold", "warm"))
    return [f"7. the first lowering of the step from a deserialised export in a fresh process "
            f"(median of {rounds}, each in its own process, alternating)",
            f"   cold                                   {1e3 * cold:8.1f} ms   "
            + " ".join(f"{1e3 * t:.0f}" for t in times["cold"]),
            f"   after warm_export_lowering()           {1e3 * warm:8.1f} ms   "
            + " ".join(f"{1e3 * t:.0f}" for t in times["warm"]),
            f"   saved                                  {1e3 * (cold - warm):8.1f} ms"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mnemojax._src.bench.micro")
    parser.add_argument("sections", nargs="*", type=int,
                        choices=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                        help="sections to run (default: all)")
    parser.add_argument("--rounds", type=int, default=15,
                        help="sections 4, 6 and 10: rounds of alternating blocks (default 15)")
    parser.add_argument("--block-steps", type=int, default=10,
                        help="sections 4, 6 and 10: steps per block (default 10)")
    parser.add_argument("--first-lowering-child", choices=["cold", "warm"],
                        help=argparse.SUPPRESS)  # section 7's fresh processes
    parser.add_argument("--section-child", action="store_true",
                        help=argparse.SUPPRESS)  # sections 8 and 9's fresh processes
    args = parser.parse_args(argv)
    sections = args.sections or [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from mnemojax.models.data import BigramCorpus
    from mnemojax.models.gpt import GPTConfig

    cfg = GPTConfig()
    corpus = BigramCorpus(cfg.vocab_size, cfg.seq_len)
    batches = [corpus.batch(i, 24) for i in range(42)]
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    run = {1: lambda: _plumbing(cfg), 2: lambda: _finiteness_check(cfg, mesh, batches),
           3: lambda: _recovery_call(cfg, mesh, batches),
           4: lambda: _snapshot_overhead(cfg, mesh, batches, rounds=args.rounds,
                                         block_steps=args.block_steps),
           5: lambda: _lowering(cfg, mesh, batches),
           6: lambda: _host_outputs(mesh, rounds=args.rounds, block_steps=args.block_steps),
           7: lambda: _first_export_lowering(),
           8: lambda: _section_in_child(8), 9: lambda: _section_in_child(9),
           10: lambda: _frozen_weights(mesh, rounds=args.rounds, block_steps=args.block_steps)}
    if args.section_child:
        import json

        own = {8: _loss_after_recovery, 9: _steps_beside_compiles}[sections[0]]
        print(json.dumps({"lines": own(cfg, mesh, batches)}), flush=True)
        return
    if args.first_lowering_child is not None:
        import json

        s = _first_export_lowering_child(cfg, mesh, batches,
                                         warm=args.first_lowering_child == "warm")
        print(json.dumps({"s": s}), flush=True)
        return
    for section in sorted(set(sections)):
        print("\n".join(run[section]()), flush=True)


if __name__ == "__main__":
    main()
