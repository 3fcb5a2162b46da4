"""`ResilientStep.guard`: an eval step beside the resilient train step survives a device
loss that surfaces inside it, and the run ends where a failure-free one ends."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mnemojax
from tests import helpers as h

pytestmark = pytest.mark.needs8

STEPS = 6
EVAL = h.EVAL_BATCH


def _eval(model, batch):
    return {"loss": h.loss_fn(model, batch)}


def test_a_device_lost_during_a_guarded_eval_is_recovered_and_the_eval_runs_again():
    batches = h.make_batches(STEPS)
    want, want_evals = h.reference_run(batches), h.reference_evals(batches)
    faults = mnemojax.testing.FaultInjector().lose_devices_beside(3, [5])
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), fault_injector=faults,
                              options=h.no_precompile())
    calls = []

    @step.guard
    @nnx.jit
    def eval_step(model, batch):
        calls.append(1)  # once per trace: the eval traces again on the new mesh
        return _eval(model, batch)

    try:
        first = float(eval_step(model, EVAL)["loss"])  # before the first step: unguarded
        losses, evals, meshes = [], [], []
        for b in batches:
            losses.append(float(step(model, optimizer, b)["loss"]))
            evals.append(float(eval_step(model, EVAL)["loss"]))
            meshes.append({d.id for d in step.mesh.devices.flat})
    finally:
        step.close()
    untrained, _ = h.make_mlp()
    assert first == pytest.approx(float(nnx.jit(_eval)(untrained, EVAL)["loss"]), abs=1e-6)
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), want)
    np.testing.assert_allclose(evals, want_evals, rtol=1e-5, atol=1e-5)
    [rec] = step.statistics.recoveries
    assert rec.guarded and rec.step == 4 and rec.steps_lost == 0
    assert rec.failed_devices == (5,) and rec.source_step == 3
    # (each mesh read after that step's eval: the third eval recovered)
    assert all(5 in m for m in meshes[:2]) and all(5 not in m for m in meshes[2:])
    assert len(calls) == 3  # the first, the (4, 2) and the new mesh's trace


def test_a_guarded_functions_own_error_is_raised_as_it_is_and_recovers_nothing():
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((1, 1)), options=h.no_precompile())

    @step.guard
    def broken(model, batch):
        raise ValueError(f"bad eval batch {sorted(batch)}")

    try:
        step(model, optimizer, h.make_batches(1)[0])
        with pytest.raises(ValueError, match=r"bad eval batch \['x', 'y'\]"):
            broken(model, EVAL)
        assert step.statistics.recoveries == [] and step.step_count == 1
        assert broken.__name__ == "broken"
    finally:
        step.close()


def _pure_step(state, batch):
    def loss(params):
        return jnp.mean((batch["x"] @ params["w"] - batch["t"]) ** 2)

    value, grads = jax.value_and_grad(loss)(state["params"])
    params = jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)
    return {"params": params, "count": state["count"] + 1}, {"loss": value}


def _pure_eval(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["t"]) ** 2)


def test_a_pure_steps_guarded_eval_runs_again_on_the_recovered_state():
    """The pure form: the caller holds the state. Device 6 dies during the eval after
    step 3, which is given a part of the state (``state["params"]``): it runs again on the
    recovered arrays, and the caller's old state passed to the next step stands for the
    recovered one; the run ends equal to plain ``jax.jit``."""
    rng = np.random.default_rng(3)
    batches = [{"x": rng.normal(size=(24, 8)).astype(np.float32),
                "t": rng.normal(size=(24, 2)).astype(np.float32)} for _ in range(STEPS)]
    fresh = {"params": {"w": np.zeros((8, 2), np.float32)}, "count": np.zeros((), np.int32)}
    plain_step, plain_eval = jax.jit(_pure_step), jax.jit(_pure_eval)
    state, want_evals = fresh, []
    for b in batches:
        state, _ = plain_step(state, b)
        want_evals.append(float(plain_eval(state["params"], batches[0])))
    want = state

    step = mnemojax.resilient(_pure_step, mesh=h.mesh_of((8,), ("data",)),
                              options=h.no_precompile(),
                              fault_injector=mnemojax.testing.FaultInjector()
                              .lose_devices_beside(3, [6]))
    seen = []

    @step.guard
    def evaluate(params, batch):
        seen.append({d.id for d in params["w"].sharding.device_set})
        return plain_eval(params, batch)

    try:
        state, evals = fresh, []
        for b in batches:
            state, _ = step(state, b)
            evals.append(float(evaluate(state["params"], batches[0])))
    finally:
        step.close()
    np.testing.assert_allclose(evals, want_evals, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-5), state, want)
    assert int(state["count"]) == STEPS
    [rec] = step.statistics.recoveries
    assert rec.guarded and rec.failed_devices == (6,) and rec.steps_lost == 0
    # The eval after step 3 ran on the old mesh, then again on the recovered arrays.
    assert [6 in s for s in seen] == [True] * 3 + [False] * (STEPS - 2)


def test_a_guard_inside_guarded_work_runs_plainly_and_the_outer_one_recovers():
    """The function that places the eval batch on the step's mesh is guarded, and so is
    the jitted eval it calls. The outer guard recovers and runs the whole again (the batch
    placed on the new mesh); the inner one runs plainly (guarding first, it would run
    again with the batch of the mesh before)."""
    batches = h.make_batches(STEPS)
    want_evals = h.reference_evals(batches)
    faults = mnemojax.testing.FaultInjector().lose_devices_beside(3, [5])
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), fault_injector=faults,
                              options=h.no_precompile())
    eval_step = step.guard(nnx.jit(_eval))

    @step.guard
    def evaluate(model, host_batch):
        mesh = step.mesh
        rows = jax.sharding.NamedSharding(mesh, jax.P("data"))
        with jax.set_mesh(mesh):
            return eval_step(model, jax.tree.map(lambda v: jax.device_put(v, rows),
                                                 host_batch))

    try:
        evals = []
        for b in batches:
            step(model, optimizer, b)
            evals.append(float(evaluate(model, EVAL)["loss"]))
    finally:
        step.close()
    np.testing.assert_allclose(evals, want_evals, rtol=1e-5, atol=1e-5)
    [rec] = step.statistics.recoveries
    assert rec.guarded and rec.failed_devices == (5,)


def test_guarded_work_does_not_run_again_in_a_world_that_processes_joined(monkeypatch):
    """A world recovered with joiners (spares, a world grown back) starts them at the next
    step: the guarded work raises `GuardSkippedError` instead of running again, with the
    state recovered, and the run goes on exact. (One process stands in for it: the
    recovery's record names a joiner.)"""
    from mnemojax._src.api import ResilientStep

    recover = ResilientStep._recover_after

    def with_a_joiner(self, *args, **kwargs):
        resumed = recover(self, *args, **kwargs)
        if resumed is not None:
            resumed.record.joined_processes = (9,)
        return resumed

    monkeypatch.setattr(ResilientStep, "_recover_after", with_a_joiner)
    batches = h.make_batches(STEPS)
    want, want_evals = h.reference_run(batches), h.reference_evals(batches)
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=mnemojax.testing.FaultInjector()
                              .lose_devices_beside(3, [5]))
    eval_step = step.guard(nnx.jit(_eval))
    try:
        losses, evals = [], []
        for k, b in enumerate(batches, start=1):
            losses.append(float(step(model, optimizer, b)["loss"]))
            try:
                evals.append(float(eval_step(model, EVAL)["loss"]))
            except mnemojax.errors.GuardSkippedError as e:
                assert k == 3 and e.after_step == 3 and e.joined == (9,)
                evals.append(None)
                after_3 = h.host_state(model, optimizer)  # the recovered state, written back
    finally:
        step.close()
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), want)
    assert evals[2] is None
    np.testing.assert_allclose([e for e in evals if e is not None],
                               want_evals[:2] + want_evals[3:], rtol=1e-5, atol=1e-5)
    for got, ref in zip(after_3, h.reference_run(batches[:3]).state, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    [rec] = step.statistics.recoveries
    assert rec.guarded and rec.joined_processes == (9,)


def test_a_death_heard_of_once_the_guarded_work_is_done_is_no_failure(monkeypatch):
    """Under `mnemojax launch` the peer watch fails the wait of guarded work when a peer
    dies. If every array of the work's result is ready by then, the work was done (its
    collectives completed everywhere): its result is returned and nothing is recovered;
    the death is met at the next step. (One process: a watch over a fake launcher, told
    of the death once the eval's result is ready.)"""
    import threading

    from mnemojax._src import device_layer
    from mnemojax._src.distributed import wire
    from mnemojax._src.distributed.worker import peer_watch

    class _Quiet:  # a launcher that reports no death by itself
        released = threading.Event()

        def watch(self, *, generation, timeout_s):
            self.released.wait(timeout_s)
            return wire.WorldFailed(generation=generation, failed=())

    watch = peer_watch.PeerWatch(_Quiet(), lambda: 0, poll_s=5.0, retry_s=0.01)
    wait_beside = device_layer.JaxDeviceLayer.wait_beside
    notices = []

    def heard_once_done(self, outputs, *, after_step, devices):
        jax.block_until_ready(outputs)
        notices.append(watch.notify(0, (1,)))  # fails the guard's pending wait
        return wait_beside(self, outputs, after_step=after_step, devices=devices)

    batches = h.make_batches(2)
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((2, 1)), options=h.no_precompile())
    eval_step = step.guard(nnx.jit(_eval))
    try:
        step(model, optimizer, batches[0])
        watch.start()
        monkeypatch.setattr(device_layer.JaxDeviceLayer, "wait_beside", heard_once_done)
        loss = float(eval_step(model, EVAL)["loss"])
        with pytest.raises(jax.errors.JaxRuntimeError, match="not started"):
            step(model, optimizer, batches[1])  # the next step meets the death
    finally:
        watch.stop()
        _Quiet.released.set()
        step.close()
    [notice] = notices
    assert notice.aborted == 1  # the guard's wait was failed, and its result kept
    assert loss == pytest.approx(h.reference_evals(batches[:1])[0], rel=1e-5)
    assert step.statistics.recoveries == [] and step.step_count == 1


