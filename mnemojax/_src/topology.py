"""Pure topology planning: which devices survive and what the reduced mesh looks like.

Nothing here touches JAX. A mesh is a numpy array of integer device ids plus axis names;
`mnemojax._src.sharding` is the one module that turns a `MeshPlan` into a `jax.sharding.Mesh`.
That keeps the planner testable on fake topologies of hundreds of devices.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from mnemojax._src.errors import DistributedError, InvalidOptionError, MeshTooSmallError

PlanKind = Literal["unchanged", "spare_swap", "drop_replicas", "shrink_model"]
Group = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class AxisGroupChanges:
    """Replica groups (the device sets one collective over this axis spans), old vs new."""

    kept: tuple[Group, ...]
    added: tuple[Group, ...]
    removed: tuple[Group, ...]


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The mesh to continue on.

    Attributes:
        device_ids: integer array of device ids, one entry per mesh position.
        axis_names: the mesh axis names (unchanged by any plan).
        kind: how the plan was made.
        spares_used: reserved spare devices that joined the mesh.
        idle: healthy devices that are not in the new mesh (kept as spares).
        examples_per_step: examples of the global batch the step will use.
        math_changed: True when the plan changes what one step computes.
        groups: per mesh axis, which collective groups were kept, added or removed.
    """

    device_ids: np.ndarray
    axis_names: tuple[str, ...]
    kind: PlanKind
    spares_used: tuple[int, ...] = ()
    idle: tuple[int, ...] = ()
    examples_per_step: int | None = None
    math_changed: bool = False
    groups: Mapping[str, AxisGroupChanges] = dataclasses.field(default_factory=dict)

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.device_ids.shape, strict=True))

    @functools.cached_property
    def key(self) -> tuple:
        """The mesh's hashable identity (shape, axis names and device order)."""
        return (self.axis_names, self.device_ids.shape, tuple(int(i) for i in self.device_ids.flat))

    def changed_group_count(self) -> int:
        return sum(len(c.added) for c in self.groups.values())

    def kept_group_count(self) -> int:
        return sum(len(c.kept) for c in self.groups.values())


@dataclasses.dataclass(frozen=True)
class ShapeRules:
    """What every plan must respect, whatever failed: the keyword arguments of
    `plan_reduced_mesh` that come from the job, not from the failure.

    Attributes:
        data_axis: the mesh axis the batch is split along, or several (None: none).
        sharded_dims: per mesh axis, the sizes of the array dimensions sharded along it.
        batch_size: examples in the global batch (None: not known yet).
        batch_policy: `RecoveryOptions.batch_policy`.
        min_devices: `RecoveryOptions.min_devices`.
        max_model_shrink: the most an axis the state is sharded along may narrow in one
            plan (old width / new width; None: no bound), from
            `RecoveryOptions.model_shrink_headroom` and, in one process, the devices'
            memory.
        fixed_axes: axes no plan narrows (a ``jax.shard_map`` in the step maps over them:
            `RecoveryOptions.shrink_shard_map_axes`).
        refused_shapes: mesh shapes the step could not be compiled for (at a recovery).
    """

    data_axis: str | tuple[str, ...] | None
    sharded_dims: Mapping[str, Collection[int]]
    batch_size: int | None
    batch_policy: str
    min_devices: int
    max_model_shrink: float | None = None
    fixed_axes: tuple[str, ...] = ()
    refused_shapes: tuple[tuple[int, ...], ...] = ()

    def as_kwargs(self) -> dict[str, Any]:
        """The rules as keyword arguments of `plan_reduced_mesh`."""
        return dataclasses.asdict(self)


def collective_groups(device_ids: np.ndarray, axis_names: Sequence[str]) -> dict[str, set[Group]]:
    """The replica groups of each mesh axis: device tuples along that axis."""
    out = {}
    for i, name in enumerate(axis_names):
        rows = np.moveaxis(device_ids, i, -1).reshape(-1, device_ids.shape[i])
        out[name] = {tuple(int(d) for d in row) for row in rows}
    return out


def group_changes(old: np.ndarray, new: np.ndarray, axis_names: Sequence[str]):
    before, after = collective_groups(old, axis_names), collective_groups(new, axis_names)
    return {
        a: AxisGroupChanges(
            kept=tuple(sorted(before[a] & after[a])),
            added=tuple(sorted(after[a] - before[a])),
            removed=tuple(sorted(before[a] - after[a])),
        )
        for a in axis_names
    }


