"""Executables per mesh (mnemojax._src.compiler.StepCompiler): caching by plan and batch,
background compiles and their accounting, the fused per-device finiteness flags; the step
exported when compiled ahead and lowered from its export by a new world's compiler
(`ExportedSteps`), or traced when it cannot be exported.

The step is a two-leaf toy, so each compile takes a fraction of a second.
"""

import gc
import logging
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from mnemojax._src.compiler import (
    ExportedSteps,
    LeftCompiles,
    StepCompiler,
    enable_persistent_cache,
)
from mnemojax._src.topology import MeshPlan

pytestmark = pytest.mark.needs8

SPECS = [P(None, "model"), P("model")]
STRUCTS = [((8, 4), np.dtype(np.float32)), ((4,), np.dtype(np.float32))]
BATCH = {"x": jax.ShapeDtypeStruct((12, 8), np.float32)}


def _pure(leaves, batch):
    w, b = leaves
    loss = jnp.mean((batch["x"] @ w + b) ** 2)
    return [w * 2.0, b + 1.0], {"loss": loss}


def _plan(shape, first=0):
    ids = np.arange(first, first + int(np.prod(shape))).reshape(shape)
    return MeshPlan(ids, ("data", "model"), "unchanged")


def _compiler(pure=_pure, **kw):
    kw.setdefault("donate", False)
    return StepCompiler(pure, SPECS, STRUCTS, batch_axes=("data",), **kw)


class _Gate:
    """A step whose first trace waits until released: holds the background compiler busy."""

    def __init__(self):
        self.release = threading.Event()
        self.tracing = threading.Event()
        self._first = True

    def __call__(self, leaves, batch):
        if self._first:
            self._first = False
            self.tracing.set()
            assert self.release.wait(60)
        return _pure(leaves, batch)


def _run(exe, w, b, x):
    leaves = [jax.device_put(a, s) for a, s in zip((w, b), exe.state_shardings, strict=True)]
    batch = jax.device_put({"x": x}, exe.batch_shardings)
    new, metrics, flags, packs = exe.compiled(leaves, batch)
    assert packs == []  # (these compilers pack nothing: `pack` is not given)
    return new, metrics, flags


@pytest.fixture(scope="module")
def compiled_4x2():
    """One compiled (4, 2) executable with state checks, shared by the tests that run it."""
    compiler = _compiler()
    exe, _ = compiler.get(_plan((4, 2)), BATCH)
    yield exe
    compiler.close()


def test_executable_is_cached_per_plan_and_batch():
    compiler = _compiler()
    try:
        exe, where = compiler.get(_plan((4, 2)), BATCH)
        assert where == "compiled" and not exe.ahead_of_time and compiler.compiles == 1
        again, where = compiler.get(_plan((4, 2)), BATCH)  # an equal plan, another object
        assert where == "ready" and again is exe and compiler.compiles == 1
        other, where = compiler.get(_plan((2, 2), first=4), BATCH)  # another mesh
        assert where == "compiled" and other is not exe and compiler.compiles == 2
        bigger = {"x": jax.ShapeDtypeStruct((16, 8), np.float32)}  # another batch shape
        assert compiler.get(_plan((4, 2)), bigger)[1] == "compiled"
        assert compiler.compiles == 3 and compiler.compiled_ahead == 0
    finally:
        compiler.close()


def test_key_separates_mesh_order_batch_shape_dtype_and_structure():
    key = StepCompiler.key
    base = key(_plan((4, 2)), BATCH)
    assert base == key(_plan((4, 2)), {"x": np.zeros((12, 8), np.float32)})
    reordered = MeshPlan(np.arange(8)[::-1].reshape(4, 2), ("data", "model"), "unchanged")
    assert key(reordered, BATCH) != base  # same shape, other device order
    assert key(_plan((4, 2)), {"x": jax.ShapeDtypeStruct((12, 8), np.int32)}) != base
    assert key(_plan((4, 2)), {"y": jax.ShapeDtypeStruct((12, 8), np.float32)}) != base


def test_executable_targets_the_plans_devices_and_splits_the_batch(compiled_4x2):
    exe = compiled_4x2
    assert [d.id for d in exe.mesh.devices.flat] == list(range(8))
    assert [s.spec for s in exe.state_shardings] == SPECS
    assert exe.batch_shardings["x"].spec == P("data")
    assert exe.lower_s > 0 and exe.compile_s > 0


