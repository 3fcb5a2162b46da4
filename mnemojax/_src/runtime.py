"""The runtime of a resilient step on one mesh, and the one place that builds it.

A `Runtime` is everything the step needs to run on its current mesh: the device layer (the
interposition point, wrapped by a fault injector when one is given), the `DeviceProxy`
(mesh, dead devices, spares), the `StepCompiler` (executables per mesh, compiled ahead in
the background) and the host snapshot stores. `RuntimeBuilder.build` makes one at start and
after every recovery:

* after a device loss (same process, same backend) the layer, compiler and stores carry
  over (``same_world=``): the executables compiled ahead for the reduced meshes stay valid,
  only the proxy moves to the new mesh;
* after a process loss (a new multi-process world) everything is built anew, since the old
  backend's executables and arrays are gone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from mnemojax._src import sharding as shd
from mnemojax._src.compiler import ExportedSteps, LeftCompiles, StepCompiler, StepFacts
from mnemojax._src.device_layer import DeviceLayer, JaxDeviceLayer
from mnemojax._src.distributed.shm import agent_peak_bytes
from mnemojax._src.options import ResilienceOptions
from mnemojax._src.proxy import DeviceProxy
from mnemojax._src.snapshot import SnapshotStore
from mnemojax._src.topology import MeshPlan

LeafStruct = tuple[tuple[int, ...], Any]  # (shape, dtype) of one state leaf


@dataclasses.dataclass
class Runtime:
    """What one mesh of a resilient step runs on (see module docstring).

    Attributes:
        layer: the device layer every dispatch, transfer and probe goes through.
        proxy: the current mesh, its dead devices and spares; runs and classifies steps.
        compiler: executables of the step per mesh and batch shape.
        store: host snapshots of the state.
        grads_store: host snapshots of the gradients (made on first use).
    """

    layer: DeviceLayer
    proxy: DeviceProxy
    compiler: StepCompiler
    store: SnapshotStore
    grads_store: SnapshotStore | None = None

    @property
    def plan(self) -> MeshPlan:
        return self.proxy.plan

    @property
    def mesh(self) -> Mesh:
        return self.proxy.mesh

    def close(self, *, leave_compiles: bool = False) -> None:
        """Stops the background threads (result waiter, compiler, snapshot copiers);
        ``leave_compiles``: `StepCompiler.close`'s ``leave_running`` (the world ends)."""
        self.proxy.close()
        self.compiler.close(leave_running=leave_compiles)
        self.store.close()
        if self.grads_store is not None:
            self.grads_store.close()


