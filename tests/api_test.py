"""The resilient step's contract: error classification, budgets, forms, statistics."""

import logging
import signal
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mnemojax
from mnemojax._src.api import _StepBudget
from mnemojax._src.recovery import Resumed
from mnemojax.errors import (
    BatchSplitError,
    InvalidOptionError,
    LossCheckWarning,
    MeshTooSmallError,
    NonFiniteLossError,
    RecoveryExhaustedError,
    ShardingMismatchError,
    UnsupportedStateError,
)
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8


def _step(faults=None, mesh=None, **opts):
    return mnemojax.resilient(h.train_step, mesh=mesh or h.mesh_of((4, 2)),
                              options=h.no_precompile(**opts), fault_injector=faults)


def test_bare_and_keyword_forms_wrap_the_function():
    bare = mnemojax.resilient(h.train_step)
    keyed = mnemojax.resilient(options=h.no_precompile())(h.train_step)
    for step in (bare, keyed):
        assert isinstance(step, mnemojax.ResilientStep)
        assert step.__wrapped__ is h.train_step and step.__name__ == h.train_step.__name__
    variant = keyed.with_options(spare_devices=[7])
    assert variant is not keyed and variant.options is keyed.options
    with pytest.raises(InvalidOptionError, match="meshh"):
        keyed.with_options(meshh=None)


def test_with_options_after_a_recovery_keeps_the_mesh_without_the_lost_device():
    """The step the refusal of a new model suggests (``step.with_options()``, a user
    trial) kept the mesh it was given, the lost device in it: its first call failed
    placing the state with the raw device error. It now starts on the mesh as it is, and
    keeps the spares as they are."""
    step = _step(FaultInjector().lose_devices(2, [3]))
    model, optimizer = h.make_mlp()
    for batch in h.make_batches(3):
        step(model, optimizer, batch)
    assert len(step.statistics.recoveries) == 1
    assert 3 not in {d.id for d in step.mesh.devices.flat}
    other = step.with_options()
    assert other.mesh is step.mesh
    model, optimizer = h.make_mlp(seed=1)
    other(model, optimizer, h.make_batches(1)[0])
    assert other.statistics.recoveries == [] and other.statistics.steps_run == 1
    assert other.statistics.spare_devices == step.statistics.spare_devices == (2,)
    other.close()
    # A mesh given anew may take the devices that became spares.
    mesh = h.mesh_of((2, 2), devices=[jax.devices()[i] for i in (0, 1, 2, 4)])
    third = step.with_options(mesh=mesh)
    third(model, optimizer, h.make_batches(1)[0])
    assert third.statistics.spare_devices == ()
    third.close()
    step.close()


def test_shape_error_reaches_caller_unchanged_and_never_recovers():
    model, optimizer = h.make_mlp()
    step = _step(FaultInjector().lose_devices(5, [0]))
    bad = {"x": np.zeros((24, h.DIN + 1), np.float32), "y": np.zeros((24,), np.int32)}
    with pytest.raises(TypeError, match="dot_general"):
        step(model, optimizer, bad)
    assert step.statistics.recoveries == [] and step.statistics.steps_run == 0
    step.close()


def test_user_exception_is_raised_unchanged():
    class Boom(Exception):
        pass

    def exploding(model, optimizer, batch):
        raise Boom("from the user")

    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(exploding, mesh=h.mesh_of((4, 2)), options=h.no_precompile())
    with pytest.raises(Boom, match="from the user"):
        step(model, optimizer, h.make_batches(1)[0])
    assert step.statistics.recoveries == []