def test_executable_computes_the_step_and_flags_every_device_finite(compiled_4x2):
    w = np.ones((8, 4), np.float32)
    b = np.zeros(4, np.float32)
    x = np.ones((12, 8), np.float32)
    (new_w, new_b), metrics, flags = _run(compiled_4x2, w, b, x)
    np.testing.assert_array_equal(new_w, 2 * w)
    np.testing.assert_array_equal(new_b, b + 1)
    assert float(metrics["loss"]) == 64.0
    np.testing.assert_array_equal(flags, [True] * 8)


def test_each_device_flags_only_its_own_non_finite_shards(compiled_4x2):
    """A NaN in column 0 of `w` lives on the devices at model index 0 (ids 0, 2, 4, 6)."""
    w = np.ones((8, 4), np.float32)
    w[3, 0] = np.nan
    _, metrics, flags = _run(compiled_4x2, w, np.zeros(4, np.float32),
                             np.zeros((12, 8), np.float32))
    np.testing.assert_array_equal(flags, [False, True] * 4)


def test_without_state_checks_the_flags_are_always_true():
    compiler = _compiler(check_state=False)
    try:
        exe, _ = compiler.get(_plan((2, 2)), BATCH)
        w = np.full((8, 4), np.nan, np.float32)
        _, _, flags = _run(exe, w, np.zeros(4, np.float32), np.zeros((12, 8), np.float32))
        assert bool(np.all(flags))
    finally:
        compiler.close()


def test_precompile_runs_in_the_background_and_is_counted():
    compiler = _compiler()
    try:
        plans = [_plan((4, 2)), _plan((3, 2))]
        futures = compiler.precompile(plans, BATCH)
        assert len(futures) == 2
        assert compiler.wait_precompiled(timeout_s=120) and compiler.pending() == 0
        assert compiler.compiles == 2 and compiler.compiled_ahead == 2
        exe, where = compiler.get(plans[1], BATCH)
        assert where == "ready" and exe.ahead_of_time
        assert [d.id for d in exe.mesh.devices.flat] == list(range(6))
        assert compiler.precompile(plans, BATCH) == []  # known plans are skipped
        assert compiler.compiles == 2
    finally:
        compiler.close()


def test_warm_one_runs_each_executable_compiled_ahead_once_and_never_a_callback():
    """`warm_one` executes one cold executable compiled ahead per call (on zeros), until
    none is left, never one over a dead device nor one already in use; the executables
    stay the ones `get` returns. A step that calls back to the host is never warmed: its
    callback would see the zeros."""
    compiler = _compiler()
    try:
        plans = [_plan((4, 2)), _plan((3, 2)), _plan((2, 2))]
        compiler.precompile(plans, BATCH)
        assert compiler.wait_precompiled(timeout_s=120)
        exe, where = compiler.get(plans[2], BATCH)  # in use: it runs now, no warm-up
        assert where == "ready" and exe.warm
        # Never over a dead device: with device 6 gone only the (3, 2) plan is warmed.
        assert [compiler.warm_one(dead={6}) for _ in range(2)] == [True, False]
        assert [compiler.warm_one() for _ in range(2)] == [True, False]
        assert compiler.warmed == 2
        for plan in plans:
            exe, where = compiler.get(plan, BATCH)
            assert where == "ready" and exe.warm
    finally:
        compiler.close()

    seen = []

    def calls_back(leaves, batch):
        jax.debug.callback(lambda x: seen.append(x), batch["x"][0, 0])
        return _pure(leaves, batch)

    compiler = _compiler(calls_back)
    try:
        compiler.precompile([_plan((2, 2))], BATCH)
        assert compiler.wait_precompiled(timeout_s=120)
        assert not compiler.warm_one() and not compiler.warm_one()
        assert compiler.warmed == 0 and seen == []
    finally:
        compiler.close()


def test_get_waits_for_a_compile_already_running():
    gate = _Gate()
    compiler = _compiler(gate)
    try:
        compiler.precompile([_plan((4, 2))], BATCH)
        assert gate.tracing.wait(60)
        threading.Timer(0.2, gate.release.set).start()
        exe, where = compiler.get(_plan((4, 2)), BATCH)
        assert where == "waited" and exe.ahead_of_time
        assert compiler.compiles == 1 and compiler.compiled_ahead == 1
    finally:
        gate.release.set()
        compiler.close()


