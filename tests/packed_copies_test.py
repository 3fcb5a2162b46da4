"""Snapshots read from the packs the compiled step writes (`SnapshotOptions.pack_copies`):
the store's copy of a `Packed` state holds what the per-leaf copy holds, checked the same
way, and a resilient step whose lost shards come from packed snapshots ends equal to the
plain ``nnx.jit`` run."""

import gc
import weakref

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax._src.compiler import StepCompiler, pack_groups, packer
from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.errors import SnapshotBudgetWarning, SnapshotCorruptError
from mnemojax._src.snapshot import Packed, SnapshotStore
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8

# Every kind of layout a pack groups by: replicated, one axis, both axes on two dims,
# both axes on one dim (a tuple), another dtype, a scalar.
SPECS = [P(None, "model"), P(), P(("data", "model")), P("data", "model"), P("model"), P(),
         P("model", None)]


@pytest.fixture(scope="module")
def state():
    mesh = h.mesh_of((4, 2))
    rng = np.random.default_rng(0)
    host = [rng.normal(size=(8, 6)).astype(np.float32),
            rng.normal(size=(6,)).astype(np.float32),
            rng.normal(size=(16,)).astype(np.float32),
            rng.normal(size=(8, 4)).astype(np.float32),
            rng.integers(0, 100, size=(4,)).astype(np.int32),
            np.array(3, np.int32),
            rng.normal(size=(2, 3)).astype(np.float32)]
    leaves = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(host, SPECS,
                                                                        strict=True)]
    groups = pack_groups(SPECS, [(x.shape, x.dtype) for x in host], mesh)
    assert groups is not None

    @jax.jit
    def pack(leaves):
        return [packer(mesh, [SPECS[i] for i in members], axes)(*(leaves[i] for i in members))
                for axes, members in groups]

    return host, leaves, Packed(pack(leaves), [m for _, m in groups])


def _store():
    return SnapshotStore(JaxDeviceLayer(), ["state"] * len(SPECS), budget_bytes=1 << 30)


def _taken(store, step, leaves, packed=None):
    assert store.submit(step, leaves, packed) and store.wait_idle(30)
    snap = store.latest()
    assert snap is not None and snap.step == step
    return snap


def test_groups_are_by_mesh_axes_and_dtype(state):
    _, _, packed = state
    # float32: model-sharded (leaves 0, 6), replicated (1), over both axes (2, 3);
    # int32: model-sharded (4), replicated (5).
    assert sorted(map(tuple, packed.members)) == [(0, 6), (1,), (2, 3), (4,), (5,)]


def test_a_packed_copy_holds_what_the_per_leaf_copy_holds(state):
    host, leaves, packed = state
    store = _store()
    try:
        per_leaf = _taken(store, 1, leaves)
        keys = [set(leaf.shards) for leaf in per_leaf.leaves]
        reads = len(per_leaf.fills)
        snap = _taken(store, 2, leaves, packed)
        assert snap.pack_fills and len(snap.pack_fills) < reads
        assert [set(leaf.shards) for leaf in snap.leaves] == keys
        assert snap.nbytes == sum(x.nbytes for x in host)
        for i, x in enumerate(host):
            np.testing.assert_array_equal(snap.assemble(i), x)
            assert snap.leaves[i].dtype == x.dtype
    finally:
        store.close()


def test_slots_switch_between_packed_and_per_leaf_copies(state):
    host, leaves, packed = state
    doubled = [x * 2 for x in leaves]
    store = _store()
    try:
        _taken(store, 1, leaves, packed)
        _taken(store, 2, doubled)  # the other slot, per leaf
        third = _taken(store, 3, leaves)  # over the packed slot: laid out anew
        assert not third.pack_fills
        fourth = _taken(store, 4, doubled, packed)  # the per-leaf slot, packed now
        assert fourth.pack_fills
        for i, x in enumerate(host):
            np.testing.assert_array_equal(third.assemble(i), x)
            # (packed's arrays are of `leaves`, not `doubled`: the packs are what is read)
            np.testing.assert_array_equal(fourth.assemble(i), x)
    finally:
        store.close()