def test_a_nan_after_a_recovery_leaves_the_objects_with_the_recovered_state():
    """nonfinite='raise': device 5 dies in step 3, whose batch is NaN. The recovery's replay
    raises `NonFiniteLossError`; the model and optimizer hold the state of step 2 on the
    new mesh (not the arrays of the mesh that lost a device), so the run goes on from it
    with the clean batch and ends exact."""
    batches = h.make_batches(STEPS)
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                              options=h.no_precompile(nonfinite="raise"),
                              fault_injector=mnemojax.testing.FaultInjector()
                              .lose_devices(3, [5]))
    try:
        losses = []
        for k, b in enumerate(batches, start=1):
            if k == 3:
                with pytest.raises(mnemojax.errors.NonFiniteLossError):
                    step(model, optimizer, {"x": np.full_like(b["x"], np.nan), "y": b["y"]})
                assert all(5 not in {d.id for d in x.sharding.device_set}
                           for x in jax.tree.leaves(nnx.state((model, optimizer))))
            losses.append(float(step(model, optimizer, b)["loss"]))
    finally:
        step.close()
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)),
                      h.reference_run(batches))
    [rec] = step.statistics.recoveries
    assert rec.failed_devices == (5,)


def test_a_change_to_the_carried_state_outside_the_step_is_refused_before_guarded_work(
        caplog):
    """After a recovery guarded work runs again on the last step's state: a change made
    to it since, outside the step, would be lost, so the guard refuses it by name. The
    same arrays replaced by equal values (a jitted call on the model) pass. NNX objects
    whose variables the step does not carry, given or captured, are named in a warning,
    once per function (a view of the model shares its variables: none)."""
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((1, 1)), options=h.no_precompile())
    evaluate = step.guard(nnx.jit(_eval))
    try:
        step(model, optimizer, h.make_batches(1)[0])
        optimizer.step[...] = optimizer.step[...] + 0  # a new array, the same value
        outside = nnx.metrics.Average()
        with caplog.at_level("WARNING", logger="mnemojax"):
            step.guard(lambda model, metrics: _eval(model, EVAL))(model, outside)
            step.guard(lambda model, metrics: _eval(model, EVAL))(model, outside)
            assert float(evaluate(model, EVAL)["loss"]) > 0
        assert [r.getMessage().count("uses Average (given to it, or reachable through its "
                                     "closure, perhaps only in a branch it does not take), "
                                     "whose arrays this step does not carry")
                for r in caplog.records] == [1, 1]  # (two lambdas: each warned once)
        caplog.clear()
        captured = nnx.metrics.Average()
        with caplog.at_level("WARNING", logger="mnemojax"):  # a view shares the variables
            step.guard(lambda model: _eval(nnx.view(model), EVAL))(model)
            step.guard(lambda model: (captured, _eval(model, EVAL))[1])(model)
        assert [r.getMessage().count("uses Average 'captured'") for r in caplog.records] == [1]
        optimizer.step[...] = optimizer.step[...] + 100
        with pytest.raises(mnemojax.errors.UnsupportedStateError,
                           match=r"changed since step 1, outside the step \(optimizer/step;"):
            evaluate(model, EVAL)
    finally:
        step.close()