def test_a_background_compile_lowers_the_switch_interval_and_restores_it():
    """While a step traces in the background, the training thread's GIL hand-offs wait
    at most `switch_interval_s` (`CompileOptions.background_switch_interval_s`); the
    interval is what it was once no background compile runs, also after one fails."""
    import sys

    before = sys.getswitchinterval()
    gate = _Gate()
    compiler = _compiler(gate, switch_interval_s=0.0005)
    try:
        compiler.precompile([_plan((4, 2))], BATCH)
        assert gate.tracing.wait(60)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        gate.release.set()
        assert compiler.wait_precompiled(timeout_s=120)
        assert sys.getswitchinterval() == before

        def broken(leaves, batch):
            raise ValueError("not traceable")

        failing = _compiler(broken, switch_interval_s=0.0005)
        try:
            [future] = failing.precompile([_plan((2, 2))], BATCH)
            with pytest.raises(ValueError):
                future.result(timeout=120)
            assert sys.getswitchinterval() == before
        finally:
            failing.close()
    finally:
        gate.release.set()
        compiler.close()
        sys.setswitchinterval(before)


def test_get_compiles_now_what_is_only_queued_and_drops_the_queue():
    """The background worker is busy with (4, 2); (3, 2) and (2, 2) wait behind it. A
    recovery needing (3, 2) compiles it at once and the queued (2, 2) is cancelled."""
    gate = _Gate()
    compiler = _compiler(gate)
    try:
        busy, needed, queued = _plan((4, 2)), _plan((3, 2)), _plan((2, 2))
        compiler.precompile([busy, needed, queued], BATCH)
        assert gate.tracing.wait(60)
        exe, where = compiler.get(needed, BATCH)
        assert where == "compiled" and not exe.ahead_of_time
        assert compiler.pending() == 1  # only the running one is left
        gate.release.set()
        assert compiler.wait_precompiled(timeout_s=120)
        assert compiler.compiles == 2 and compiler.compiled_ahead == 1
        assert compiler.get(busy, BATCH)[1] == "ready"
    finally:
        gate.release.set()
        compiler.close()


def test_cancel_pending_keeps_the_running_compile():
    gate = _Gate()
    compiler = _compiler(gate)
    try:
        compiler.precompile([_plan((4, 2)), _plan((3, 2))], BATCH)
        assert gate.tracing.wait(60)
        compiler.cancel_pending()
        assert compiler.pending() == 1
        gate.release.set()
        assert compiler.wait_precompiled(timeout_s=120)
        assert compiler.compiled_ahead == 1
    finally:
        gate.release.set()
        compiler.close()


class _HeldXla:
    """Holds the first XLA compile (`compiler._compile_lowered`) until released; `inside`
    is set once it waits there; `beside` counts the compiles started while it is held."""

    def __init__(self, monkeypatch):
        from mnemojax._src import compiler as compiler_mod
        self.inside, self.release = threading.Event(), threading.Event()
        self.beside = 0
        original = compiler_mod._compile_lowered

        def held(lowered, distributed):
            if not self.inside.is_set():
                self.inside.set()
                assert self.release.wait(60)
            elif not self.release.is_set():
                self.beside += 1
            return original(lowered, distributed)

        monkeypatch.setattr(compiler_mod, "_compile_lowered", held)


@pytest.mark.parametrize("leavable", [True, False])
def test_a_worlds_end_leaves_only_a_second_loss_compile_running(monkeypatch, caplog, leavable):
    """`close(leave_running=True)` (the world ends) does not wait for the XLA compile of a
    plan queued ``leavable`` (a world only a second loss forms): it runs to its end and
    its executable is dropped. Any other running compile is waited for."""
    from mnemojax._src import compiler as compiler_mod
    monkeypatch.setattr(compiler_mod, "_keys_shared", lambda: True)  # (CPU, a cache on)
    held = _HeldXla(monkeypatch)
    compiler = _compiler()
    try:
        [future] = compiler.precompile([_plan((2, 2))], BATCH, leavable=leavable)
        assert held.inside.wait(60)
        closing = threading.Thread(target=compiler.close, kwargs={"leave_running": True})
        with caplog.at_level(logging.INFO, logger="mnemojax"):
            closing.start()
            closing.join(timeout=5 if leavable else 1)
        assert closing.is_alive() is not leavable
        held.release.set()
        closing.join(timeout=120)
        assert not closing.is_alive()
        assert future.result(timeout=120) is not None and compiler.compiled_ahead == 1
        _, where = compiler.get(_plan((2, 2)), BATCH)
        assert where == ("compiled" if leavable else "ready")
        left = [r.getMessage() for r in caplog.records if "left the compile" in r.getMessage()]
        assert len(left) == int(leavable)
    finally:
        held.release.set()
        compiler.close()