def _widest_dividing(limit: int, sizes: Iterable[int]) -> int:
    """The largest w in [1, limit] dividing every size (0 if limit < 1)."""
    sizes = [s for s in sizes if s]
    for w in range(limit, 0, -1):
        if all(s % w == 0 for s in sizes):
            return w
    return 0


def plan_reduced_mesh(
    device_ids: np.ndarray,
    axis_names: Sequence[str],
    failed: Collection[int],
    *,
    spares: Sequence[int] = (),
    data_axis: str | Sequence[str] | None = "data",
    sharded_dims: Mapping[str, Collection[int]] | None = None,
    batch_size: int | None = None,
    batch_policy: str = "keep_math",
    min_devices: int = 1,
    max_model_shrink: float | None = None,
    fixed_axes: Collection[str] = (),
    refused_shapes: Collection[Sequence[int]] = (),
) -> MeshPlan:
    """Plans the mesh to continue on after `failed` devices died.

    In order of preference:

    1. ``spare_swap``: enough healthy spares: each failed device is replaced in place, the
       mesh keeps its shape and only the groups through the failed devices change.
    2. Otherwise one axis shrinks, whichever keeps the most devices (ties: the batch axes
       first, in order, then the other axes in mesh order). Shrinking axis ``a`` drops
       every slice along ``a`` (the sub-mesh at one index of ``a``) that holds a failed
       device; the healthy devices of dropped slices and the spares form new whole
       slices where they can; the other axes stay whole. The new width is the widest that
       divides every array dimension sharded along ``a`` and, for a batch axis under
       ``keep_math``, the global batch over the other batch axes; extra slices stay idle.
       A batch axis shrinking is ``drop_replicas`` (its slices are data-parallel
       replicas, or FSDP groups whose lost shards come from snapshots); any other axis
       is ``shrink_model``. Every such plan keeps the math (``keep_math``): the same
       global batch and the same parameters, laid out on fewer devices, for code that
       the compiler partitions; a ``jax.shard_map`` over an axis sees its local shapes
       and ``axis_size`` change, so the ``fixed_axes`` (those a step maps over) never
       shrink.
    3. When no single axis can shrink onto the healthy devices (deaths in slices of every
       axis), every axis narrows at once (`_narrow_every_axis`), with the same rules.

    Args:
        device_ids: integer array of device ids, the current mesh.
        axis_names: its axis names.
        failed: ids of dead devices (ids outside the mesh and spares are ignored).
        spares: reserved healthy devices, in order of preference.
        data_axis: the batch axis, or several (the batch is split over their product:
            ``("data", "fsdp")``), or None.
        sharded_dims: per axis name, the sizes of the array dimensions sharded along it.
        batch_size: examples in the global batch (split along the batch axes).
        batch_policy: ``"keep_math"`` or ``"truncate_batch"`` (see `RecoveryOptions`).
        min_devices: the plan must keep at least this many devices.
        max_model_shrink: an axis that some array dimension is sharded along (a model
            axis, an FSDP axis) may narrow from width W to w only where W / w is at most
            this (each device then holds W / w times its share of what is sharded along
            it); None: no bound. Relative to this mesh: repeated recoveries compound.
        fixed_axes: axes that keep their width in every plan (a ``jax.shard_map`` in the
            step maps over them: its body's local shapes and ``axis_size`` would change).
        refused_shapes: mesh shapes no plan takes (the step could not be compiled for
            them): the next widest width is taken instead.

    Returns:
        The plan; ``kind == "unchanged"`` if no failed device is in the mesh.

    Raises:
        MeshTooSmallError: too few healthy devices for any valid mesh.
        InvalidOptionError: inconsistent arguments.
    """
    device_ids = np.asarray(device_ids, dtype=np.int64)
    axis_names = tuple(axis_names)
    if device_ids.ndim != len(axis_names):
        raise InvalidOptionError(
            f"axis_names={axis_names!r} do not match a mesh of shape {device_ids.shape}"
        )
    named = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis or ())
    batch_axes = tuple(a for a in named if a in axis_names)
    if batch_policy not in ("keep_math", "truncate_batch"):
        raise InvalidOptionError(
            f"batch_policy={batch_policy!r} is invalid: expected 'keep_math' or 'truncate_batch'"
        )
    sharded_dims = {a: tuple(sharded_dims.get(a, ())) for a in axis_names} if sharded_dims else {
        a: () for a in axis_names
    }
    failed = {int(f) for f in failed}
    in_mesh = [int(d) for d in device_ids.flat]
    failed_in_mesh = [d for d in in_mesh if d in failed]
    healthy_spares = [int(s) for s in spares if int(s) not in failed and int(s) not in in_mesh]

    def finish(new_ids, kind, *, used=(), examples=batch_size, math_changed=False):
        new_ids = np.asarray(new_ids, dtype=np.int64)
        chosen = {int(d) for d in new_ids.flat}
        idle = tuple(d for d in in_mesh + healthy_spares if d not in failed and d not in chosen)
        if new_ids.size < min_devices:
            raise MeshTooSmallError(
                f"the reduced mesh would have {new_ids.size} devices, fewer than "
                f"min_devices={min_devices}",
                healthy_devices=new_ids.size + len(idle),
                required=min_devices,
            )
        return MeshPlan(
            device_ids=new_ids,
            axis_names=axis_names,
            kind=kind,
            spares_used=tuple(d for d in healthy_spares if d in chosen),
            idle=idle,
            examples_per_step=examples,
            math_changed=math_changed,
            groups=group_changes(device_ids, new_ids, axis_names)
            if new_ids.ndim == device_ids.ndim
            else {},
        )

    if not failed_in_mesh:
        return finish(device_ids.copy(), "unchanged")

    if len(healthy_spares) >= len(failed_in_mesh):
        replacement = iter(healthy_spares)
        swapped = device_ids.copy()
        for pos, dev in np.ndenumerate(device_ids):
            if int(dev) in failed:
                swapped[pos] = next(replacement)
        return finish(swapped, "spare_swap")

    fixed = tuple(a for a in axis_names if a in set(fixed_axes))
    refused = {tuple(int(n) for n in shape) for shape in refused_shapes}
    order = list(batch_axes) + [a for a in axis_names if a not in batch_axes]
    best, too_full = None, []
    for axis in order:
        if axis in fixed:
            continue
        plan = _shrink_axis(device_ids, axis_names, failed, healthy_spares, axis, batch_axes,
                            sharded_dims, batch_size, batch_policy, refused)
        if plan is not None and sharded_dims.get(axis) and max_model_shrink is not None:
            d = axis_names.index(axis)
            factor = device_ids.shape[d] / plan[0].shape[d]
            if factor > max_model_shrink * (1 + 1e-9):
                too_full.append(f"{axis!r} {device_ids.shape[d]} -> {plan[0].shape[d]} "
                                f"(x{factor:.3g} per device)")
                continue
        if plan is not None and (best is None or plan[0].size > best[1].size):
            best = (axis, *plan)
    healthy = len(in_mesh) - len(failed_in_mesh) + len(healthy_spares)
    if best is None and (collapsed := _narrow_every_axis(
            device_ids, axis_names, failed, healthy_spares, batch_axes, sharded_dims,
            batch_size, max_model_shrink, fixed, refused)) is not None:
        narrowed_sharded = any(
            sharded_dims.get(a) and w < n for a, w, n in
            zip(axis_names, collapsed.shape, device_ids.shape, strict=True))
        return finish(collapsed, "shrink_model" if narrowed_sharded else "drop_replicas")
    if best is None:
        mesh = dict(zip(axis_names, device_ids.shape, strict=True))
        kept = (f"; {'axes' if len(fixed) > 1 else 'axis'} "
                f"{', '.join(repr(a) for a in fixed)} kept whole (a jax.shard_map in the "
                "step maps over it: RecoveryOptions.shrink_shard_map_axes)" if fixed else "")
        if too_full:
            raise MeshTooSmallError(
                f"no axis of the mesh {mesh} can shrink onto the {healthy} healthy devices: "
                f"{', '.join(too_full)} would exceed max_model_shrink={max_model_shrink:g} "
                "(RecoveryOptions.model_shrink_headroom, or in one process the devices' "
                f"memory), and no other axis fits{kept}",
                healthy_devices=healthy, required=math.prod(device_ids.shape))
        raise MeshTooSmallError(
            f"no axis of the mesh {mesh} can shrink onto the {healthy} healthy devices (each "
            "width must divide the array dimensions sharded along it and, for a batch "
            f"axis, the global batch){kept}",
            healthy_devices=healthy, required=math.prod(device_ids.shape))
    axis, new_ids, examples, math_changed = best
    return finish(new_ids, "drop_replicas" if axis in batch_axes else "shrink_model",
                  examples=examples, math_changed=math_changed)


