"""Recovery collaborators on their own: budgets, and a device recovery's hand-over."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax._src import sharding as shd
from mnemojax._src.durability import Durability
from mnemojax._src.errors import (
    DeviceFailureError,
    RecoveryExhaustedError,
    StateUnavailableError,
    StepCompileError,
)
from mnemojax._src.recovery import DeviceRecovery, ShapeRules, check_budget, compiling_for
from mnemojax._src.replay import ReplayBuffer, batch_struct
from mnemojax._src.retry import stop_after_attempt, stop_after_delay
from mnemojax._src.runtime import RuntimeBuilder
from mnemojax._src.statistics import Statistics
from mnemojax._src.topology import MeshPlan
from mnemojax.testing import FaultInjector
from tests import helpers as h


def test_check_budget_raises_with_the_last_error():
    last = DeviceFailureError("devices [3] failed", failed_devices=[3], step=7)
    check_budget(stop_after_attempt(2), 1, 0.0, step=7, exc=last, what="recovery")
    with pytest.raises(RecoveryExhaustedError, match="step 7: recovery budget") as info:
        check_budget(stop_after_attempt(2) | stop_after_delay(5.0), 1, 9.0, step=7, exc=last,
                     what="recovery")
    assert info.value.attempts == 1 and info.value.last_error is last
    assert info.value.__cause__ is last and last.failed_devices == (3,)


def _pure(leaves, batch):
    w, n = leaves
    return [w + batch["x"].sum(), n + 1], {"loss": jnp.sum(w)}


def _setup(spec, faults):
    opts = h.no_precompile()
    mesh = h.mesh_of((4, 2))
    builder = RuntimeBuilder(opts, pure=_pure, specs=[spec, P()],
                             leaf_structs=[((8, 2), jnp.float32), ((), jnp.int32)],
                             leaf_entries=["params", "other"], wrap_layer=faults.wrap)
    runtime = builder.build(MeshPlan(shd.device_ids(mesh), ("data", "model"), "unchanged"),
                            mesh=mesh)
    batches = ReplayBuffer(4)
    batch = {"x": np.ones((8, 3), np.float32)}
    batches.append(1, batch)
    durability = Durability(opts, keys=[("w",), ("n",)], layer=runtime.layer)
    stats = Statistics()
    recovery = DeviceRecovery(opts, builder, durability, stats, batches)
    exe, _ = runtime.compiler.get(runtime.plan, batch_struct(batch, None))
    w = np.arange(16, dtype=np.float32).reshape(8, 2)
    leaves = [jax.device_put(w, exe.state_shardings[0]),
              jax.device_put(np.int32(0), exe.state_shardings[1])]
    # Step 1 dies on device 3; the proxy's probe finds it dead, as in the step's loop.
    with pytest.raises(jax.errors.JaxRuntimeError):
        runtime.proxy.run(exe.compiled, leaves, runtime.proxy.place_batch(
            batch, exe.batch_shardings, None), 1)
    assert runtime.proxy.probe_all() == {3}
    rules = ShapeRules(data_axis="data", sharded_dims=shd.sharded_dims([spec, P()], [(8, 2), ()]),
                       batch_size=8, batch_policy="keep_math", min_devices=1)
    return recovery, runtime, leaves, rules, stats, w


def test_the_compile_barrier_allows_a_fetch_of_the_whole_state_within_a_cap():
    """Every process waits at a world's compile barrier with the same timeout, from the
    state alone: 300 s plus the global state's bytes at 50 MB/s, at most 1800 s."""
    import types

    from mnemojax._src.recovery import compiled_barrier_s

    def builder(*structs):
        return types.SimpleNamespace(leaf_structs=list(structs))

    assert compiled_barrier_s(builder()) == 300.0
    small = builder(((1000, 1000), np.float32), ((10,), jnp.bfloat16))  # 4 MB + 20 B
    assert compiled_barrier_s(small) == pytest.approx(300.0 + 4_000_020 / 50e6)
    huge = builder(((1 << 20, 1 << 20), np.float32))  # 4 TiB
    assert compiled_barrier_s(huge) == 1800.0