def test_the_next_world_waits_for_the_compile_left_running_rather_than_compiling_beside_it(
        monkeypatch, caplog):
    """A later world's compiler of the same step (sharing `LeftCompiles`) that needs the
    plan an ended world left compiling waits for that compile (whose persistent-cache
    entry it then loads) instead of starting a second one beside it."""
    from mnemojax._src import compiler as compiler_mod
    monkeypatch.setattr(compiler_mod, "_keys_shared", lambda: True)  # (CPU, a cache on)
    held = _HeldXla(monkeypatch)
    left = LeftCompiles()
    old = _compiler(left=left)
    new = _compiler(left=left)
    try:
        [future] = old.precompile([_plan((2, 2))], BATCH, leavable=True)
        assert held.inside.wait(60)
        old.close(leave_running=True)
        asking = threading.Thread(target=new.get, args=(_plan((2, 2)), BATCH))
        with caplog.at_level(logging.INFO, logger="mnemojax"):
            asking.start()
            asking.join(timeout=1)
            assert asking.is_alive()
            held.release.set()
            asking.join(timeout=120)
        assert not asking.is_alive() and new.compiles == 1 and held.beside == 0
        assert future.result(timeout=120) is not None
        assert any("an ended world left running" in r.getMessage() for r in caplog.records)
    finally:
        held.release.set()
        old.close()
        new.close()


def test_a_compile_waiting_for_one_left_running_compiles_nothing_once_its_world_ends(
        monkeypatch):
    """The next world queues the plan an ended world left compiling and ends (a second
    loss) while it waits for it: it gives the wait up and compiles nothing beside it;
    its end does not wait for the left compile either."""
    from mnemojax._src import compiler as compiler_mod
    monkeypatch.setattr(compiler_mod, "_keys_shared", lambda: True)
    held = _HeldXla(monkeypatch)
    left = LeftCompiles()
    old, new = _compiler(left=left), _compiler(left=left)
    try:
        [left_running] = old.precompile([_plan((2, 2))], BATCH, leavable=True)
        assert held.inside.wait(60)
        old.close(leave_running=True)
        [waiting] = new.precompile([_plan((2, 2))], BATCH)
        closing = threading.Thread(target=new.close, kwargs={"leave_running": True})
        closing.start()
        closing.join(timeout=5)
        assert not closing.is_alive() and waiting.result(timeout=5) is None
        assert new.compiles == 0 and held.beside == 0
        held.release.set()
        assert left_running.result(timeout=120) is not None
    finally:
        held.release.set()
        old.close()
        new.close()


def test_a_worlds_end_waits_for_the_trace_of_a_leavable_compile(monkeypatch):
    """Only XLA's part is left running: a leavable compile still tracing (Python, JAX's
    caches, which the world's end clears) is waited for."""
    from mnemojax._src import compiler as compiler_mod
    monkeypatch.setattr(compiler_mod, "_keys_shared", lambda: True)
    gate = _Gate()
    compiler = _compiler(gate)
    try:
        compiler.precompile([_plan((2, 2))], BATCH, leavable=True)
        assert gate.tracing.wait(60)
        closing = threading.Thread(target=compiler.close, kwargs={"leave_running": True})
        closing.start()
        closing.join(timeout=1)
        assert closing.is_alive()
        gate.release.set()
        closing.join(timeout=120)
        assert not closing.is_alive() and compiler.left_running is None
        assert compiler.compiled_ahead == 1
    finally:
        gate.release.set()
        compiler.close()


_EXIT_SCRIPT = """
import logging, os, sys, threading, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from tests import compiler_test as t
traced = threading.Event()

def slow(leaves, batch):  # each compile ahead traces for 1 s
    traced.set()
    time.sleep(1.0)
    return t._pure(leaves, batch)

compiler = t._compiler(slow)
compiler.precompile([t._plan((4, 2)), t._plan((3, 2)), t._plan((2, 2)), t._plan((1, 2))],
                    t.BATCH)
assert traced.wait(60)
print("EXITING", flush=True)
"""