def test_nonfinite_loss_raises_and_keeps_previous_state():
    model, optimizer = h.make_mlp()
    step = _step()
    batches = h.make_batches(2)
    step(model, optimizer, batches[0])
    before = h.host_state(model, optimizer)
    poisoned = {"x": np.full_like(batches[1]["x"], np.nan), "y": batches[1]["y"]}
    with pytest.raises(NonFiniteLossError) as info:
        step(model, optimizer, poisoned)
    assert info.value.step == 2 and np.isnan(info.value.value)
    for a, b in zip(h.host_state(model, optimizer), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert step.statistics.recoveries == [] and step.statistics.steps_run == 1
    step.close()


def test_transient_error_is_retried_in_place():
    faults = FaultInjector().transient_error(2, times=2)
    got, step = h.resilient_run(h.make_batches(3), mesh=h.mesh_of((4, 2)), faults=faults)
    h.assert_same_run(got, h.reference_run(h.make_batches(3)))
    assert step.statistics.transient_retries == 2
    assert step.statistics.recoveries == [] and step.statistics.mesh_shape == {"data": 4, "model": 2}


def test_transient_retry_budget_and_backoff_with_injected_clock():
    sleeps = []
    model, optimizer = h.make_mlp()
    rec = mnemojax.RecoveryOptions(
        retry_stop=mnemojax.retry.stop_after_attempt(2),
        retry_backoff=mnemojax.retry.exponential_backoff(0.5, 3.0, 10.0),
        sleep=sleeps.append)
    step = _step(FaultInjector().transient_error(1, times=5), recovery=rec)
    with pytest.raises(RecoveryExhaustedError) as info:
        step(model, optimizer, h.make_batches(1)[0])
    assert info.value.attempts == 2
    assert isinstance(info.value.last_error, jax.errors.JaxRuntimeError)
    assert sleeps == [0.5, 1.5]  # backoff before retries 1 and 2, nobody actually slept
    step.close()


def test_recovery_budget_by_time_with_injected_clock():
    """'3 attempts or 10 minutes': the clock says 7 minutes pass per recovery, so the
    second device loss in the same step exhausts the time budget."""
    now = [0.0]

    def clock():
        now[0] += 420.0
        return now[0]

    rec = mnemojax.RecoveryOptions(
        stop=mnemojax.retry.stop_after_attempt(3) | mnemojax.retry.stop_after_delay(600.0),
        clock=clock)
    faults = FaultInjector().lose_devices(2, [0]).lose_devices_during_recovery(2, [2])
    model, optimizer = h.make_mlp()
    step = _step(faults, recovery=rec)
    step(model, optimizer, h.make_batches(1)[0])
    with pytest.raises(RecoveryExhaustedError, match="recovery budget exhausted") as info:
        step(model, optimizer, h.make_batches(2)[1])
    assert info.value.attempts == 1
    step.close()


def test_run_wide_budget_stops_cascading_recoveries():
    rec = mnemojax.RecoveryOptions(run_stop=mnemojax.retry.stop_after_attempt(1))
    faults = FaultInjector().lose_devices(2, [0]).lose_devices(3, [2])
    model, optimizer = h.make_mlp()
    step = _step(faults, recovery=rec)
    batches = h.make_batches(3)
    step(model, optimizer, batches[0])
    step(model, optimizer, batches[1])  # the first recovery is within budget
    with pytest.raises(RecoveryExhaustedError, match="run-wide"):
        step(model, optimizer, batches[2])
    step.close()


class _Closable:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


class _FormsWorld:
    """A `ProcessRecovery` stand-in whose world forms as `plan_kind`."""

    def __init__(self, plan_kind: str, failed: tuple[int, ...] = ()):
        self.built = None
        self.runtime = _Closable()
        self._record = types.SimpleNamespace(plan_kind=plan_kind, failed_processes=failed,
                                             generation=1)

    def recover(self, *args, position=None, **kwargs):
        from mnemojax._src.distributed.worker import coordination
        from mnemojax._src.recovery import POSITIONS

        # (as `ProcessRecovery.recover`: told to the world as it forms)
        coordination.post_value(f"{POSITIONS}/{self._record.generation}", position)
        return Resumed(self.runtime, [], 0, self._record)  # type: ignore[arg-type]


def test_a_regrow_is_charged_only_when_the_world_did_not_only_grow(monkeypatch):
    """A world re-formed on a regrow notice costs nothing of the recovery budgets when it
    only grew; one that formed otherwise (a joiner left, a member died meanwhile) is a
    failure after all, and its runtime is closed with the step. One step, built once,
    goes through the three cases (each leaves its world unadopted). Each world formed is
    told where this process goes on (a step: `_check_peers_at_the_work`)."""
    from mnemojax._src.distributed.worker import coordination

    posted: list[tuple[str, str]] = []
    monkeypatch.setattr(coordination, "post_value", lambda *a: posted.append(a))
    rec = mnemojax.RecoveryOptions(run_stop=mnemojax.retry.stop_after_attempt(0))
    model, optimizer = h.make_mlp()
    step = _step(recovery=rec)
    step(model, optimizer, h.make_batches(1)[0])
    b = step._built
    assert b is not None
    grew = _FormsWorld("grow_back")
    b.process_recovery = grew  # type: ignore[assignment]
    budget = _StepBudget(step.options.recovery, 2, [])
    assert step._recover_world(2, "regrow", 0.0, budget, charge=False).runtime \
        is grew.runtime
    with pytest.raises(RecoveryExhaustedError, match="run-wide"):  # the same, as a failure
        step._recover_world(2, "death", 0.0, budget)
    first = b.runtime
    for formed, failed in (("process_loss", ()), ("grow_back", (3,))):
        b.runtime, world = first, _FormsWorld(formed, failed)
        b.process_recovery = world  # type: ignore[assignment]
        with pytest.raises(RecoveryExhaustedError, match="run-wide"):
            step._recover_world(2, "regrow", 0.0, budget, charge=False)
        assert b.runtime is world.runtime  # closed with the step
    step.close()
    assert grew.runtime.closed == 0 and world.runtime.closed == 1
    assert posted == [("mnemojax/resume-position/1", "step:2@0")] * 3  # (one refused first)


def test_min_devices_ends_in_typed_error():
    model, optimizer = h.make_mlp()
    step = _step(FaultInjector().lose_devices(2, [0]),
                 recovery=mnemojax.RecoveryOptions(min_devices=8))
    step(model, optimizer, h.make_batches(1)[0])
    with pytest.raises(MeshTooSmallError, match="min_devices=8"):
        step(model, optimizer, h.make_batches(2)[1])
    step.close()


def test_batch_that_cannot_be_split_names_the_size_and_the_ways_on():
    """A user trial's whole-dataset batch (177 rows) met the default mesh (all 8 devices on
    one data axis) and the error named no way on."""
    model, optimizer = h.make_mlp()
    step = _step()
    with pytest.raises(BatchSplitError, match=r"22 examples.*width 4 cannot split evenly: .*"
                                              r"mesh=.*replicated_argnames"):
        step(model, optimizer, h.make_batches(1, batch=22)[0])
    step.close()

    def fit(state, batch):
        return {"w": state["w"] - 0.1 * jnp.mean(batch["x"], axis=0)}, None

    default = mnemojax.resilient(fit, options=h.no_precompile())
    with pytest.raises(BatchSplitError, match=r"width 8 \(no mesh given: the default mesh "
                                              r"puts the devices on one data axis\)"):
        default({"w": jnp.zeros((h.DIN,))}, h.make_batches(1, batch=22)[0])
    default.close()


def test_state_put_on_a_device_the_step_lost_is_refused_naming_it_and_the_way_on():
    """A user trial restored an Orbax checkpoint into the model after a recovery, with the
    shardings it was saved with (the mesh before, device 3 in it): the next call failed
    with a raw runtime error. Refused naming the leaf, the device and step.mesh; placed
    there, the step goes on."""
    model, optimizer = h.make_mlp()
    step = _step(FaultInjector().lose_devices(2, [5]))
    batches = h.make_batches(3)
    for b in batches[:2]:
        step(model, optimizer, b)
    assert len(step.statistics.recoveries) == 1
    before = jax.sharding.NamedSharding(h.mesh_of((4, 2)), jax.P())
    kernel = jax.device_put(np.asarray(model.l1.kernel.get_value()), before)
    model.l1.kernel.set_value(kernel)
    with pytest.raises(UnsupportedStateError, match=r"state model/l1/kernel is given on "
                                                    r"devices \[4, 5\], which are not in the "
                                                    r"step's mesh.*on step.mesh"):
        step(model, optimizer, batches[2])
    model.l1.kernel.set_value(jax.device_put(np.asarray(kernel), jax.sharding.NamedSharding(
        step.mesh, jax.P())))
    step(model, optimizer, batches[2])
    assert step.statistics.steps_run == 3
    step.close()


def test_annotation_naming_unknown_axis_is_rejected():
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((8,), ("data",)),
                              options=h.no_precompile())
    with pytest.raises(ShardingMismatchError, match="'model'"):
        step(model, optimizer, h.make_batches(1)[0])