def test_device_recovery_hands_back_a_runtime_and_the_live_state():
    """Replicated over data: the state of step 0 is read just in time from live replicas;
    the new runtime is on a mesh without device 3 and keeps the compiler (same world)."""
    recovery, runtime, leaves, rules, stats, w = _setup(P(None, "model"),
                                                        FaultInjector().lose_devices(1, [3]))
    try:
        resumed = recovery.recover(runtime, step=1, state_step=0, leaves=leaves, failed={3},
                                   detect_s=0.01, rules=rules)
        assert resumed.state_step == 0 and not resumed.publish_replayed
        assert resumed.runtime.compiler is runtime.compiler
        assert 3 not in resumed.runtime.plan.device_ids
        assert resumed.runtime.proxy.dead == {3}
        np.testing.assert_array_equal(np.asarray(resumed.leaves[0]), w)
        rec = resumed.record
        assert rec.source == "live_replicas" and rec.plan_kind == "drop_replicas"
        assert rec.new_mesh_shape == {"data": 2, "model": 2}  # 3 replicas do not divide 8
        assert rec.steps_lost == 0 and rec.failed_devices == (3,)
        assert set(rec.phases_s) == {"detect", "plan", "reshard", "compile", "replay"}
        assert stats.recoveries == []  # recorded by the step once the failed step ran
    finally:
        runtime.close()


def test_device_recovery_without_any_copy_is_a_typed_error():
    """Sharded over both axes, no snapshot, no persistent tier: the one copy of the shard
    on device 3 is gone."""
    recovery, runtime, leaves, rules, _, _ = _setup(P("data", "model"),
                                                    FaultInjector().lose_devices(1, [3]))
    try:
        with pytest.raises(StateUnavailableError, match="no complete copy"):
            recovery.recover(runtime, step=1, state_step=0, leaves=leaves, failed={3},
                             detect_s=0.0, rules=rules)
    finally:
        runtime.close()


def test_options_take_stop_rules_only():
    with pytest.raises(mnemojax.errors.InvalidOptionError, match="stop="):
        mnemojax.RecoveryOptions(stop=3)  # type: ignore[arg-type]


def _world_recovery(generation, members, survivors, process_id):
    from mnemojax._src.distributed.agreement import Agreement
    from mnemojax._src.distributed.env import WorldSpec
    from mnemojax._src.distributed.worker.recovery import AgreedCopies, WorldRecovery

    agreement = Agreement(generation=generation, worker_id=survivors[process_id],
                          process_id=process_id, num_processes=len(survivors),
                          coordinator="127.0.0.1:1", resume_step=3, survivors=survivors,
                          previous_members=members, sources={})
    world = WorldSpec(coordinator="127.0.0.1:1", process_id=process_id,
                      num_processes=len(survivors), generation=generation)
    return WorldRecovery(agreement, world, AgreedCopies(3, 0, {}, {}, b""),
                         {"detach": 0.1, "agree": 0.2, "attach": 0.3, "fetch": 0.0}, 1,
                         members)


