"""JAX-facing half of snapshots: local shards out of arrays, the agreed state onto a mesh.

Each worker snapshots only the shards it owns (``replica_id == 0`` of its addressable
shards), so across all workers every element is stored exactly once, and a replicated leaf
is stored by one worker only: losing that worker means taking it from the buddy copy, or,
with its buddy lost too, from a survivor's replicas, handed to its agent at the failure
(`held_shards`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from mnemojax._src.distributed.snapshot_codec import Box, HostBlocks, ShardEntry, index_of

if TYPE_CHECKING:
    import jax

    from mnemojax._src.distributed.worker.recovery import AgreedCopies
    from mnemojax._src.snapshot import Packed

PutFn: TypeAlias = "Callable[[np.ndarray | HostBlocks, jax.sharding.Sharding], jax.Array]"
"""Places one global host value on devices (`DeviceLayer.put`); in a world of several
processes each process places the pieces its own devices hold (and a `HostBlocks` builds
only those)."""


# (sharding, shape) -> (addressable position, index) of the shards a process owns: worked
# out once per layout, as building an array's `addressable_shards` every publish cost ~15 us
# per leaf of 8 devices (the bench GPT's 92 leaves: more than the copy of its bytes).
_OWNED: dict[tuple, list[tuple[int, tuple[tuple[int, int], ...]]]] = {}
_OWNED_MAX = 4096  # layouts kept (a job sees a few per mesh)


def forget_layouts() -> None:
    """Drops the layouts worked out in a world (`_owned`, `_packed_layout`): a new world's
    devices are new objects, and which process owns a shard is of the world it was worked
    out in (`coordination.detach_worker`)."""
    _OWNED.clear()
    _PACKED.clear()


def _owned(leaf: jax.Array) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    key = (leaf.sharding, tuple(leaf.shape))
    owned = _OWNED.get(key)
    if owned is None:
        if len(_OWNED) >= _OWNED_MAX:
            _OWNED.clear()
        owned = _OWNED[key] = [(i, index_of(s.index, leaf.shape))
                               for i, s in enumerate(leaf.addressable_shards)
                               if s.replica_id == 0]
    return owned


# The layout of packs (`snapshot.Packed`) -> per pack shard this process owns (replica 0),
# (pack, addressable position, its members' (leaf, shape, index, offset, size, shard shape))
# or None where those are not the shards of `local_shards` (then the leaves are read).
_PACKED: dict[tuple, list | None] = {}


def _packed_layout(leaves: Sequence[jax.Array], packed: Packed) -> list | None:
    key = (tuple(map(tuple, packed.members)),
           tuple((a.sharding, tuple(a.shape), a.dtype) for a in packed.arrays),
           tuple((x.sharding, tuple(x.shape)) for x in leaves))
    if key in _PACKED:
        return _PACKED[key]
    from mnemojax._src.snapshot import pack_pieces  # (JAX-heavy: not at this module's load)

    pieces = pack_pieces(leaves, packed)
    layout = None if pieces is None else [
        (p, position, [(leaf, tuple(leaves[leaf].shape), index, offset,
                        int(np.prod(extent)), extent)
                       for leaf, index, offset, extent in members])
        for p, position, _, members in pieces]
    if layout is not None:
        got = sorted((leaf, index) for *_, members in layout
                     for leaf, _, index, *_ in members)
        want = sorted((i, index) for i, x in enumerate(leaves) for _, index in _owned(x))
        if got != want:  # (each element must be published by exactly one process)
            layout = None
    if len(_PACKED) >= _OWNED_MAX:
        _PACKED.clear()
    _PACKED[key] = layout
    return layout


def packed_shards(leaves: Sequence[jax.Array], packed: Packed
                  ) -> tuple[list[ShardEntry], list[memoryview]] | None:
    """`local_shards` read from the packs the step wrote (`snapshot.Packed`): the same
    shards, in the packs' order, as host views of the packs (on CPU views of the device
    buffers), and the packs' bytes as the data to publish (one buffer per pack and device
    instead of one per leaf and device: `snapshot_codec.header_of` of the entries
    describes them). None where the packs do not hold exactly the shards this process
    owns."""
    layout = _packed_layout(leaves, packed)
    if layout is None:
        return None
    entries, data = [], []
    for p, position, pieces in layout:
        host = np.asarray(packed.arrays[p].addressable_data(position)).reshape(-1)
        data.append(host.view(np.uint8).data)
        entries += [ShardEntry(leaf, shape, index,
                               host[offset:offset + size].reshape(extent))
                    for leaf, shape, index, offset, size, extent in pieces]
    return entries, data


def local_shards(leaves: Sequence[jax.Array], *, to_host: bool = True) -> list[ShardEntry]:
    """The shards of ``leaves`` (jax.Arrays) this process owns, as host numpy arrays (on
    CPU views of the device buffers), or with ``to_host=False`` as the single-device
    arrays themselves (`snapshot_codec.data_views` reads them to the host later).

    Encode them (`snapshot_codec.pack`) and publish before the next step may donate or
    delete the leaves.
    """
    entries = []
    for i, leaf in enumerate(leaves):
        shape = tuple(leaf.shape)
        for position, index in _owned(leaf):
            data = leaf.addressable_data(position)
            entries.append(ShardEntry(i, shape, index, np.asarray(data) if to_host else data))
    return entries


def held_shards(leaves: Sequence[jax.Array], *,
                max_bytes: int | None = None) -> list[ShardEntry] | None:
    """The regions of ``leaves`` this process's devices hold that `local_shards` leaves out
    (replicas: ``replica_id != 0``), each once: what it hands its agent as its held copy at
    a peer failure (`session.DistributedSession.hold`).

    Returns:
        The regions as host arrays; None, before anything is copied to the host, when
        they come to more than ``max_bytes``.
    """
    regions = []
    for i, leaf in enumerate(leaves):
        shards = [(index_of(s.index, leaf.shape), s) for s in leaf.addressable_shards]
        seen = {index for index, s in shards if s.replica_id == 0}
        for index, shard in shards:
            if index not in seen:
                seen.add(index)
                regions.append((i, tuple(leaf.shape), index, shard.data))
    if max_bytes is not None and sum(data.nbytes for *_, data in regions) > max_bytes:
        return None
    return [ShardEntry(i, shape, index, np.asarray(data)) for i, shape, index, data in regions]


def restore_leaves(copies: AgreedCopies, shardings: Sequence[jax.sharding.Sharding], *,
                   put: PutFn) -> list[jax.Array]:
    """Builds arrays with ``shardings`` (of the new world) from the agreed copies.

    This process fetches only the regions its own devices hold under ``shardings`` (one
    request per copy that overlaps them, `AgreedCopies.fetch`), and ``put`` builds each
    device's block from those pieces (`snapshot_codec.HostBlocks`): no process receives or
    assembles the whole state unless its devices hold all of it. Pass the device layer's
    ``put``, so a fault injector sees the placement.

    Raises:
        CopiesUnreachableError: a copy's holders died since its header was read.
        StateUnavailableError: the copies are of another state, or leave a region uncovered.
    """
    specs = copies.leaves(len(shardings))
    boxes = [(leaf, index_of(index, shape))
             for leaf, ((shape, _), sharding) in enumerate(zip(specs, shardings, strict=True))
             for index in sharding.addressable_devices_indices_map(shape).values()
             if index is not None]
    return [put(value, sharding)
            for value, sharding in zip(_blocks(copies, specs, boxes), shardings, strict=True)]


def assemble_agreed(copies: AgreedCopies, num_leaves: int) -> list[np.ndarray]:
    """The whole agreed state on this host (every region of every leaf): for the one
    process that checkpoints it when too few survive to hold the model.

    Raises:
        CopiesUnreachableError, StateUnavailableError: as `restore_leaves`.
    """
    specs = copies.leaves(num_leaves)
    whole = [(leaf, tuple((0, n) for n in shape)) for leaf, (shape, _) in enumerate(specs)]
    return [np.asarray(value) for value in _blocks(copies, specs, whole)]


def _blocks(copies: AgreedCopies, specs: Sequence[tuple[tuple[int, ...], np.dtype]],
            boxes: Sequence[Box]) -> list[HostBlocks]:
    """Per leaf, its pieces inside ``boxes`` (each box asked for once)."""
    pieces: dict[int, list[ShardEntry]] = {}
    for piece in copies.fetch(list(dict.fromkeys(boxes))):
        pieces.setdefault(piece.leaf, []).append(piece)
    return [HostBlocks(leaf, shape, dtype, pieces.get(leaf, ()))
            for leaf, (shape, dtype) in enumerate(specs)]