def test_a_step_that_changes_a_state_leafs_type_is_a_typed_error_naming_it():
    """`jax.jit` traces again when a step returns its state with another dtype (Linen
    BatchNorm's statistics promoted by float64 inputs); a resilient step keeps the state's
    types to snapshot and reshard it, so the first call says which leaf changed and how,
    instead of the executable refusing the next step with a leaf index."""
    def step(state, x):
        return {"count": state["count"] + jnp.mean(x), "w": state["w"]}, {"loss": jnp.mean(x)}

    resilient = mnemojax.resilient(step, mesh=h.mesh_of((8,), ("data",)),
                                   options=h.no_precompile())
    state = {"count": np.zeros((), np.int32), "w": np.ones((4,), np.float32)}
    with pytest.raises(UnsupportedStateError,
                       match=r"'count': int32\[\] -> float32\[\]\).*cast in the step"):
        resilient(state, np.ones((8, 2), np.float32))
    # numpy float64 / int64 state under JAX's default x64=False goes in and comes out as
    # float32 / int32: not a change (the types compared are the traced ones).
    same = mnemojax.resilient(lambda st, x: ({"w": st["w"] * 2, "n": st["n"] + 1},
                                             {"loss": jnp.mean(x)}),
                              mesh=h.mesh_of((8,), ("data",)), options=h.no_precompile())
    got, _ = same({"w": np.ones(4), "n": np.zeros((), np.int64)}, np.ones((8, 2)))
    assert (got["w"].dtype, got["n"].dtype) == (jnp.float32, jnp.int32)
    np.testing.assert_array_equal(np.asarray(got["w"]), 2.0)


def test_wrong_call_forms_are_typed_errors():
    model, optimizer = h.make_mlp()
    step = _step()
    with pytest.raises(UnsupportedStateError, match="optimizer"):
        step(model, h.make_batches(1)[0])
    step2 = _step()
    with pytest.raises(UnsupportedStateError, match="pytree of arrays"):
        step2({"w": "not an array"}, h.make_batches(1)[0])


def test_invalid_decorator_arguments():
    with pytest.raises(InvalidOptionError, match="options="):
        mnemojax.resilient(h.train_step, options={"snapshot": 1})
    with pytest.raises(InvalidOptionError, match="mesh="):
        mnemojax.resilient(h.train_step, mesh="4x2")


def test_precompiled_executable_is_used_on_recovery():
    opts = mnemojax.ResilienceOptions(compile=mnemojax.CompileOptions(cache_dir=None))
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=opts,
                              fault_injector=FaultInjector().lose_devices(3, [6]))
    batches = h.make_batches(4)
    step(model, optimizer, batches[0])
    assert step.wait_precompiled(timeout_s=120)
    assert step.statistics.precompiled_meshes == 4  # one per data-parallel replica
    for b in batches[1:]:
        step(model, optimizer, b)
    [rec] = step.statistics.recoveries
    assert rec.precompiled and rec.executable == "ready"
    # No compile on the critical path: the recovery is far below the compile it avoided.
    assert step.statistics.compiles == 1 + 4
    h.assert_same_run(h.Run([], h.host_state(model, optimizer)),
                      h.Run([], h.reference_run(batches).state))
    step.close()


def test_warmed_fallbacks_serve_the_recovery_and_leave_the_math_alone():
    """`CompileOptions.warm_fallbacks`: each call after the ahead compiles runs one cold
    fallback executable once on zeros (on the training thread); after four calls the
    four candidates are warm, the recovery runs on one of them, and the warm-ups (other
    buffers) changed nothing: the final state is the failure-free run's."""
    opts = mnemojax.ResilienceOptions(compile=mnemojax.CompileOptions(
        cache_dir=None, warm_fallbacks=True))
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=opts,
                              fault_injector=FaultInjector().lose_devices(6, [6]))
    batches = h.make_batches(7)
    try:
        step(model, optimizer, batches[0])
        assert step.wait_precompiled(timeout_s=120)
        compiler = step._require_built().runtime.compiler
        warmed = []
        for b in batches[1:5]:
            step(model, optimizer, b)
            warmed.append(compiler.warmed)
        assert warmed == [1, 2, 3, 4]  # one per call, each candidate once
        for b in batches[5:]:
            step(model, optimizer, b)
        [rec] = step.statistics.recoveries
        assert rec.step == 6 and rec.precompiled and rec.executable == "ready"
        h.assert_same_run(h.Run([], h.host_state(model, optimizer)),
                          h.Run([], h.reference_run(batches).state))
    finally:
        step.close()


def test_the_planners_model_shrink_bound_comes_from_the_option_and_the_devices_memory(
        monkeypatch):
    """`RecoveryOptions.model_shrink_headroom` bounds how far a sharded axis may narrow;
    in one process so does the devices' memory (limit over peak use, where they report
    it: CPU devices do not, so it is faked here), the least of them, dead devices aside,
    taken once per mesh (the warm-ups' zero states must not move it between the plans
    compiled ahead and the recovery). Under a session, the option only."""
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(
        recovery=mnemojax.RecoveryOptions(model_shrink_headroom=3.0)))
    try:
        step(model, optimizer, h.make_batches(1)[0])
        b = step._require_built()
        monkeypatch.setattr(b.runtime.layer, "memory_headroom", lambda d: 1.5 + d.id / 10)
        assert step._rules().max_model_shrink == 1.5
        monkeypatch.setattr(b.runtime.layer, "memory_headroom", lambda d: 9.0)
        assert step._rules().max_model_shrink == 1.5  # taken once for this mesh
        b.memory_room = None  # a new mesh (`_adopt`)
        assert step._rules().max_model_shrink == 3.0
        b.memory_room = None
        monkeypatch.setattr(b.runtime.layer, "memory_headroom", lambda d: 1.5 + d.id / 10)
        b.runtime.proxy.dead.add(0)  # a dead device is not asked
        assert step._rules().max_model_shrink == pytest.approx(1.6)
        b.memory_room, session = None, b.session
        b.session = object()  # type: ignore[assignment]  # (only its presence is read)
        try:
            assert step._rules().max_model_shrink == 3.0  # every process plans alike
        finally:
            b.session = session
    finally:
        step.close()