@pytest.mark.parametrize("process_id", [0, 2], ids=["stays", "idle"])
def test_a_process_the_new_mesh_leaves_idle_leaves_and_the_others_agree_again(process_id):
    """World 1 = workers (0, 1, 2) after worker 3 died; the plan gives process 2 no
    device. Process 2 leaves the job (`LeftJobExit`, recorded as a ``left_job`` fault);
    the others agree again and plan on from world 0's members."""
    import types

    from mnemojax._src.errors import LeftJobExit
    from mnemojax._src.recovery import ProcessRecovery

    first = _world_recovery(1, (0, 1, 2, 3), (0, 1, 2), process_id)
    later = _world_recovery(2, (0, 1, 2), (0, 1), min(process_id, 1))
    calls, events = [], []

    class Session:
        def leave(self, *, step, reason):
            calls.append(("leave", step, reason))
            raise LeftJobExit(reason, step=step, generation=1)

        def recover(self, *, last_step, reason, first_replayable):
            calls.append(("recover", last_step, first_replayable))
            return later

    durability = types.SimpleNamespace(emit=lambda kind, **kw: events.append((kind, kw)))
    recovery = ProcessRecovery(
        mnemojax.ResilienceOptions(), types.SimpleNamespace(leaf_structs=[]), durability,
        Statistics(), types.SimpleNamespace(first_step=4), Session(), [], (None, {}))
    plan = types.SimpleNamespace(shape={"data": 1, "model": 4})
    if process_id == 2:
        with pytest.raises(LeftJobExit):
            recovery._without_idle(first, [2], [2], plan, step=6, last_step=5)
        assert [c[0] for c in calls] == ["leave"] and "workers [2]" in calls[0][2]
        assert events[0][0] == "fault" and events[0][1]["classification"] == "left_job"
        return
    rec = recovery._without_idle(first, [2], [2], plan, step=6, last_step=5)
    assert calls == [("recover", 5, 4)] and events == []
    assert rec.members == (0, 1, 2, 3) and rec.agreement is later.agreement
    assert rec.rounds == 2 and rec.phases["agree"] == pytest.approx(0.4)


@pytest.mark.parametrize("error", [ValueError("mesh mismatch"), NameError("unbound"),
                                   OSError("agent gone"), MemoryError()])
def test_only_the_steps_own_compile_errors_become_step_compile_errors(error):
    """`compiling_for`: an error of the step's trace or compile on the recovery's mesh is
    a `StepCompileError` naming the mesh (the cause chained), told as a ``fault`` event
    (in one process and across processes alike); the host's errors pass, untold."""
    plan = MeshPlan(np.arange(6).reshape(3, 2), ("data", "model"), "unchanged")
    steps_own = isinstance(error, (ValueError, NameError))

    class Told:
        def __init__(self):
            self.events = []

        def emit(self, kind, **fields):
            self.events.append((kind, fields))

    told = Told()
    with pytest.raises(StepCompileError if steps_own else type(error)) as raised, \
            compiling_for(plan, told, 7):  # type: ignore[arg-type]
        raise error
    if steps_own:
        assert raised.value.mesh_shape == {"data": 3, "model": 2}
        assert raised.value.__cause__ is error
        [(kind, fields)] = told.events
        assert kind == "fault" and fields["classification"] == "step_compile"
        assert fields["step"] == 7 and fields["mesh"] == {"data": 3, "model": 2}
        assert fields["detail"].startswith(type(error).__name__)
    else:
        assert told.events == []


