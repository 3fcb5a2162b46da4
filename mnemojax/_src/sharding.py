"""The one module that turns plans into `jax.sharding` objects and validates annotations."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mnemojax._src.errors import ShardingMismatchError
from mnemojax._src.topology import MeshPlan

log = logging.getLogger("mnemojax")

if TYPE_CHECKING:  # jax.Device is a runtime alias that type checkers cannot use as a type
    from jaxlib._jax import Device


def devices_by_id() -> dict[int, Device]:
    return {d.id: d for d in jax.devices()}


AxisTypes = Mapping[str, jax.sharding.AxisType]


def axis_types_of(mesh: Mesh) -> dict[str, jax.sharding.AxisType]:
    """The user's mesh's axis types by axis name (kept on every mesh derived from it)."""
    return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))


def mesh_from_plan(plan: MeshPlan, axis_types: AxisTypes | None = None) -> Mesh:
    """A mesh over the plan's devices; each axis keeps its type from `axis_types` (by
    name: the user's Auto, Explicit or Manual), `AxisType.Auto` when not given."""
    by_id = devices_by_id()
    devices = np.vectorize(lambda i: by_id[int(i)], otypes=[object])(plan.device_ids)
    types = axis_types or {}
    return Mesh(devices, plan.axis_names, axis_types=tuple(
        types.get(name, jax.sharding.AxisType.Auto) for name in plan.axis_names))


def device_ids(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)


def spec_axes(spec: PartitionSpec) -> list[tuple[int, tuple[str, ...]]]:
    """(dimension, axis names) for every sharded dimension of a spec."""
    out = []
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        out.append((dim, names))
    return out


def explicit_part(spec: PartitionSpec, explicit: Collection[str]) -> PartitionSpec:
    """`spec` over the `explicit` axes only (what `jax.sharding.reshard` takes on a mesh
    whose other axes are Auto)."""
    entries = []
    for entry in spec:
        names = (entry,) if isinstance(entry, str) else \
            tuple(entry) if isinstance(entry, tuple | list) else ()  # (None, UNCONSTRAINED)
        kept = tuple(n for n in names if n in explicit)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def validate_specs(
    specs: Sequence[PartitionSpec],
    shapes: Sequence[tuple[int, ...]],
    paths: Sequence[str],
    mesh_shape: Mapping[str, int],
) -> None:
    """Raises `ShardingMismatchError` naming the leaf if a spec does not fit the mesh."""
    for spec, shape, path in zip(specs, shapes, paths, strict=True):
        if len(spec) > len(shape):
            raise ShardingMismatchError(
                f"{path}: partition spec {spec} has more entries than the array has "
                f"dimensions (shape {shape})"
            )
        for dim, names in spec_axes(spec):
            unknown = [n for n in names if n not in mesh_shape]
            if unknown:
                raise ShardingMismatchError(
                    f"{path}: partition spec {spec} names mesh axis {unknown[0]!r}, but the "
                    f"mesh has axes {tuple(mesh_shape)} (if {unknown[0]!r} is a logical "
                    "name: Flax resolves those only inside nnx.logical_axis_rules(...) or "
                    "with nnx.with_partitioning(..., sharding_rules=...); keep the rules in "
                    "effect around the training loop, or place the model's arrays under "
                    "them, with the mesh set, before the first step)"
                )
            width = int(np.prod([mesh_shape[n] for n in names]))
            if shape[dim] % width:
                raise ShardingMismatchError(
                    f"{path}: dimension {dim} of size {shape[dim]} is sharded over {names} "
                    f"(width {width}), which does not divide it"
                    + (" (an optimizer state of another shape than its parameter, such as "
                       "adafactor's (1,) placeholders, keeps the parameter's sharding "
                       "annotation in Flax: plain nnx.jit fails on it too)"
                       if "opt_state" in path and shape[dim] == 1 else "")
                )


def sharded_dims(specs: Sequence[PartitionSpec], shapes: Sequence[tuple[int, ...]]):
    """Per mesh axis, the sizes of the array dimensions sharded along it (for the planner)."""
    out: dict[str, set[int]] = {}
    for spec, shape in zip(specs, shapes, strict=True):
        for dim, names in spec_axes(spec):
            for n in names:
                out.setdefault(n, set()).add(shape[dim])
    return out


def batch_spec(mesh: Mesh, batch_axes: Sequence[str], ndim: int,
               example_axis: int = 0) -> PartitionSpec:
    """The example dimension (the leading one by default) split over the batch axes the
    mesh has (replicated if none)."""
    axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    if axes and ndim > example_axis:
        return PartitionSpec(*[None] * example_axis, axes[0] if len(axes) == 1 else axes)
    return PartitionSpec()


def named(mesh: Mesh, specs: Sequence[PartitionSpec]) -> list[NamedSharding]:
    return [NamedSharding(mesh, s) for s in specs]


def follow_ambient_mesh(left: Sequence[Mesh], new: Mesh) -> None:
    """Where the caller's ``jax.set_mesh`` names a mesh the step has left (`left`: every
    mesh it ran on, a failed intermediate world's too), it names the new one from now on:
    the state lives there, and JAX refuses eager operations on arrays of another mesh than
    the context's (a metrics ``compute()`` in a training loop run under ``with
    jax.set_mesh(mesh)``). The caller's ``with`` block still restores, at its exit, the
    mesh it had before. Thread-local, as ``jax.set_mesh`` is."""
    ambient = jax.sharding.get_mesh()
    if ambient == new or not any(ambient == m for m in left):
        return
    jax.set_mesh(new)
    log.info("mnemojax: the ambient mesh (jax.set_mesh) follows the step to %s",
             dict(new.shape))