def test_statistics_report_mesh_and_snapshot_bytes():
    every_step = h.no_precompile(snapshot=mnemojax.SnapshotOptions(every_steps=1))
    got, step = h.resilient_run(h.make_batches(2), mesh=h.mesh_of((4, 2)), settle=True,
                                options=every_step)
    stats = step.statistics
    assert stats.steps_run == 2 and stats.mesh_shape == {"data": 4, "model": 2}
    assert stats.mesh_devices == tuple(range(8))
    state_bytes = sum(x.nbytes for x in got.state)
    # Replica dedup: one copy of each shard, no more, no less.
    assert stats.snapshot_bytes == state_bytes
    assert set(stats.snapshot_bytes_by_entry) == {"params", "opt_state"}
    assert stats.snapshots_taken >= 1
    # Every shard has 4 live replicas on (4, 2): the rare cadence applies.
    assert not stats.unreplicated_state and stats.snapshot_every_steps == 1


def test_snapshot_cadence_follows_replication():
    _, replicated = h.resilient_run(h.make_batches(1), mesh=h.mesh_of((4, 2)))
    assert replicated.statistics.snapshot_every_steps == 20  # the default every_steps
    _, sharded = h.resilient_run(h.make_batches(1), mesh=h.mesh_of((1, 8)))
    assert sharded.statistics.unreplicated_state
    assert sharded.statistics.snapshot_every_steps == 1  # unreplicated_every_steps


def test_model_is_updated_in_place_like_nnx_jit():
    model, optimizer = h.make_mlp()
    step = _step()
    kernel_before = np.asarray(model.l1.kernel.get_value()).copy()
    step(model, optimizer, h.make_batches(1)[0])
    assert not np.allclose(np.asarray(model.l1.kernel.get_value()), kernel_before)
    assert int(optimizer.step.get_value()) == 1
    assert isinstance(model.l1.kernel.get_value().sharding, jax.sharding.NamedSharding)
    step.close()