def test_two_steps_of_one_process_recover_onto_one_device_order():
    """A GAN's two steps in one process (a critic called three times per generator call)
    meet two deaths on a (4, 2) mesh: the critic one at a time (a replica dropped, then a
    spare swap with the idle device), the generator both at once (two replicas dropped,
    their healthy devices regrouped into one). Each planned from its own mesh: the same
    devices in other orders, and whatever one step returns to the other resharded at every
    call (trial 47: x4 per iteration of two pure steps passing their state). The later
    recovery takes the other step's order; the math is each step's failure-free run."""
    faults = FaultInjector().lose_devices(5, [3]).lose_devices(6, [1])  # (the critic's calls)
    mesh = h.mesh_of((4, 2))
    batches = h.make_batches(8)
    critic_model, critic_opt = h.make_mlp(seed=0)
    gen_model, gen_opt = h.make_mlp(seed=1)
    critic = mnemojax.resilient(h.train_step, mesh=mesh, options=h.no_precompile(),
                                fault_injector=faults)
    generator = mnemojax.resilient(h.train_step, mesh=mesh, options=h.no_precompile(),
                                   fault_injector=faults)
    try:
        for i in range(0, 8, 4):
            for b in batches[i:i + 3]:
                critic(critic_model, critic_opt, b)
            generator(gen_model, gen_opt, batches[i + 3])
        [_, swap] = critic.statistics.recoveries
        [both] = generator.statistics.recoveries
        # (its own plan: [[4, 5], [6, 7], [0, 2]], the healthy devices of the rows
        # dropped regrouped last)
        assert (swap.plan_kind, swap.new_mesh_devices) == ("spare_swap", (0, 2, 4, 5, 6, 7))
        assert both.failed_devices == (1, 3) and both.new_mesh_devices == (0, 2, 4, 5, 6, 7)
        assert shd.device_ids(generator.mesh).tolist() == shd.device_ids(critic.mesh).tolist()
    finally:
        critic.close()
        generator.close()
    for (model, optimizer), seed, mine in (((critic_model, critic_opt), 0, [0, 1, 2, 4, 5, 6]),
                                           ((gen_model, gen_opt), 1, [3, 7])):
        ref_model, ref_opt = h.make_mlp(seed=seed)
        plain = nnx.jit(h.train_step)
        for i in mine:
            plain(ref_model, ref_opt, batches[i])
        for got, want in zip(h.host_state(model, optimizer), h.host_state(ref_model, ref_opt),
                             strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _critic_step(state, x):
    w = state["critic"] - 0.1 * (x.mean(0) + jnp.tanh(state["gen"]))
    return {**state, "critic": w}, {"loss": jnp.sum(w)}


def _gen_step(state, x):
    g = state["gen"] - 0.05 * (x.mean(0) * state["critic"])
    return {**state, "gen": g}, {"loss": jnp.sum(g)}


def test_a_step_given_state_that_another_step_moved_off_a_lost_device_recovers_first():
    """Two pure steps of one process pass one state (a GAN's critic and generator). The
    critic meets the loss of device 3 and recovers onto a mesh without it; the generator,
    still on its mesh with device 3, gets the state on the critic's new mesh. Placing it
    failed with a raw ``JaxRuntimeError`` (trial 47); now the generator recovers first,
    from the state given, and both end equal to the failure-free run."""
    xs = [np.random.default_rng(k).normal(size=(8, 4)).astype(np.float32) for k in range(6)]

    def loop(critic, gen):
        state = {"critic": jnp.zeros((4,)), "gen": jnp.ones((4,))}
        for x in xs:
            state, _ = critic(state, x)
            state, _ = gen(state, x)
        return jax.tree.map(np.asarray, state)

    want = loop(jax.jit(_critic_step), jax.jit(_gen_step))
    faults = FaultInjector().lose_devices(3, [3])  # (the critic's call 3 comes first)
    critic = mnemojax.resilient(_critic_step, mesh=h.mesh_of((4, 2)),
                                options=h.no_precompile(), fault_injector=faults)
    gen = mnemojax.resilient(_gen_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                             fault_injector=faults)
    try:
        got = loop(critic, gen)
        [mine] = gen.statistics.recoveries
        assert mine.step == 3 and mine.failed_devices == (3,) and mine.steps_lost == 0
        assert 3 not in mine.new_mesh_devices
        assert shd.device_ids(gen.mesh).tolist() == shd.device_ids(critic.mesh).tolist()
    finally:
        critic.close()
        gen.close()
    for name in ("critic", "gen"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_a_step_given_state_on_another_steps_spare_recovers_first_too():
    """As above, but the critic swapped device 3 for the spare: the state given sits on a
    device outside the generator's mesh, which was taken for the caller's placement
    (`UnsupportedStateError`, a review). The loss is classified first."""
    devices = jax.devices()
    mesh = h.mesh_of((4,), names=("data",), devices=devices[:4])
    faults = FaultInjector().lose_devices(3, [3])
    steps = [mnemojax.resilient(fn, mesh=mesh, options=h.no_precompile(), fault_injector=faults,
                                spare_devices=devices[4:5]) for fn in (_critic_step, _gen_step)]
    state = {"critic": jnp.zeros((4,)), "gen": jnp.ones((4,))}
    try:
        for k in range(4):
            for step in steps:
                state, _ = step(state, np.full((8, 4), k, np.float32))
        assert [[(r.plan_kind, r.new_mesh_devices) for r in s.statistics.recoveries]
                for s in steps] == [[("spare_swap", (0, 1, 2, 4))]] * 2
    finally:
        for step in steps:
            step.close()


def _sum_step(state, x):
    return {"w": state["w"] + x.mean()}, {"loss": jnp.sum(state["w"])}


@pytest.mark.parametrize("given", ["on_the_lost_device", "host"])
def test_a_changed_state_given_after_a_loss_is_read_whole_or_refused(given):
    """A device died between calls (another step met it) and the state given to this step
    is not the one it returned. Held on the host, it is read whole. Held only on the lost
    device, no snapshot of this step holds it: a typed error naming why, where the
    recovery had mixed the step's own older snapshot in, silently (a review)."""
    mesh = h.mesh_of((4,), names=("data",))
    faults = FaultInjector().lose_devices(3, [0])  # (the other step's call 3)
    other = mnemojax.resilient(_sum_step, mesh=mesh, options=h.no_precompile(),
                               fault_injector=faults)
    step = mnemojax.resilient(_sum_step, mesh=mesh, options=h.no_precompile(),
                              fault_injector=faults)
    ones = np.ones((8, 4), np.float32)
    state, mine = {"w": jnp.zeros((4,))}, {"w": jnp.zeros((4,))}
    try:
        for _ in range(2):
            state, _ = other(state, ones)
            mine, _ = step(mine, ones)
        other(state, ones)  # (device 0 dies in it; this step's mesh still holds it)
        changed = np.full((4,), 100.0, np.float32)
        if given == "host":
            mine, _ = step({"w": changed}, ones)
            np.testing.assert_allclose(np.asarray(mine["w"]), changed + 1.0)
            [rec] = step.statistics.recoveries
            assert rec.failed_devices == (0,) and rec.source_step == 2 and rec.steps_lost == 0
        else:
            on_lost = jax.device_put(changed, jax.devices()[0])
            with pytest.raises(StateUnavailableError, match="not the state this step last "
                                                            "wrote"):
                step({"w": on_lost}, ones)
    finally:
        other.close()
        step.close()


def test_guarded_work_after_another_steps_loss_still_recovers():
    """A step's guarded eval after another step met a device loss, with one of its
    objects' arrays replaced by the user (on one device): recovered as before, not a
    private error escaping (a review's regression)."""
    faults = FaultInjector().lose_devices(3, [3])
    mesh = h.mesh_of((4, 2))
    batches = h.make_batches(3)
    (m1, o1), (m2, o2) = h.make_mlp(seed=0), h.make_mlp(seed=1)
    a = mnemojax.resilient(h.train_step, mesh=mesh, options=h.no_precompile(),
                           fault_injector=faults)
    b = mnemojax.resilient(h.train_step, mesh=mesh, options=h.no_precompile(),
                           fault_injector=faults)

    @b.guard
    def evaluate(model, batch):
        return model(b.place(batch)["x"]).sum()

    try:
        for i in range(2):
            a(m1, o1, batches[i])
            b(m2, o2, batches[i])
        a(m1, o1, batches[2])  # (device 3 dies in it)
        leaf = jax.tree.leaves(nnx.state(m2, nnx.Param),
                               is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        leaf.set_value(jnp.asarray(np.asarray(leaf.get_value())))  # the same values, one device
        assert np.isfinite(float(evaluate(m2, h.EVAL_BATCH)))
        [rec] = b.statistics.recoveries
        assert rec.failed_devices == (3,) and rec.guarded
    finally:
        a.close()
        b.close()