def test_place_puts_host_data_on_the_current_mesh_as_the_step_does():
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile())
    try:
        before = step.place({"x": EVAL["x"], "n": np.float32(3.0)})  # before the first step
        step(model, optimizer, h.make_batches(1)[0])
        placed = step.place(EVAL)
        with pytest.raises(mnemojax.errors.BatchSplitError, match=r"\['x'\] has 6 rows"):
            step.place({"x": EVAL["x"][:6]})
    finally:
        step.close()
    for got in (before["x"], placed["x"]):
        assert got.sharding.spec == jax.P("data") and len(got.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(got), EVAL["x"])
    assert before["n"].sharding.spec == jax.P() and float(before["n"]) == 3.0


def test_a_change_between_steps_is_in_the_snapshot_a_recovery_restores():
    """One process, donated state (a device loss restores the host snapshot): the
    optimizer's step count is set back between steps 2 and 3, outside the step, and
    device 5 dies in step 3. The snapshot restored is of what the objects held at step 3's
    call, so the run ends equal to a plain run with the same change."""
    batches = h.make_batches(STEPS)
    model, optimizer = h.make_mlp()
    plain = nnx.jit(h.train_step)
    for k, b in enumerate(batches, start=1):
        plain(model, optimizer, b)
        if k == 2:
            optimizer.step[...] = optimizer.step[...] - 2
    want = h.host_state(model, optimizer)
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), donate_argnums=(0, 1),
                              options=h.no_precompile(),
                              fault_injector=mnemojax.testing.FaultInjector()
                              .lose_devices(3, [5]))
    try:
        for k, b in enumerate(batches, start=1):
            step(model, optimizer, b)
            if k == 2:
                optimizer.step[...] = optimizer.step[...] - 2
    finally:
        step.close()
    for got, ref in zip(h.host_state(model, optimizer), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    [rec] = step.statistics.recoveries
    assert rec.source_step == 2 and rec.source != "live_replicas"


def _bumped_step(state, x):
    w = state["w"] - 0.1 * (x.mean(0) + state["bump"])  # the caller's bump enters the math
    return {"w": w, "bump": state["bump"]}, {"loss": jnp.sum(w)}


def test_a_pure_state_changed_between_steps_is_in_the_snapshot_a_recovery_restores():
    """The pure form, donated: the caller changes the state the step returned before
    passing it back (as a second step of a GAN does), and a device dies in step 5, which
    restores the host snapshot. It is of the state given to step 5, so the run ends equal
    to the plain run (trial 40: the snapshot of step 4's output was restored and steps
    replayed from it, every change since lost; 4.0 for 8.0, silently)."""
    xs = [np.random.default_rng(k).normal(size=(8, 4)).astype(np.float32) for k in range(8)]

    def loop(step):
        state = {"w": jnp.zeros((4,)), "bump": jnp.zeros(())}
        for x in xs:
            state, _ = step(state, x)
            state = {"w": state["w"], "bump": state["bump"] + 1.0}  # the caller's change
        return jax.tree.map(np.asarray, state)

    want = loop(jax.jit(_bumped_step))
    step = mnemojax.resilient(_bumped_step, mesh=h.mesh_of((4, 2)), donate_argnums=(0,),
                              options=h.no_precompile(),
                              fault_injector=mnemojax.testing.FaultInjector()
                              .lose_devices(5, [3], surface="block"))
    try:
        got = loop(step)
    finally:
        step.close()
    assert float(got["bump"]) == float(want["bump"]) == 8.0
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6, atol=1e-6)
    [rec] = step.statistics.recoveries
    assert rec.source_step == 4 and rec.source == "host_snapshot"