def _changed_before_step_3(change, *, first=None) -> tuple:
    """`change(model)` (the model to go on with) made between steps 2 and 3 of a plain
    ``nnx.jit`` run and of a resilient one whose state is donated and which loses device 5
    in step 3: the snapshot it restores must hold the change, and the runs end equal.
    ``first(step, model, optimizer)`` runs before the change. Returns the step (closed)
    and the model before the change."""
    batches = h.make_batches(4)
    plain = nnx.jit(h.train_step)
    model, optimizer = h.make_mlp()
    for i, b in enumerate(batches):
        model = change(model) if i == 2 else model
        plain(model, optimizer, b)
    want = h.host_state(model, optimizer)

    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), donate_argnums=(0, 1),
                              options=h.no_precompile(),
                              fault_injector=FaultInjector().lose_devices(3, [5]))
    model, optimizer = h.make_mlp()
    for b in batches[:2]:
        step(model, optimizer, b)
    if first is not None:
        first(step, model, optimizer)
    old, model = model, change(model)
    for b in batches[2:]:
        step(model, optimizer, b)
    for got, ref in zip(h.host_state(model, optimizer), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    [rec] = step.statistics.recoveries
    assert rec.source_step == 2 and rec.source != "live_replicas"
    step.close()
    return step, old


def test_other_objects_of_the_same_structure_are_carried_from_then_on():
    """``nnx.jit`` takes any objects: a model loaded anew (or resharded between steps,
    Flax's optimization cookbook) passed in place of the carried one is carried from then
    on, its values the state. Donated state and device 5 lost in the very step that
    brings it: the snapshot restored is of the new model, and the run equals ``nnx.jit``'s
    on the same objects."""
    # (the same optimizer: its tx is part of the structure)
    _, old = _changed_before_step_3(lambda model: h.make_mlp(seed=1)[0])
    # The objects before are no longer carried: another step may take them.
    other = _step()
    other(old, nnx.Optimizer(old, optax.sgd(0.1), wrt=nnx.Param), h.make_batches(1)[0])
    other.close()


def test_a_submodule_replaced_between_steps_is_trained_from_then_on_as_nnx_jit_does():
    """Model surgery between steps (Flax's surgery guide: ``model.l2 = ...``, a new
    submodule of the same structure): the step carries the new submodule's variables from
    then on, as ``nnx.jit`` does, and device 5 lost (state donated) in the very step after
    it restores the new values. It was silently ignored: the step went on training the
    old submodule (a user trial). A change of structure (a variable added) is refused
    naming the way out, and undone, the step goes on."""
    def surgery(model):
        model.l2 = h.make_mlp(seed=1)[0].l2
        return model

    def another_structure(step, model, optimizer):
        model.extra = nnx.Param(jnp.zeros((3,)))
        with pytest.raises(UnsupportedStateError, match=r"structure of model, optimizer "
                                                        r"changed .*step.close\(\)"):
            step(model, optimizer, h.make_batches(3)[2])
        del model.extra

    _changed_before_step_3(surgery, first=another_structure)


def test_a_refused_in_place_change_is_refused_again_at_the_next_call():
    """A replaced submodule refused (another live step carries it; or restore() filled
    the objects and no step ran since) stays refused when the call is made again: a
    review found the retry went through, training the variables before the change."""
    batches = h.make_batches(2)
    model, optimizer = h.make_mlp()
    other_model, other_optimizer = h.make_mlp(seed=1)
    step, other = _step(), _step()
    other(other_model, other_optimizer, batches[0])
    step(model, optimizer, batches[0])
    model.l2 = other_model.l2
    for _ in range(2):
        with pytest.raises(UnsupportedStateError, match="already carried by another"):
            step(model, optimizer, batches[1])
    other.close()
    step.close()
    fresh = _step()
    model, optimizer = h.make_mlp()
    assert fresh.restore(model, optimizer) == 0
    model.l2 = h.make_mlp(seed=1)[0].l2
    for _ in range(2):
        with pytest.raises(UnsupportedStateError, match=r"restore\(\) filled"):
            fresh(model, optimizer, batches[1])
    fresh.close()


def test_other_objects_are_not_taken_when_abstract_carried_elsewhere_or_after_a_restore():
    """Objects of the same structure are not taken in place of the carried ones when they
    hold no arrays (``nnx.eval_shape``'s), when another live step carries them (the step
    goes on with its own), or right after ``restore()`` filled the carried ones (their
    restored values would be dropped)."""
    batches = h.make_batches(3)
    model, optimizer = h.make_mlp()
    step = _step()
    step(model, optimizer, batches[0])
    abstract = nnx.eval_shape(lambda: h.make_mlp(seed=1)[0])
    with pytest.raises(UnsupportedStateError, match="another model"):
        step(abstract, optimizer, batches[1])
    other_model = h.make_mlp(seed=1)[0]
    other = _step()
    other(other_model, nnx.Optimizer(other_model, optax.sgd(0.1), wrt=nnx.Param), batches[0])
    with pytest.raises(UnsupportedStateError, match="already carried by another resilient"):
        step(other_model, optimizer, batches[1])
    assert step._require_built().form.objects[0] is model  # (still its own objects)
    step(model, optimizer, batches[1])
    assert step.statistics.steps_run == 2
    other.close()
    step.close()
    fresh = _step()
    assert fresh.restore(model, optimizer) == 0
    with pytest.raises(UnsupportedStateError, match=r"restore\(\) filled the objects it was "
                                                    r"given; this call passes others in "
                                                    r"place of model"):
        fresh(h.make_mlp(seed=2)[0], optimizer, batches[2])
    fresh.close()


def test_other_objects_of_another_structure_are_refused_naming_the_way_on():
    """Objects of another structure (here a new optimizer: its optax transformation is
    another object) are refused; the message's way to go on with their values (copy them
    into the carried objects) trains as ``nnx.jit`` on them."""
    model, optimizer = h.make_mlp()
    step = _step()
    batch, batch2 = h.make_batches(2)
    step(model, optimizer, batch)
    other, other_opt = h.make_mlp(seed=1)
    with pytest.raises(UnsupportedStateError, match=r"does not carry \(it carries model, "
                       r"optimizer.*nnx.update\(model, .*step.close\(\), then "
                       r"step.with_options\(\)"):
        step(other, other_opt, batch)
    want = nnx.jit(h.train_step)(*h.make_mlp(seed=1), batch2)
    nnx.update(model, nnx.state(h.make_mlp(seed=1)[0]))
    nnx.update(optimizer, nnx.state(h.make_mlp(seed=1)[1]))
    got = step(model, optimizer, batch2)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    step.close()
    # The message's other way: a new step (with_options() failed while this one carried
    # the model: a user trial)
    again = step.with_options()
    got = again(other, other_opt, batch2)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    again.close()


def test_a_model_shared_by_two_resilient_steps_is_refused_up_front():
    """Each step moves its state on its own recoveries: the second step would run on
    arrays of a mesh it does not know. Refused at its build, naming the state."""
    model, optimizer = h.make_mlp()
    first, second = _step(), _step()
    assert first.restore(model, optimizer) == 0  # builds it (nothing to restore)
    with pytest.raises(UnsupportedStateError, match=r"state model/l1/\w+ is already carried by another resilient step"):
        second(model, optimizer, h.make_batches(1)[0])
    first.close()  # releases the model
    assert second.restore(model, optimizer) == 0
    second.close()


def test_a_loss_key_missing_from_the_metrics_warns_once_and_the_state_is_still_checked():
    def fit(state, batch):
        new = {"w": state["w"] - 0.1 * jnp.mean(batch["x"], axis=0)}
        return new, {"mse": jnp.mean(batch["x"] ** 2)}

    step = mnemojax.resilient(fit, options=h.no_precompile())
    state = {"w": jnp.zeros((h.DIN,))}
    batches = h.make_batches(2)
    with pytest.warns(LossCheckWarning, match=r"no key 'loss' \(keys: \['mse'\]\)"):
        state, _ = step(state, batches[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, _ = step(state, batches[1])  # once per step
    poisoned = {"x": np.full_like(batches[0]["x"], np.nan), "y": batches[0]["y"]}
    with pytest.raises(NonFiniteLossError, match="NaN/Inf"):
        step(state, poisoned)
    step.close()


def test_a_loss_per_example_is_checked_whole_without_a_warning():
    """A loss that is an array (per example, or per device as a pmap-style step returns
    it) is checked whole: no warning (it said "no key 'loss' (keys: ['loss'])", a user
    trial), and one NaN element stops the step with its value; the state stays finite (a
    NaN-free state only the loss check can stop)."""
    def fit(state, batch):
        loss = jnp.sum(batch["x"] ** 2, axis=1)  # (one per example)
        return {"w": state["w"] - 0.1}, {"loss": loss}

    step = mnemojax.resilient(fit, options=h.no_precompile())
    state = {"w": jnp.zeros((h.DIN,))}
    batch = h.make_batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, _ = step(state, batch)
    x = batch["x"].copy()
    x[3, 0] = np.inf
    with pytest.raises(NonFiniteLossError, match=r"loss=inf") as raised:
        step(state, {"x": x, "y": batch["y"]})
    assert raised.value.value == np.inf
    counts = mnemojax.resilient(lambda s, b: (s, {"loss": jnp.sum(b["x"] > 0, axis=1)}),
                                options=h.no_precompile())
    with pytest.warns(LossCheckWarning, match=r"the metrics' 'loss' is an array of int32, "
                                              r"not a number or floats"):
        counts(state, batch)
    counts.close()
    step.close()


def test_batch_axes_are_inferred_or_named_and_a_mesh_without_them_is_refused_at_build():
    model, optimizer = h.make_mlp()
    batch = h.make_batches(1)[0]
    rows = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2), ("rows", "model")),
                              options=h.no_precompile())
    with pytest.raises(InvalidOptionError, match=r"data_axis='auto' finds no batch axis on the "
                                                 r"mesh \(axes \('rows', 'model'\)"):
        rows(model, optimizer, batch)
    fsdp_mesh = h.mesh_of((4, 2), ("fsdp", "model"))
    named = rows.with_options(mesh=fsdp_mesh, options=h.no_precompile(data_axis="data"))
    with pytest.raises(InvalidOptionError, match=r"data_axis='data': 'data' is not an axis "
                                                 r"of the mesh \(axes \('fsdp', 'model'\)\)"):
        named(model, optimizer, batch)
    inferred = rows.with_options(mesh=fsdp_mesh)  # "auto": the batch goes over fsdp
    loss = float(inferred(model, optimizer, batch)["loss"])
    inferred.close()
    assert inferred.options.data_axis == "fsdp"
    assert inferred.statistics.mesh_shape == {"fsdp": 4, "model": 2}
    assert loss == pytest.approx(h.reference_run([batch]).losses[0], rel=1e-6)


