"""RuntimeBuilder: one builder at start, after a device loss (same world) and a new world."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax._src import sharding as shd
from mnemojax._src.runtime import RuntimeBuilder
from mnemojax._src.topology import MeshPlan, plan_reduced_mesh
from mnemojax.testing import FaultInjector
from tests import helpers as h


def _builder(options=None, injector=None, corrupt=None):
    return RuntimeBuilder(
        options or h.no_precompile(), pure=lambda leaves, batch: (leaves, {}),
        specs=[P("data"), P()], leaf_structs=[((8, 2), jnp.float32), ((), jnp.int32)],
        leaf_entries=["params", "other"],
        wrap_layer=injector.wrap if injector is not None else None, on_corrupt=corrupt)


def _start_plan():
    mesh = h.mesh_of((4, 2))
    return MeshPlan(shd.device_ids(mesh), ("data", "model"), "unchanged"), mesh


def test_fresh_runtime_is_wired_with_the_options():
    injector = FaultInjector()
    opts = h.no_precompile(snapshot=mnemojax.SnapshotOptions(verify_checksums=False))
    builder = _builder(opts, injector)
    plan, mesh = _start_plan()
    rt = builder.build(plan, mesh=mesh, spares=[9, 3], dead=[9])
    try:
        assert rt.mesh is mesh and rt.plan is plan
        assert rt.proxy.spares == [3] and rt.proxy.dead == {9}
        assert type(rt.layer).__module__.endswith("fault_injection")  # wrapped
        assert rt.compiler.leaf_structs == builder.leaf_structs
        assert rt.store._verify is False and rt.grads_store is None
        grads = builder.snapshot_store(rt.layer, ["grads"], name="grads")
        assert grads._verify is False
        grads.close()
    finally:
        rt.close()


def test_same_world_keeps_layer_compiler_and_stores():
    builder = _builder()
    plan, mesh = _start_plan()
    rt = builder.build(plan, mesh=mesh)
    reduced = plan_reduced_mesh(plan.device_ids, plan.axis_names, {5}, data_axis="data")
    try:
        again = builder.build(reduced, spares=rt.proxy.spares_after(reduced), dead={5},
                              same_world=rt)
        assert again.layer is rt.layer and again.compiler is rt.compiler
        assert again.store is rt.store
        assert again.proxy is not rt.proxy and again.proxy.dead == {5}
        assert set(again.proxy.spares) == {4}  # the healthy partner of the dead device
        assert np.array_equal(shd.device_ids(again.mesh), reduced.device_ids)
        fresh = builder.build(reduced)
        assert fresh.compiler is not rt.compiler and fresh.store is not rt.store
        fresh.close()
    finally:
        rt.close()


def test_the_step_packs_its_state_only_where_a_copy_is_taken_every_step():
    # (`SnapshotOptions.pack_copies`: the packs are written at every step)
    mesh = h.mesh_of((4, 2))

    def packs(publishes=False, **snapshot):
        options = h.no_precompile(snapshot=mnemojax.SnapshotOptions(**snapshot))
        builder = RuntimeBuilder(options, pure=lambda leaves, batch: (leaves, {}),
                                 specs=[P("data")], leaf_structs=[((8, 2), jnp.float32)],
                                 leaf_entries=["params"], publishes=publishes)
        return builder._packs_on(mesh, False, 64), builder._packs_on(mesh, True, 64)

    # One process: replicated state at its cadence, single-copy shards every step.
    assert packs() == (False, True)
    assert packs(every_steps=1) == (True, True)
    assert packs(pack_copies=False) == (False, False)
    assert packs(host_memory_budget_bytes=127) == (False, False)  # (2 copies of 64 bytes)
    # Across processes a copy goes to the agent after every step, within its budget
    # (the agent's peak for a share as large as the state).
    assert packs(publishes=True, every_steps=0, unreplicated_every_steps=0) == (True, True)
    assert packs(publishes=True, host_memory_budget_bytes=1000) == (False, False)