def test_exit_drops_the_compiles_ahead_not_started():
    """A process that ends without closing its step waits for the compile ahead in flight
    only, not for every queued one (`concurrent.futures` would run them all first)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "EXITING" in out.stdout
    compiled = out.stdout.count("compiled step for mesh")
    assert compiled == 1, out.stdout[-2000:]
    assert "at exit, waiting for the compile ahead of time in flight" in out.stdout


def test_the_persistent_cache_is_announced_once_and_the_users_setting_wins(tmp_path, caplog):
    flag = "jax_compilation_cache_dir"
    before = getattr(jax.config, flag)
    try:
        jax.config.update(flag, None)
        jax.config.update("jax_enable_compilation_cache", False)
        assert not enable_persistent_cache(tmp_path / "off")  # switched off by the user
        assert getattr(jax.config, flag) is None
        jax.config.update("jax_enable_compilation_cache", True)
        with caplog.at_level(logging.WARNING, logger="mnemojax"):
            assert enable_persistent_cache(tmp_path / "xla")
            assert not enable_persistent_cache(tmp_path / "other")  # set now: left alone
        assert getattr(jax.config, flag) == str(tmp_path / "xla")
        [announced] = [r.getMessage() for r in caplog.records if "compilation cache" in
                       r.getMessage()]
        assert str(tmp_path / "xla") in announced
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update(flag, before)


class _Counting:
    """The toy step, counting its traces; with ``callback``, it calls the host (which
    `jax.export` cannot serialise)."""

    def __init__(self, callback: bool = False, explicit: bool = False,
                 reads_world: str | None = None):
        self.traces = 0
        self._callback, self._explicit, self._reads = callback, explicit, reads_world

    def __call__(self, leaves, batch):
        self.traces += 1
        if self._callback:
            jax.debug.callback(lambda w: None, leaves[0])
        if self._reads is not None:  # e.g. a loss scaled by the world's size
            world = getattr(jax, self._reads)()
            scale = len(world) if isinstance(world, list) else world
            leaves = [leaves[0] * scale, leaves[1]]
        if not self._explicit:
            return _pure(leaves, batch)
        w, b = leaves  # an activation spec: needs Explicit axes
        y = jnp.matmul(batch["x"], w, out_sharding=P("data", "model"))
        return [w * 2.0, b + 1.0], {"loss": jnp.mean((y + b) ** 2)}


EXPLICIT = {"data": AxisType.Explicit, "model": AxisType.Explicit}


@pytest.mark.parametrize("axis_types", [None, EXPLICIT], ids=["auto", "explicit"])
def test_a_new_worlds_compiler_lowers_a_step_exported_ahead_without_tracing_it(axis_types):
    """The old world's compiler exports (3, 2) when it compiles it ahead; a new world's
    compiler (another `StepCompiler`, same `ExportedSteps`) lowers it from the export: no
    trace, and the same step (donation and the per-device flags included)."""
    step = _Counting(explicit=axis_types is not None)
    exports = ExportedSteps()
    old = _compiler(step, exports=exports, axis_types=axis_types, donate=True)
    new = _compiler(step, exports=exports, axis_types=axis_types, donate=True)
    plain = _compiler(_Counting(explicit=axis_types is not None), axis_types=axis_types)
    try:
        old.precompile([_plan((3, 2))], BATCH)
        assert old.wait_precompiled(timeout_s=120)
        assert old.get(_plan((3, 2)), BATCH)[0].exported
        assert len(exports) == 1 and step.traces == 1
        exe, where = new.get(_plan((3, 2)), BATCH)
        assert where == "compiled" and exe.exported and step.traces == 1
        reference, _ = plain.get(_plan((3, 2)), BATCH)
        assert not reference.exported
        w = np.arange(32, dtype=np.float32).reshape(8, 4)
        w[3, 0] = np.nan  # on the devices at model index 0
        x = np.ones((12, 8), np.float32)
        leaves = [jax.device_put(a, s) for a, s in
                  zip((w, np.ones(4, np.float32)), exe.state_shardings, strict=True)]
        got = exe.compiled(leaves, jax.device_put({"x": x}, exe.batch_shardings))
        assert all(x.is_deleted() for x in leaves)  # donated, as compiled
        want = _run(reference, w, np.ones(4, np.float32), x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(got[2], [False, True] * 3)
    finally:
        for c in (old, new, plain):
            c.close()


def _reaches_a_device(root, limit: int = 200_000) -> bool:
    """Whether `root` refers, through any chain of objects, to a `jax.Device` (which would
    keep its client alive). Process-wide objects are not followed: modules, types, a
    function's globals (its closure and defaults are), the pytree registry of a treedef."""
    seen, todo = set(), [root]
    while todo and len(seen) < limit:
        x = todo.pop()
        if id(x) in seen or isinstance(x, type | types.ModuleType | jax.tree_util.PyTreeDef):
            continue
        seen.add(id(x))
        if isinstance(x, jax.Device):
            return True
        if isinstance(x, types.FunctionType):
            todo.extend(c.cell_contents for c in x.__closure__ or ())
            todo.extend(x.__defaults__ or ())
        else:
            todo.extend(gc.get_referents(x))
    assert not todo, "the object graph is too large to search"
    return False