def test_a_loss_callable_finds_the_loss_in_any_return_value():
    def fit(state, batch):
        loss = jnp.mean(batch["x"] ** 2)
        return {"w": state["w"] + loss}, (loss, {"aux": loss})

    step = mnemojax.resilient(fit, options=h.no_precompile(loss_key=lambda out: out[0]))
    state = {"w": jnp.zeros(())}
    batch = h.make_batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loss is found: no LossCheckWarning
        state, (loss, _) = step(state, batch)
    assert float(loss) == pytest.approx(float(np.mean(batch["x"] ** 2)), rel=1e-6)
    poisoned = {"x": np.full_like(batch["x"], np.inf), "y": batch["y"]}
    with pytest.raises(NonFiniteLossError, match="loss=inf"):
        step(state, poisoned)
    step.close()


def test_unreplicated_state_loses_at_most_one_step_when_a_device_dies_early():
    """Fully model-sharded state: the initial state's snapshot is complete before step 1,
    and each snapshot's copy before the next is queued, so a device lost in step 2 (which
    may take step 1's copy in flight with it) costs at most one step."""
    batches = h.make_batches(4)
    got, step = h.resilient_run(batches, mesh=h.mesh_of((1, 8)), faults=FaultInjector()
                                .lose_devices(2, [7], surface="block"))
    [rec] = step.statistics.recoveries
    assert step.statistics.unreplicated_state and rec.steps_lost <= 1, rec
    h.assert_same_run(got, h.reference_run(batches))


def test_an_unreferenced_step_releases_its_model_and_a_refused_build_leaves_nothing(
        tmp_path):
    model, optimizer = h.make_mlp()
    first = _step()
    first.restore(model, optimizer)
    second = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(
        persistent=mnemojax.PersistentOptions(directory=str(tmp_path / "ckpt"))))
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(UnsupportedStateError, match="already carried"):
        second.restore(model, optimizer)
    assert second._built is None  # noqa: SLF001 - refused before anything was built
    assert signal.getsignal(signal.SIGTERM) is handler
    del first  # no gc.collect(): the step is freed by reference counting
    assert second.restore(model, optimizer) == 0
    second.close()


def test_a_donated_state_rolls_back_to_its_snapshot_and_recovers_exact():
    """Donating the state (``donate_argnames``, as ``jax.jit(..., donate_argnums=0)``
    programs do) leaves no live copy after a failed step, even of replicated shards: a
    recovery rolls back to the newest host snapshot, taken before the first step too, and
    replays. Before, a replicated donated state had no snapshot before step `every_steps`,
    and a loss then ended in `StateUnavailableError`."""
    batches = h.make_batches(6)
    faults = FaultInjector().lose_devices(2, [3]).lose_devices(4, [5], surface="block")
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=faults, donate_argnames=("model", "optimizer"))
    try:
        losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    finally:
        step.close()
    assert step.options.compile.donate_state
    assert step.statistics.snapshot_every_steps == mnemojax.SnapshotOptions().every_steps
    recs = step.statistics.recoveries
    assert [(r.source, r.source_step) for r in recs] == [("host_snapshot", 0)] * 2
    assert [r.steps_lost for r in recs] == [1, 3]  # steps 1, then 1-3, replayed
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)),
                      h.reference_run(batches))


def test_every_replica_of_a_shard_lost_before_the_first_cadence_rolls_back_to_step_0():
    """A replicated state, not donated: the first snapshot at the cadence comes at step
    20, but the state the first step starts from is snapshotted too (in the background).
    Every device holding one model shard is lost at step 3: no live copy of it survives,
    and the recovery rolls back to that snapshot and replays steps 1-2 (a user trial's
    run ended with `StateUnavailableError` here)."""
    batches = h.make_batches(5)
    faults = FaultInjector().lose_devices(3, [1, 3, 5, 7])
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile(),
                              fault_injector=faults)
    try:
        losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
    finally:
        step.close()
    assert step.statistics.snapshot_every_steps == mnemojax.SnapshotOptions().every_steps
    [rec] = step.statistics.recoveries
    assert (rec.source, rec.source_step, rec.steps_lost) == ("host_snapshot", 0, 2), rec
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)),
                      h.reference_run(batches))


class _ArrayLeavesMLP(nnx.Module):
    """Flax's `nnx_toy_examples/07_array_leaves.py`: plain array attributes, no Variables,
    and a call counter the forward pass bumps."""

    def __init__(self, rngs: nnx.Rngs):
        self.count = jnp.array(0)
        self.w1 = jax.random.normal(rngs.params(), (1, 16))
        self.b1 = jnp.zeros((16,))
        self.w2 = jax.random.normal(rngs.params(), (16, 1))

    def __call__(self, x):
        self.count += 1
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


def _array_leaves_step(model, optimizer, batch):
    def is_param(path, value):
        return path[-1] in ("w1", "b1", "w2")

    def loss_fn(model):
        return jnp.mean((batch["y"] - model(batch["x"])) ** 2)

    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, is_param))(model)
    optimizer.update(model, grads)


def test_a_model_of_plain_arrays_recovers_a_device_loss_like_its_plain_run():
    """The example's step, decorated unchanged: the arrays and the counter are carried,
    restored and written back; a device loss ends where the plain `nnx.jit` run ends."""
    rng = np.random.default_rng(0)
    batches = [{"x": rng.uniform(size=(16, 1)).astype(np.float32),
                "y": rng.uniform(size=(16, 1)).astype(np.float32)} for _ in range(6)]

    def run(step):
        model = _ArrayLeavesMLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1),
                                  wrt=lambda path, _: path[-1] in ("w1", "b1", "w2"))
        for batch in batches:
            step(model, optimizer, batch)
        return model

    want = run(nnx.jit(_array_leaves_step))
    step = mnemojax.resilient(_array_leaves_step, mesh=h.mesh_of((8,), ("data",)),
                              options=h.no_precompile(),
                              fault_injector=FaultInjector().lose_devices(3, [5]))
    got = run(step)
    [rec] = step.statistics.recoveries
    assert rec.step == 3 and int(got.count) == int(want.count) == 6
    for name in ("w1", "b1", "w2"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)),
                                   np.asarray(getattr(want, name)), atol=1e-6)
    step.close()