def test_after_a_restore_guarded_work_runs_plainly_until_the_next_step(tmp_path):
    """A run restored from its checkpoint has no step of its own yet (no state it
    committed, no batch kept to compile a new mesh for): guarded work before its first
    step runs plainly; after that step, a device lost during the eval is recovered and
    the eval runs again."""
    batches = h.make_batches(4)
    want_evals = h.reference_evals(batches)
    opts = h.no_precompile(persistent=mnemojax.PersistentOptions(directory=str(tmp_path),
                                                                 every_steps=2))
    model, optimizer = h.make_mlp()
    first = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=opts)
    try:
        for b in batches[:2]:
            first(model, optimizer, b)
    finally:
        first.close()
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=opts,
                              fault_injector=mnemojax.testing.FaultInjector()
                              .lose_devices_beside(2, [5]))
    evaluate = step.guard(nnx.jit(_eval))
    try:
        assert step.restore(model, optimizer) == 2
        evals = [float(evaluate(model, EVAL)["loss"])]  # plain: the fault does not fire
        assert step.statistics.recoveries == []
        for b in batches[2:]:
            step(model, optimizer, b)
            evals.append(float(evaluate(model, EVAL)["loss"]))  # after step 3: recovered
    finally:
        step.close()
    np.testing.assert_allclose(evals, want_evals[1:], rtol=1e-5, atol=1e-5)
    [rec] = step.statistics.recoveries
    assert rec.guarded and rec.step == 4 and rec.failed_devices == (5,)