def test_a_kept_export_refers_to_no_device():
    exports = ExportedSteps()
    compiler = _compiler(exports=exports)
    try:
        compiler.precompile([_plan((3, 2))], BATCH)
        assert compiler.wait_precompiled(timeout_s=120)
        kept = exports.get(StepCompiler.key(_plan((3, 2)), BATCH))
        assert kept is not None and not _reaches_a_device(kept)
        assert _reaches_a_device(compiler.get(_plan((3, 2)), BATCH)[0])  # the search works
    finally:
        compiler.close()


def test_an_export_that_does_not_fit_the_mesh_is_traced_instead(caplog):
    """A kept export made for 4 devices, found under a 6-device plan's key: it does not
    lower there, so the step is traced, with a warning, and computes the right thing."""
    exports = ExportedSteps()
    old = _compiler(exports=exports)
    new = _compiler(exports=exports)
    try:
        old.precompile([_plan((2, 2))], BATCH)
        assert old.wait_precompiled(timeout_s=120)
        wrong = exports.get(StepCompiler.key(_plan((2, 2)), BATCH))
        assert wrong is not None
        exports.put(StepCompiler.key(_plan((3, 2)), BATCH), wrong)
        with caplog.at_level(logging.WARNING, logger="mnemojax"):
            exe, where = new.get(_plan((3, 2)), BATCH)
        assert where == "compiled" and not exe.exported
        assert any("from its export failed" in r.getMessage() for r in caplog.records)
        (new_w, _), metrics, flags = _run(exe, np.ones((8, 4), np.float32),
                                          np.zeros(4, np.float32), np.ones((12, 8), np.float32))
        np.testing.assert_array_equal(new_w, 2 * np.ones((8, 4)))
        assert float(metrics["loss"]) == 64.0 and flags.shape == (6,)
    finally:
        old.close()
        new.close()


def test_a_step_that_cannot_be_exported_is_traced_and_the_refusal_said_once(caplog):
    step = _Counting(callback=True)
    exports = ExportedSteps()
    compiler = _compiler(step, exports=exports)
    try:
        with caplog.at_level(logging.WARNING, logger="mnemojax"):
            compiler.precompile([_plan((3, 2)), _plan((2, 2))], BATCH)
            assert compiler.wait_precompiled(timeout_s=120)
        assert len(exports) == 0 and "host_callbacks" in (exports.refused or "")
        said = [r for r in caplog.records if "cannot be exported" in r.getMessage()]
        assert len(said) == 1  # the second plan tried nothing
        exe, where = compiler.get(_plan((3, 2)), BATCH)
        assert where == "ready" and not exe.exported
        (new_w, _), metrics, _ = _run(exe, np.ones((8, 4), np.float32),
                                      np.zeros(4, np.float32), np.ones((12, 8), np.float32))
        np.testing.assert_array_equal(new_w, 2 * np.ones((8, 4)))
        assert float(metrics["loss"]) == 64.0
    finally:
        compiler.close()


@pytest.mark.parametrize("read", ["process_count", "device_count", "devices"])
def test_a_step_that_reads_its_world_while_tracing_is_not_exported(read, caplog):
    """Its export would keep this world's value in the next world: the first export is
    watched, the read found (named, with where), and the step is traced in every world."""
    exports = ExportedSteps()
    compiler = _compiler(_Counting(reads_world=read), exports=exports)
    try:
        with caplog.at_level(logging.WARNING, logger="mnemojax"):
            compiler.precompile([_plan((3, 2)), _plan((2, 2))], BATCH)
            assert compiler.wait_precompiled(timeout_s=120)
        assert len(exports) == 0 and exports.watched
        assert f"jax.{read}() at {__file__}" in (exports.refused or "")
        said = [r.getMessage() for r in caplog.records if "cannot be exported" in
                r.getMessage()]
        assert len(said) == 1 and "reads its world while tracing" in said[0]
        exe, where = compiler.get(_plan((3, 2)), BATCH)
        assert where == "ready" and not exe.exported
    finally:
        compiler.close()


@pytest.mark.parametrize("read", [None, "process_count"])
def test_process_0s_first_compile_is_the_watched_trace(read):
    """Process 0 exports the candidates for every process: its first trace, the world's
    first compile, is the one watched for world reads (a watch slows a trace ~2.4x), so its
    first export, on the candidates' path, is not; a read found there refuses exports."""
    exports = ExportedSteps()
    compiler = _compiler(_Counting(reads_world=read), exports=exports)
    try:
        exe, _ = compiler.get(_plan((4, 2)), BATCH)
        assert exports.watched and not exe.exported
        assert (exports.refused is None) == (read is None), exports.refused
    finally:
        compiler.close()