class RuntimeBuilder:
    """Builds the `Runtime` of one step, at start and after every recovery, always alike.

    Args:
        options: the options in force.
        pure: the step as ``pure(leaves, batch) -> (leaves, metrics)``.
        specs: per state leaf, its partition spec.
        leaf_structs: per state leaf, its (shape, dtype).
        leaf_entries: per state leaf, its snapshot entry.
        wrap_layer: wraps the device layer (a fault injector's ``wrap``), or None.
        on_corrupt: called with the step of a snapshot found corrupt when it is retired.
        axis_types: the user's mesh's axis types by name, kept on every mesh built.
        export_steps: keep the step exported per plan compiled ahead (`ExportedSteps`),
            for the worlds that follow a process loss (multi-process jobs).
        publishes: the step's state goes to this worker's agent after every step
            (multi-process jobs; `DistributedSession.publish`).
        leaf_names: per state leaf, its path (for messages).
        traced_as: the user's step function, which JAX's trace errors name (the step is
            traced through mnemojax's wrapper).
    """

    def __init__(self, options: ResilienceOptions, *, pure: Callable,
                 specs: Sequence[PartitionSpec], leaf_structs: Sequence[LeafStruct],
                 leaf_entries: Sequence[str],
                 wrap_layer: Callable[[DeviceLayer], DeviceLayer] | None = None,
                 on_corrupt: Callable[[int], None] | None = None,
                 axis_types: shd.AxisTypes | None = None, export_steps: bool = False,
                 leaf_names: Sequence[str] | None = None, traced_as: Callable | None = None,
                 publishes: bool = False):
        self._options = options
        self._publishes = publishes
        self._traced_as = traced_as  # the user's step, for JAX's trace errors to name
        self._leaf_names = list(leaf_names) if leaf_names is not None else None
        # The candidates of the last two precompiles (the world's and the one before).
        self.exports = ExportedSteps(max(1, 2 * options.compile.max_precompiled)) \
            if export_steps else None
        self.axis_types = dict(axis_types or {})
        self.facts = StepFacts()  # what every world's compiles learned about the step
        self.left_compiles = LeftCompiles()  # what ended worlds left compiling
        self._pure = pure
        self._specs = list(specs)
        self.leaf_structs: list[LeafStruct] = list(leaf_structs)
        self._entries = list(leaf_entries)
        self._wrap_layer = wrap_layer
        self._on_corrupt = on_corrupt

    def build(self, plan: MeshPlan, *, mesh: Mesh | None = None, spares: Sequence[int] = (),
              dead: Collection[int] = (), same_world: Runtime | None = None) -> Runtime:
        """The runtime for `plan`.

        Args:
            plan: the mesh to run on.
            mesh: `plan` as a `jax.sharding.Mesh` (default: made from the plan).
            spares: healthy devices kept out of the mesh, in order of preference.
            dead: devices known dead (never probed or used again).
            same_world: the runtime this one replaces in the same backend: its layer,
                compiler and snapshot stores are kept. None: everything is new.
        """
        mesh = mesh if mesh is not None else shd.mesh_from_plan(plan, self.axis_types)
        opts = self._options
        if same_world is not None:
            same_world.proxy.close()  # replaced below
            layer, compiler = same_world.layer, same_world.compiler
            store, grads_store = same_world.store, same_world.grads_store
        else:
            layer = JaxDeviceLayer()
            if self._wrap_layer is not None:
                layer = self._wrap_layer(layer)
            compiler = StepCompiler(
                self._pure, self._specs, self.leaf_structs, batch_axes=opts.batch_axes,
                donate=opts.compile.donate_state,
                check_state=opts.check_state and opts.nonfinite != "ignore",
                axis_types=self.axis_types, exports=self.exports,
                switch_interval_s=opts.compile.background_switch_interval_s,
                leaf_names=self._leaf_names, facts=self.facts, left=self.left_compiles,
                traced_as=self._traced_as, pack=self._packs_on,
                share_forwarded=opts.snapshot.share_unchanged_leaves and not self._publishes,
                in_child=opts.compile.compile_process,
                child_nice=opts.compile.compile_process_nice)
            store = self.snapshot_store(layer, self._entries)
            if self.facts.forwarded is not None:  # (else after the first trace: `trace_first`)
                store.share(compiler.shared_leaves())
            grads_store = None
        proxy = DeviceProxy(layer, plan, mesh, spares, batch_axes=opts.batch_axes,
                            probe_timeout_s=opts.recovery.probe_timeout_s, dead=dead)
        return Runtime(layer, proxy, compiler, store, grads_store)

    def _packs_on(self, mesh: Mesh, single_copy: bool, state_bytes: int,
                  shared_bytes: int = 0) -> bool:
        """Whether the step writes its state packed for the snapshot's copy on `mesh`
        (`SnapshotOptions.pack_copies`): only where a copy is taken every step (the packs
        are written every step: a publish to the agent after each step across processes,
        in one process a snapshot every step within the host memory budget, over which the
        store takes none, `SnapshotStore.submit`), and by default only on CPU devices."""
        snap = self._options.snapshot
        every = 1 if self._publishes else (
            snap.unreplicated_every_steps if single_copy else snap.every_steps)
        # Over the budget no copy is taken (`DistributedSession.publish` by its agent's peak
        # for a share as large as the whole state, which it may be: one process can own
        # every replicated leaf).
        needs = agent_peak_bytes(state_bytes, state_bytes, in_series=snap.replicate_in_series) \
            if self._publishes else 2 * state_bytes - shared_bytes  # (shared: copied once)
        if every != 1 or snap.pack_copies is False or needs > snap.host_memory_budget_bytes:
            return False
        return snap.pack_copies is True or all(d.platform == "cpu" for d in mesh.devices.flat)

    def snapshot_store(self, layer: DeviceLayer, entries: Sequence[str], *,
                       name: str = "state") -> SnapshotStore:
        """A host snapshot store with the options in force."""
        snap = self._options.snapshot
        return SnapshotStore(layer, entries, name=name, budget_bytes=snap.host_memory_budget_bytes,
                             verify=snap.verify_checksums,
                             on_corrupt=self._on_corrupt if name == "state" else None)