def _narrow_every_axis(device_ids, axis_names, failed, healthy_spares, batch_axes,
                       sharded_dims, batch_size, max_model_shrink, fixed=(), refused=()
                       ) -> np.ndarray | None:
    """The mesh when no single axis can shrink onto the healthy devices (deaths in slices
    of every axis: on a (2, 2) mesh, three of four devices): every axis narrowed at once,
    to the shape with the most devices whose widths divide the dimensions sharded along
    them (and the global batch, over the batch axes: the math is kept) and respect
    ``max_model_shrink``, the ``fixed`` axes whole, no ``refused`` shape; ties keep the
    non-batch axes wider.
    The healthy devices fill it in mesh order, then the spares. None when no such shape
    fits (not even all ones)."""
    healthy = [int(d) for d in device_ids.flat if int(d) not in failed] + list(healthy_spares)
    widths = []
    for axis, n in zip(axis_names, device_ids.shape, strict=True):
        dims = [d for d in sharded_dims.get(axis, ()) if d]
        ok = [w for w in range(1, n + 1) if all(d % w == 0 for d in dims)]
        if dims and max_model_shrink is not None:
            ok = [w for w in ok if n / w <= max_model_shrink * (1 + 1e-9)]
        widths.append([n] if axis in fixed else ok)
    best: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    for shape in itertools.product(*widths):
        size = math.prod(shape)
        along_batch = math.prod(w for a, w in zip(axis_names, shape, strict=True)
                                if a in batch_axes)
        if (size > len(healthy) or (batch_size is not None and batch_size % along_batch)
                or tuple(shape) in refused):
            continue
        rank = (size, *(w for a, w in zip(axis_names, shape, strict=True)
                        if a not in batch_axes))
        if best is None or rank > best[0]:
            best = (rank, shape)
    if best is None:
        return None
    shape = best[1]
    return np.array(healthy[:math.prod(shape)], dtype=np.int64).reshape(shape)