def test_exported_steps_keep_the_newest_entries():
    with pytest.raises(ValueError, match="max_entries must be >= 1, got 0"):
        ExportedSteps(max_entries=0)
    exports = ExportedSteps(max_entries=2)
    exported = jax.export.export(jax.jit(jnp.sin))(jax.ShapeDtypeStruct((2,), np.float32))
    for k in ("a", "b", "a", "c"):  # "a" put again: the newest
        exports.put((k,), exported)
    assert len(exports) == 2 and exports.get(("b",)) is None
    assert exports.get(("a",)) is not None and exports.get(("c",)) is not None


def test_a_process_that_only_exports_ahead_compiles_from_that_export_when_asked(monkeypatch):
    """`CompileOptions.ahead_compilers`: a process not among the compilers only exports
    the candidate world's step in the background (one trace, nothing compiled, no
    executable kept), and warms up the lowering of exports there (`warm_export_lowering`:
    the first one in a process costs ~0.2 s more, which the new world's compile phase
    would pay); when that world forms, `get` lowers the export (no second trace) and
    compiles it, or loads what another process wrote under the shared key."""
    from mnemojax._src import compiler as compiler_module

    warmed = []
    monkeypatch.setattr(compiler_module, "warm_export_lowering",
                        lambda: warmed.append(threading.current_thread().name))
    step = _Counting()
    exports = ExportedSteps()
    compiler = _compiler(step, exports=exports)
    try:
        compiler.precompile([_plan((3, 2))], BATCH, export_only=True)
        assert compiler.wait_precompiled(timeout_s=120) and compiler.pending() == 0
        assert len(exports) == 1 and step.traces == 1
        assert warmed and threading.current_thread().name not in warmed  # in the background
        assert compiler.compiles == 0 and not compiler.warm_one()
        assert compiler.precompile([_plan((3, 2))], BATCH, export_only=True) == []
        exe, where = compiler.get(_plan((3, 2)), BATCH)
        assert where in ("compiled", "cached") and exe.exported and step.traces == 1
        assert compiler.compiles == 1 and compiler.compiled_ahead == 0
    finally:
        compiler.close()


def test_the_lowering_of_exports_is_warmed_up_once_per_process(monkeypatch):
    """`warm_export_lowering` lowers one deserialised export the first time it is called in
    a process and nothing after (its saving is measured by `bench.micro 7`)."""
    from mnemojax._src import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "_export_lowering_warmed", threading.Event())
    lowered = []
    deserialize = jax.export.deserialize
    monkeypatch.setattr(compiler_module.jax_export, "deserialize",
                        lambda blob: lowered.append(1) or deserialize(blob))
    compiler_module.warm_export_lowering()
    compiler_module.warm_export_lowering()
    assert lowered == [1] and compiler_module._export_lowering_warmed.is_set()


@pytest.mark.parametrize(("n", "k", "ranks"), [(4, 2, {0, 2}), (3, 2, {0, 2}), (8, 3, {0, 3, 5}),
                                               (2, 2, {0, 1}), (3, 5, {0, 1, 2}), (5, 1, {0})])
def test_the_ahead_compilers_are_spread_over_the_ranks(n, k, ranks):
    from mnemojax._src.compiler import ahead_compiler_ranks

    assert ahead_compiler_ranks(n, k) == ranks


class _Board:
    """`compiler.ExportExchange` in one process (the two-process test,
    `distributed/shared_exports_test.py`, uses the coordination service's store)."""

    def __init__(self):
        self.published: dict[str, tuple[bytes | None, str | None]] = {}
        self.structures: dict[str, str | None] = {}
        self.waiting = threading.Event()

    def publish(self, name, payload, *, refused=None, structure=None):
        self.structures[name] = structure
        self.published[name] = (payload, refused)

    def fetch(self, name, *, cancelled=lambda: False):
        self.waiting.set()
        while name not in self.published:
            if cancelled():
                return types.SimpleNamespace(payload=None, refused=None, given_up=True)
            threading.Event().wait(0.01)
        payload, refused = self.published[name]
        return types.SimpleNamespace(payload=payload, refused=refused, given_up=False,
                                     structure=self.structures[name])