def test_a_corrupt_byte_in_a_packed_copy_is_caught(state):
    _, leaves, packed = state
    store = _store()
    try:
        snap = _taken(store, 1, leaves, packed)
        _, key, _, _, view, _ = next(f for f in snap.fills if f[0] == 2)
        view.view(np.uint8)[0] ^= 0xFF
        with pytest.raises(SnapshotCorruptError, match=r"leaf 2"):
            snap.assemble(2)
        np.testing.assert_array_equal(snap.assemble(3), np.asarray(leaves[3]))  # (its own)
    finally:
        store.close()


def test_the_store_lets_go_of_what_it_copied(state):
    # (else a step's packs would stay on the devices beside the next step's)
    _, leaves, packed = state
    fresh = Packed([x + 0 for x in packed.arrays], packed.members)
    refs = [weakref.ref(x) for x in fresh.arrays]
    store = _store()
    try:
        _taken(store, 1, leaves, fresh)
        del fresh
        gc.collect()
        assert all(r() is None for r in refs)
    finally:
        store.close()


def test_an_executable_returning_other_packs_than_planned_packs_nothing(caplog):
    compiler = StepCompiler(lambda leaves, batch: (leaves, {}), SPECS,
                            [((8, 6), np.float32)] * len(SPECS), batch_axes=("data",),
                            donate=False, pack=lambda *_: True)
    mesh = h.mesh_of((4, 2))
    planned = compiler.packs_for(mesh)
    assert planned  # (all float32: grouped by axes only)

    class Lowered:  # (one lowered from an export made without packs: a fourth output [])
        out_tree = jax.tree.structure(([1], {}, 1, []))

    assert compiler._pack_members(Lowered(), mesh, (4, 2)) == ()
    assert "returns 0 packs where" in caplog.text


def test_a_leaf_its_axes_do_not_divide_leaves_the_state_unpacked():
    mesh = h.mesh_of((4, 2))
    assert pack_groups([P("data"), P()], [((6,), np.float32), ((3,), np.float32)],
                       mesh) is None
    assert pack_groups([P("data"), P()], [((8,), np.float32), ((3,), np.float32)],
                       mesh) == [(("data",), (0,)), ((), (1,))]


# A resilient step whose state has single-copy shards (snapshots every step by default):
# a lost device's shards come from the host snapshot, read from the packs.

AXES = ("data", "model")


class _ShardedMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(h.DIN, h.DHIDDEN, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("data", "model")))
        self.l2 = nnx.Linear(h.DHIDDEN, h.DOUT, rngs=rngs,
                             kernel_init=nnx.with_partitioning(init, ("model", None)))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _build():
    with nnx.use_eager_sharding(False):
        model = _ShardedMLP(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@pytest.mark.parametrize("pack_copies", [None, False])
def test_lost_shards_come_from_packed_snapshots_exact(pack_copies):
    batches = h.make_batches(5)
    model, optimizer = _build()
    options = h.no_precompile(snapshot=mnemojax.SnapshotOptions(pack_copies=pack_copies))
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2), AXES), options=options,
                              fault_injector=FaultInjector().lose_devices(3, [1]))
    try:
        losses = []
        for b in batches:
            losses.append(float(step(model, optimizer, b)["loss"]))
            step.wait_snapshots()  # (the recovery reads the host snapshot, not a copy in flight)
        snap = step._built.runtime.store.latest()
        (recovery,) = step.statistics.recoveries
    finally:
        step.close()
    assert step.statistics.unreplicated_state
    assert bool(snap.pack_fills) == (pack_copies is None)  # (on CPU by default)
    assert recovery.source != "live_replicas" and recovery.steps_lost <= 1
    want = h.plain_mesh_run(h.train_step, *_build(), batches, h.mesh_of((4, 2), AXES),
                            P("data"))
    h.assert_same_run(h.Run(losses, h.host_state(model, optimizer)), want)


def test_no_packs_where_the_snapshots_would_not_fit_the_budget():
    model, optimizer = _build()
    options = h.no_precompile(snapshot=mnemojax.SnapshotOptions(host_memory_budget_bytes=1000))
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2), AXES), options=options)
    try:
        with pytest.warns(SnapshotBudgetWarning):
            step(model, optimizer, h.make_batches(1)[0])
        assert step._built.exe.pack_members == ()  # (the store takes no snapshot)
    finally:
        step.close()