def test_a_step_that_cannot_compile_for_a_recovery_mesh_is_warned_of_early_then_typed(
        tmp_path, caplog):
    """A `jax.shard_map` made once outside the step keeps the mesh of its first call: the
    step compiles on the first mesh only. Its compile ahead for the other meshes fails,
    which is said at once (no fault yet); a device loss then ends with a typed
    `StepCompileError` naming the recovery's mesh (the cause chained), and a `fault`
    event."""
    from jax.sharding import PartitionSpec as P

    from mnemojax._src.events import read_events
    from mnemojax.errors import StepCompileError

    doubled = jax.shard_map(lambda x: x * 2.0, in_specs=P("data"), out_specs=P("data"),
                            check_vma=False)

    def step(model, optimizer, batch):
        return h.train_step(model, optimizer, {**batch, "x": doubled(batch["x"])})

    model, optimizer = h.make_mlp()
    events = tmp_path / "events.jsonl"
    step = mnemojax.resilient(
        step, mesh=h.mesh_of((4, 2)),
        options=mnemojax.ResilienceOptions(
            compile=mnemojax.CompileOptions(cache_dir=None),
            event_log=str(events)),
        fault_injector=FaultInjector().lose_devices(3, [5]))
    batches = h.make_batches(3)
    with caplog.at_level(logging.WARNING, logger="mnemojax"):
        step(model, optimizer, batches[0])
        step.wait_precompiled()
        said = [r.getMessage() for r in caplog.records
                if "compiling the step ahead of time for mesh" in r.getMessage()]
        # Once per mesh shape, though several candidates of one shape failed.
        shapes = [m.split("mesh ")[1].split(" failed")[0] for m in said]
        assert said and len(shapes) == len(set(shapes)), said
        step(model, optimizer, batches[1])
        with pytest.raises(StepCompileError, match="recovery's mesh") as raised:
            step(model, optimizer, batches[2])
    assert raised.value.mesh_shape != {"data": 4, "model": 2}
    assert isinstance(raised.value.__cause__, ValueError)
    faults = [e for e in read_events(events) if e["kind"] == "fault"]
    assert any(e.get("classification") == "step_compile" for e in faults), faults
    step.close()


def test_a_step_written_for_pmap_fails_its_trace_with_a_note_on_what_to_do():
    """A collective over a named axis (``lax.pmean(g, 'batch')``, written for
    ``jax.pmap``) fails under jit with JAX's error, raised as it is with a note."""
    def pmap_style(model, optimizer, batch):
        metrics = h.train_step(model, optimizer, batch)
        return {"loss": jax.lax.pmean(metrics["loss"], "batch")}

    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(pmap_style, mesh=h.mesh_of((4, 2)), options=h.no_precompile())
    with pytest.raises(NameError, match="unbound axis name") as raised:
        step(model, optimizer, h.make_batches(1)[0])
    assert any("A step written for jax.pmap" in n for n in raised.value.__notes__)
    step.close()


def test_a_trace_error_names_the_users_step_and_its_argument():
    """JAX's trace errors name the function traced: the user's step (its file and line),
    not mnemojax's wrapper, and the argument by the user's name."""
    def train_step(model, optimizer, batch, scale):
        if scale > 1:  # a traced Python number in Python control flow
            batch = {**batch, "x": batch["x"] * 2}
        return h.train_step(model, optimizer, batch)

    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile())
    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        step(model, optimizer, h.make_batches(1)[0], 2.0)
    line = train_step.__code__.co_firstlineno
    assert f"the function train_step at {__file__}:{line}" in str(raised.value)
    assert "argument batch.scale" in str(raised.value)
    step.close()


def test_a_step_input_of_an_ended_world_is_said_once(caplog, monkeypatch):
    """After a world change, a step input computed on the ended world's devices (a key
    split outside the step) is warned of, once per input; host inputs and arrays of the
    current world are not."""
    from mnemojax._src.api import _say_inputs_of_ended_worlds
    from mnemojax._src.step_forms import form_for

    model, optimizer = h.make_mlp()
    batch = h.make_batches(1)[0]
    # An array, host numpy, and a typed key (whose raw data the call carries).
    batch = {"x": jnp.asarray(batch["x"]), "y": batch["y"], "k": jax.random.key(0)}
    _, inputs = form_for(h.train_step, (model, optimizer, None)).split_call(
        (model, optimizer, batch))

    def built():
        return types.SimpleNamespace(old_world_inputs=set())

    with caplog.at_level(logging.WARNING, logger="mnemojax"):
        _say_inputs_of_ended_worlds(built(), inputs)
        assert not caplog.records
        ended = built()
        new_client = types.SimpleNamespace(client=object())  # (a world change's backend)
        monkeypatch.setattr(jax, "devices", lambda platform=None: [new_client])
        _say_inputs_of_ended_worlds(ended, inputs)
        _say_inputs_of_ended_worlds(ended, inputs)
    said = sorted(r.getMessage() for r in caplog.records)
    assert len(said) == 2 and all("world that ended" in m for m in said)
    assert "batch['k']" in said[0] and "batch['x']" in said[1]


def test_nnx_cached_partial_of_a_resilient_step_runs_like_the_plain_one():
    """Flax's `02_lifted_transforms`: ``nnx.cached_partial(train_step, model, optimizer)``
    calls the step with a traversal cache for an NNX transform to take (Flax raises when
    none does); the resilient step takes it, and trains the objects as `nnx.jit` does."""
    batches = h.make_batches(3)

    def run(step):
        model, optimizer = h.make_mlp()
        cached = nnx.cached_partial(step, model, optimizer)
        for batch in batches:
            cached(batch)
        return h.host_state(model, optimizer)

    want = run(nnx.jit(h.train_step))
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile())
    got = run(step)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    # The step takes the objects themselves too (a restore, a call outside the loop): the
    # clones share their Variables.
    model, optimizer = h.make_mlp()
    other = step.with_options()
    other.restore(model, optimizer)
    nnx.cached_partial(other, model, optimizer)(batches[0])
    other(model, optimizer, batches[1])
    step.close()
    other.close()


class _MeanOverLength(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((1, 1)))

    def __call__(self, x):
        return jnp.mean(x, axis=1, keepdims=True) @ self.w[...]


def _bucketed_step(model, optimizer, batch):
    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - 1.0) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss}