def _sharing_pair(publisher_step, taker_step):
    """A publishing and a taking compiler, each with its own exports, the taker having
    compiled the world's mesh (whose call structure it gives the export back)."""
    from mnemojax._src.compiler import ExportSharing

    board = _Board()
    publisher = _compiler(publisher_step, exports=ExportedSteps())
    taker = _compiler(taker_step, exports=ExportedSteps())
    taker.get(_plan((4, 2)), BATCH)
    return board, publisher, taker, ExportSharing(board, True), ExportSharing(board, False)


def test_a_taken_export_compiles_untraced_to_the_publishers_program():
    board, publisher, taker, publish, take = _sharing_pair(_Counting(), step := _Counting())
    try:
        traced = step.traces
        publisher.precompile([_plan((2, 2))], BATCH, sharing=publish)
        taker.precompile([_plan((2, 2))], BATCH, sharing=take)
        assert publisher.wait_precompiled(120) and taker.wait_precompiled(120)
        assert step.traces == traced and taker._exports.taken == 1
        [(payload, refused)] = board.published.values()
        assert payload and refused is None
        mine, theirs = (c.get(_plan((2, 2)), BATCH)[0] for c in (taker, publisher))
        assert mine.exported and mine.compiled.as_text() == theirs.compiled.as_text()
    finally:
        publisher.close()
        taker.close()


def test_a_step_the_publisher_cannot_export_is_traced_by_every_process():
    """The publisher's refusal (a host callback) reaches the taker, which then traces the
    step itself, as it would have refused it too."""
    board, publisher, taker, publish, take = _sharing_pair(_Counting(callback=True),
                                                           step := _Counting(callback=True))
    try:
        publisher.precompile([_plan((2, 2))], BATCH, sharing=publish)
        taker.precompile([_plan((2, 2))], BATCH, sharing=take)
        assert publisher.wait_precompiled(120) and taker.wait_precompiled(120)
        [(payload, refused)] = board.published.values()
        assert payload is None and "callback" in refused.lower()
        assert taker._exports.refused is not None and taker._exports.taken == 0
        exe, _ = taker.get(_plan((2, 2)), BATCH)
        assert not exe.exported and step.traces >= 2
    finally:
        publisher.close()
        taker.close()


def test_closing_a_compiler_ends_its_wait_for_an_export_nobody_publishes():
    _, publisher, taker, _, take = _sharing_pair(_Counting(), _Counting())
    try:
        taker.precompile([_plan((2, 2))], BATCH, sharing=take)
        assert take.exchange.waiting.wait(60)
        closed = threading.Thread(target=taker.close)
        closed.start()
        closed.join(timeout=60)
        assert not closed.is_alive() and taker._exports.taken == 0
        assert len(taker._exports) == 0  # given up: not traced here for a world that ends
    finally:
        publisher.close()
        taker.close()


def test_a_publisher_that_fails_lets_the_others_trace_at_once(monkeypatch):
    """Any failure of the publisher's export (not a refusal) still publishes a header with
    nothing to take: the taker traces the step itself without waiting out the deadline."""
    board, publisher, taker, publish, take = _sharing_pair(_Counting(), step := _Counting())
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("lost the module")

        monkeypatch.setattr(publisher, "_export", broken)
        publisher.precompile([_plan((2, 2))], BATCH, sharing=publish)
        taker.precompile([_plan((2, 2))], BATCH, sharing=take)
        assert publisher.wait_precompiled(120) and taker.wait_precompiled(120)
        [(payload, refused)] = board.published.values()
        assert payload is None and refused is None
        assert taker._exports.taken == 0 and taker._exports.refused is None
        assert len(taker._exports) == 1 and step.traces == 2  # traced and exported here
    finally:
        publisher.close()
        taker.close()


def test_other_call_structures_are_not_given_to_a_taken_export():
    """The export travels with flat structures and the taker puts its own back, after
    comparing their leaf paths: a step whose metrics the publisher names otherwise is
    traced here (its arrays would be relabelled)."""
    def renamed(leaves, batch):
        new, metrics = _pure(leaves, batch)
        return new, {"objective": metrics["loss"]}

    board, publisher, taker, publish, take = _sharing_pair(renamed, step := _Counting())
    try:
        traced = step.traces
        publisher.precompile([_plan((2, 2))], BATCH, sharing=publish)
        taker.precompile([_plan((2, 2))], BATCH, sharing=take)
        assert publisher.wait_precompiled(120) and taker.wait_precompiled(120)
        assert taker._exports.taken == 0 and step.traces == traced + 1
    finally:
        publisher.close()
        taker.close()