def _shrink_axis(device_ids, axis_names, failed, healthy_spares, axis, batch_axes,
                 sharded_dims, batch_size, batch_policy, refused: Collection = ()):
    """(new ids, examples per step, math changed) with `axis` shrunk, or None (no width
    fits; widths giving a ``refused`` shape are passed over)."""
    d = axis_names.index(axis)

    def widest(limit: int, sizes) -> int:
        w = _widest_dividing(limit, sizes)
        while w and (*device_ids.shape[:d], w, *device_ids.shape[d + 1:]) in refused:
            w = _widest_dividing(w - 1, sizes)
        return w

    slices = np.moveaxis(device_ids, d, 0)
    slice_shape = slices.shape[1:]
    survivors = [s for s in slices if not any(int(x) in failed for x in s.flat)]
    # Healthy devices of dropped slices, then spares, regrouped into whole new slices.
    pool = [int(x) for s in slices if any(int(y) in failed for y in s.flat)
            for x in s.flat if int(x) not in failed] + list(healthy_spares)
    size = math.prod(slice_shape)
    fresh = [np.array(pool[i:i + size]).reshape(slice_shape)
             for i in range(0, len(pool) - size + 1, size)]
    candidates = survivors + fresh
    dims = tuple(sharded_dims.get(axis, ()))
    examples, math_changed = batch_size, False
    width = widest(len(candidates), dims)
    if batch_size is not None:
        # The batch axes other than `axis` keep their widths: the batch is split over
        # their product, times the new width when `axis` is one of them.
        other = math.prod(n for a, n in zip(axis_names, device_ids.shape, strict=True)
                          if a in batch_axes and a != axis)
        along = axis in batch_axes
        if batch_policy == "keep_math":
            if batch_size % other:
                width = 0
            elif along:
                width = widest(len(candidates), (batch_size // other, *dims))
        elif width:
            split = other * (width if along else 1)
            examples = batch_size // split * split
            math_changed = examples != batch_size
    if width == 0:
        return None
    return np.moveaxis(np.stack(candidates[:width]), 0, d), examples, math_changed


def aligned_with(plan: MeshPlan, old_ids: np.ndarray, others: Iterable[MeshPlan]) -> MeshPlan:
    """`plan` laid out as the first of `others` (the meshes the other steps of this process
    run on) that has its axis names, its shape and its devices in another order; else
    `plan` unchanged.

    A plan depends on the mesh it starts from, so two steps that met the same deaths in
    other batches (one at a time: a drop, then a spare swap; both at once: a drop) pick
    the same devices in other orders, and every array one returns to the other is
    resharded at every call (trial 47: a GAN's pure steps, x4 per iteration). The order
    changes no width: the plan stays valid under the step's rules.

    Args:
        plan: this step's plan (`plan_reduced_mesh`).
        old_ids: the mesh it replaces (its group changes are recomputed against it).
        others: the other steps' current plans.
    """
    chosen = sorted(int(d) for d in plan.device_ids.flat)
    for other in others:
        ids = np.asarray(other.device_ids, dtype=np.int64)
        if (other.axis_names == plan.axis_names and ids.shape == plan.device_ids.shape
                and sorted(int(d) for d in ids.flat) == chosen
                and not np.array_equal(ids, plan.device_ids)):
            return dataclasses.replace(plan, device_ids=ids.copy(), groups=group_changes(
                np.asarray(old_ids, dtype=np.int64), ids, plan.axis_names))
    return plan


def single_failure_plans(device_ids: np.ndarray, axis_names: Sequence[str], **kwargs) -> list[MeshPlan]:
    """The distinct plans that the loss of any one device of the mesh would produce.

    Used to compile fallback executables ahead of time. Plans that raise are skipped.
    """
    return _distinct_plans(
        lambda dev: plan_reduced_mesh(device_ids, axis_names, {int(dev)}, **kwargs),
        np.asarray(device_ids).flat)


def _distinct_plans(plan_for: Callable[[Any], MeshPlan], cases: Iterable[Any]
                    ) -> list[MeshPlan]:
    """The distinct plans of `cases` in order; a case with no plan (too small) is skipped."""
    seen, plans = set(), []
    for case in cases:
        try:
            plan = plan_for(case)
        except MeshTooSmallError:
            continue
        if plan.key not in seen:
            seen.add(plan.key)
            plans.append(plan)
    return plans


Place = tuple[int, int]  # (process index, rank among that process's devices)
MAX_VICTIMS = 8  # process losses `process_loss_plans` plans for


def renumber_devices(
    places: Mapping[int, Place],
    previous_members: Sequence[int],
    survivors: Sequence[int],
    new_devices: Mapping[int, Sequence[int]],
) -> dict[int, int]:
    """Where each device of the old world is in a new multi-process world.

    A new world renumbers processes (survivors in old rank order become ranks 0..n-1) and
    with them the device ids. A surviving process keeps its devices, in the same order.

    Args:
        places: old device id -> (old process index, rank among its process's devices).
        previous_members: the old world's worker ids, by old process index.
        survivors: the new world's worker ids, by new process index.
        new_devices: new process index -> its device ids in the new world.

    Returns:
        Old device id -> new device id, for the devices of surviving processes.

    Raises:
        DistributedError: a surviving process has fewer devices than before.
    """
    rank_of = {worker: rank for rank, worker in enumerate(survivors)}
    out = {}
    for old_id, (process, rank) in places.items():
        new_process = rank_of.get(previous_members[process])
        if new_process is None:
            continue
        ids = sorted(new_devices.get(new_process, ()))
        if rank >= len(ids):
            raise DistributedError(
                f"process {new_process} of the new world has {len(ids)} devices; device "
                f"{old_id} was its device {rank} in the old world")
        out[int(old_id)] = int(ids[rank])
    return out


def process_loss_plans(device_ids: np.ndarray, axis_names: Sequence[str],
                       places: Mapping[int, Place], rules: ShapeRules) -> list[MeshPlan]:
    """The distinct plans of the worlds that the loss of any one process would form, in
    the device ids those worlds will have: used to compile them ahead, in this world.

    A new world numbers its survivors 0..n-2 in their old order, and JAX's CPU client
    numbers a process's devices by its index and local rank alone (measured on jaxlib
    0.10: ``2048 * index + rank``, the same in every world), so survivor ``i`` gets the
    ids that this world's process ``i`` has. Every plan is therefore over devices of this
    world's processes 0..n-2 and can be compiled here. Processes with unequal device
    counts: no plan (the ids would not carry over).

    Args:
        device_ids: the current mesh.
        axis_names: its axis names.
        places: device id -> (process index, rank among its devices), for every device of
            the world (`proxy.Proxy.device_places`).
        rules: the job's planning rules.
    """
    by_process: dict[int, list[int]] = {}
    for dev, (process, _) in sorted(places.items(), key=lambda kv: kv[1]):
        by_process.setdefault(process, []).append(dev)
    processes = sorted(by_process)
    if len(processes) < 2 or len({len(ids) for ids in by_process.values()}) != 1:
        return []
    new_devices = {i: by_process[processes[i]] for i in range(len(processes) - 1)}

    def plan_without(victim: int) -> MeshPlan:
        survivors = [p for p in processes if p != victim]
        renumbering = renumber_devices(places, processes, survivors, new_devices)
        return plan_after_process_loss(device_ids, axis_names, renumbering, rules)

    # Victims spread over the world (the plan is the same for every victim in the usual
    # layouts): planning all of them would cost O(processes x devices) on the training
    # thread at thousands of processes; a layout missed here is only a compile later.
    picks = sorted({processes[round(i * (len(processes) - 1) / (MAX_VICTIMS - 1))]
                    for i in range(MAX_VICTIMS)})
    return _distinct_plans(plan_without, picks)


def plans_ahead(device_ids: np.ndarray, axis_names: Sequence[str],
                places: Mapping[int, Place], rules: ShapeRules, *,
                losses: int = 1) -> tuple[list[MeshPlan], list[MeshPlan]]:
    """What a world compiles ahead across processes, in that order: the worlds the loss of
    any one process forms (`process_loss_plans`), and (else empty), with ``losses=2``,
    those that a second loss forms from each, distinct and not among the first
    (`CompileOptions.ahead_losses`). Both are over devices of this
    world's processes (the first n-1, the first n-2) with the ids they will have: a
    second death soon after the first (during its recovery, or before the new world has
    compiled its own candidates) then finds its world's step compiled too. A first-level
    world that leaves a process idle is not followed (its survivors would be numbered
    otherwise)."""
    first = process_loss_plans(device_ids, axis_names, places, rules)
    if losses < 2:
        return first, []

    def after(plan: MeshPlan) -> list[MeshPlan]:
        processes = {places[int(d)][0] for d in plan.device_ids.flat}
        inner = {d: place for d, place in places.items() if place[0] in processes}
        return process_loss_plans(plan.device_ids, axis_names, inner, rules)

    known = {plan.key for plan in first}
    second = _distinct_plans(lambda plan: plan, (nxt for plan in first if not plan.idle
                                                 for nxt in after(plan)))
    return first, [plan for plan in second if plan.key not in known]


def plan_after_process_loss(
    device_ids: np.ndarray,
    axis_names: Sequence[str],
    renumbering: Mapping[int, int],
    rules: ShapeRules,
    *,
    spares: Sequence[int] = (),
) -> MeshPlan:
    """Plans the mesh of a new multi-process world after processes died.

    The devices of lost processes are the failed devices, and `plan_reduced_mesh` plans as
    for a device loss, with the same `rules`: the axis that keeps the most devices
    shrinks (ties: the batch axes), so a model axis shrinks where that keeps more devices
    than dropping data-parallel replicas, e.g. when no whole replica survives. A process
    the plan gives no device leaves the job (`recovery.ProcessRecovery`). The plan
    is then renumbered into the new world's device ids; its group changes stay in the old
    world's ids (which collectives lost a member).

    Args:
        device_ids: the old mesh, in old device ids.
        axis_names: its axis names.
        renumbering: old device id -> new device id for every surviving device
            (`renumber_devices`); a mesh device missing from it is lost.
        rules: the job's planning rules.
        spares: old ids of surviving devices outside the mesh, in order of preference.

    Raises:
        MeshTooSmallError: no mesh fits the survivors' devices, or fewer than
            ``min_devices``.
    """
    device_ids = np.asarray(device_ids, dtype=np.int64)
    failed = {int(d) for d in device_ids.flat if int(d) not in renumbering}
    live_spares = [int(s) for s in spares if int(s) in renumbering]
    plan = plan_reduced_mesh(device_ids, axis_names, failed, spares=live_spares,
                             **rules.as_kwargs())
    new_ids = np.vectorize(lambda i: renumbering[int(i)], otypes=[np.int64])(plan.device_ids)
    return dataclasses.replace(
        plan, device_ids=new_ids,
        spares_used=tuple(renumbering[i] for i in plan.spares_used),
        idle=tuple(renumbering[i] for i in plan.idle if i in renumbering))