@pytest.mark.parametrize("layouts", [1, 2])
def test_the_worlds_a_loss_forms_are_compiled_ahead_for_each_recent_batch_layout(layouts):
    """Bucketed batches (sequence lengths 4 and 8, alternating): with
    ``ahead_layouts=2`` a device loss in a step of length 8 finds its mesh's step
    compiled ahead (``ready``); with 1, only the layout of the batch at the first step
    (length 4) was."""
    model = _MeanOverLength()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = mnemojax.resilient(
        _bucketed_step, mesh=h.mesh_of((8,), ("data",)),
        options=mnemojax.ResilienceOptions(compile=mnemojax.CompileOptions(
            cache_dir=None, max_precompiled=1, ahead_layouts=layouts)),
        fault_injector=FaultInjector().lose_devices(6, [0]))
    rng = np.random.default_rng(0)
    for i in range(6):
        length = 4 if i % 2 == 0 else 8  # step 1 (i = 0): 4, ..., step 6: 8
        step(model, optimizer, {"x": rng.normal(size=(16, length)).astype(np.float32)})
        if i == 2:
            step.wait_precompiled()  # (both lengths seen: their compiles ahead done)
    [rec] = step.statistics.recoveries
    assert rec.executable == ("ready" if layouts == 2 else "compiled"), rec.executable
    step.close()


def test_an_optimizer_that_leaves_parameters_out_recovers_as_nnx_jit_runs():
    """``optax.multi_transform`` (per-group optimizers, a frozen group) keeps optax's
    ``MaskedNode`` where a transformation leaves a parameter out: variables holding no
    array, once refused as "what sow leaves" (a review). The step carries the others and
    rebuilds those from the state's structure; a device loss recovers as nnx.jit runs."""
    from mnemojax.models.tasks import build_mlp

    def make():
        tx = optax.multi_transform(
            {"adam": optax.adam(1e-2), "frozen": optax.set_to_zero()},
            lambda params: jax.tree.map(lambda p: "adam" if p.ndim > 1 else "frozen", params))
        return build_mlp(din=h.DIN, dhidden=h.DHIDDEN, dout=h.DOUT, optimizer=tx)

    batches = h.make_batches(5)
    model, optimizer = make()
    mesh = h.mesh_of((4, 2))
    step = mnemojax.resilient(h.train_step, mesh=mesh, options=h.no_precompile(),
                              fault_injector=FaultInjector().lose_devices(3, [2]))
    try:
        losses = [float(step(model, optimizer, b)["loss"]) for b in batches]
        (recovery,) = step.statistics.recoveries
    finally:
        step.close()
    assert recovery.steps_lost <= 1
    biases = [np.asarray(model.l1.bias[...]), np.asarray(model.l2.bias[...])]
    np.testing.assert_array_equal(biases[0], make()[0].l1.bias[...])  # (frozen)
    want = h.plain_mesh_run(h.train_step, *make(), batches, mesh, jax.P("data"))
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), want)


def test_an_input_on_a_device_lost_to_the_fault_injector_is_said_once(caplog):
    """A batch the user placed on the mesh before a recovery (here on every device of the
    first mesh) still feeds the step after a device is lost to a `FaultInjector`, which
    leaves its arrays readable; a real loss would not (a user trial's rehearsal ran on
    silently). The step warns, once per input, naming the lost devices; host inputs are
    not named."""
    from mnemojax.testing import FaultInjector

    model, optimizer = h.make_mlp()
    mesh = h.mesh_of((4, 2))
    step = mnemojax.resilient(h.train_step, mesh=mesh, options=h.no_precompile(),
                              fault_injector=FaultInjector().lose_devices(2, [3]))
    rows = jax.sharding.NamedSharding(mesh, jax.P("data"))
    with caplog.at_level(logging.WARNING, logger="mnemojax"):
        for batch in h.make_batches(4):
            step(model, optimizer, {"x": jax.device_put(batch["x"], rows), "y": batch["y"]})
    said = [r.getMessage() for r in caplog.records if "which this step lost" in r.getMessage()]
    assert step.statistics.recoveries and len(said) == 1, said
    assert "batch['x'] is an array on devices [3]" in said[0]
    step.close()


@pytest.mark.parametrize("where, past", [
    ("step:5", True), ("step:4", False), ("step:3", False),  # in the next step / not yet
    ("guard:5:2", False), ("guard:5:3", True), ("guard:5:1", False),  # at this call or before
    ("guard:6:1", True)])
def test_a_survivor_past_the_guarded_work_is_told_from_where_it_goes_on(where, past):
    """After a recovery in the 2nd guarded call after step 4, the work runs again only if
    no survivor has passed it: one in step 5, or in a later guarded call after step 4 (a
    save without collective passed, an eval after it met the death)."""
    from mnemojax._src.api import _past

    assert _past(where, 4, 2) is past


class _NoSession:
    """Stands for a distributed session that a build must not reach past its claim."""

    def __getattr__(self, name):
        raise RuntimeError(f"the build went on to session.{name}")


def test_a_second_live_step_in_a_distributed_job_is_refused_until_the_first_closes(
        monkeypatch):
    """Under ``mnemojax launch`` a process runs one live resilient step (trial 40: two
    steps of a GAN, each forming worlds of its own, ended every survivor with an
    IndexError after a kill): the second is refused at its first call, naming the first
    and what to do; once the first is closed it may build."""
    from mnemojax._src import ownership
    from mnemojax._src.distributed.worker import session as dist_session

    monkeypatch.setattr(dist_session, "current", lambda: _NoSession())
    batches = h.make_batches(1)
    first, second = _step(), _step()
    model, optimizer = h.make_mlp()
    other_model, other_optimizer = h.make_mlp(seed=1)
    try:
        with pytest.raises(RuntimeError, match="the build went on"):
            first(model, optimizer, batches[0])  # (claimed, then stopped by the fake)
        with pytest.raises(UnsupportedStateError, match=r"another resilient step \(mlp_train_step, "
                           r"built earlier\) is live .*train_step.guard\(eval_step\).* close\(\)"):
            second(other_model, other_optimizer, batches[0])
        ownership.release(first, session=False)  # (other objects carried from now on)
        with pytest.raises(UnsupportedStateError, match="another resilient step"):
            second(other_model, other_optimizer, batches[0])
        first.close()
        with pytest.raises(RuntimeError, match="the build went on"):
            second(other_model, other_optimizer, batches[0])
    finally:
        first.close()
        second.close()
