"""JAX-facing half of snapshots: local shards out of arrays, global state back onto a mesh.

Each worker snapshots only the shards it owns (``replica_id == 0`` of its addressable
shards), so across all workers every element is stored exactly once, and a replicated leaf
is stored by one worker only: losing that worker means taking it from the buddy copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from mnemojax._src.distributed.snapshot_codec import ShardEntry, assemble

if TYPE_CHECKING:
    import jax

PutFn: TypeAlias = "Callable[[np.ndarray, jax.sharding.Sharding], jax.Array]"
"""Places one global host value on devices (`DeviceLayer.put`); in a world of several
processes each process places the pieces its own devices hold."""


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, _ = sl.indices(n)
        out.append((start, stop))
    return tuple(out)


def local_shards(leaves: Sequence[jax.Array]) -> list[ShardEntry]:
    """The shards of ``leaves`` (jax.Arrays) this process owns, as host numpy arrays.

    The arrays are views of device buffers: encode them (`snapshot_codec.pack`) and publish
    before the next step may donate or delete the leaves.
    """
    entries = []
    for i, leaf in enumerate(leaves):
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                entries.append(ShardEntry(i, tuple(leaf.shape), _index(shard.index, leaf.shape),
                                          np.asarray(shard.data)))
    return entries


def restore_leaves(payloads: Sequence[bytes | bytearray],
                   shardings: Sequence[jax.sharding.Sharding], *, put: PutFn) -> list[jax.Array]:
    """Builds arrays with ``shardings`` (of the new world) from the old workers' payloads.

    Every process assembles the global host value (fine for the small states this targets;
    at scale each process would fetch only the slices its devices need) and places it with
    ``put``: pass the device layer's, so a fault injector sees the placement.

    Raises:
        StateUnavailableError: the payloads mix steps or leave an element uncovered.
    """
    full = assemble(payloads, len(shardings))
    return [put(value, sharding) for value, sharding in zip(full, shardings, strict=True)]
