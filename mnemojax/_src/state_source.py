"""Where a recovery takes the state from.

1. Just in time, from healthy replicas: every shard of the last completed step that still
   has a copy on a surviving device is read from there. Nothing is lost, no snapshot needed.
2. Shards whose every copy died come from the host snapshot of the *same* step.
3. If some shard has no surviving copy and the snapshot is older (or the live state was
   donated), the whole state comes from the snapshot; the steps since are replayed.

A recovery never mixes steps. The host state is then placed on the new mesh.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence

import jax
import numpy as np

from mnemojax._src.errors import SnapshotCorruptError, StateUnavailableError
from mnemojax._src.snapshot import HostSnapshot, _as_slices, index_key


@dataclasses.dataclass
class HostState:
    """A complete state of one step, and where it came from.

    Attributes:
        leaves: per leaf, the whole array: on the host, or already on the target mesh
            (restored by Orbax).
        source: ``live_replicas``, ``live_replicas+snapshot``, ``host_snapshot`` or
            ``persistent``.
        step: the step it is the state after.
        bytes_read: bytes read to assemble it.
        corrupt_snapshots: snapshots found corrupt on the way (never used).
    """

    leaves: list[np.ndarray | jax.Array]
    source: str
    step: int
    bytes_read: int
    corrupt_snapshots: int = 0


log = logging.getLogger("mnemojax")


class _NeedsRollback(Exception):
    pass


def _from_live(leaves: Sequence[jax.Array | np.ndarray], step: int, dead: Collection[int],
               same_step: Sequence[HostSnapshot], layer, corrupt: list) -> HostState:
    out, read, used_snapshot = [], 0, False
    for i, x in enumerate(leaves):
        if not isinstance(x, jax.Array):  # a host array given to a call: whole already
            out.append(np.asarray(x))
            read += out[-1].nbytes
            continue
        host = np.empty(x.shape, x.dtype)
        by_index: dict = {}
        for shard in x.addressable_shards:
            by_index.setdefault(index_key(shard.index, x.shape), []).append(shard)
        for key, shards in by_index.items():
            block = None
            for shard in shards:
                if shard.device.id in dead:
                    continue
                try:
                    block = layer.fetch(shard)
                    break
                except jax.errors.JaxRuntimeError:
                    continue  # that replica is unreadable too; try the next
            if block is None:
                block = _from_snapshots(same_step, i, key, corrupt)
                used_snapshot = True
            host[_as_slices(key)] = block
            read += block.nbytes
        out.append(host)
    return HostState(out, "live_replicas+snapshot" if used_snapshot else "live_replicas",
                     step, read, len(corrupt))


def _from_snapshots(snapshots: Sequence[HostSnapshot], leaf: int, key,
                    corrupt: list) -> np.ndarray:
    for snap in snapshots:
        if any(snap is c for c in corrupt):
            continue
        try:
            block = snap.shard(leaf, key)
            if block is None:  # laid out for another mesh: cut the shard out of the whole
                block = snap.assemble(leaf)[_as_slices(key)]
            return block
        except SnapshotCorruptError as exc:
            log.warning("mnemojax: %s; never restored", exc)
            corrupt.append(snap)
    raise _NeedsRollback


def gather_given(leaves: Sequence[jax.Array | np.ndarray], step: int, dead: Collection[int],
                 layer) -> HostState:
    """The state given to a call, before it ran, read whole from its live copies (and host
    arrays): it is not what the step last wrote (another step returned it, the caller
    changed it), so no snapshot of the step's holds it.

    Raises:
        StateUnavailableError: a shard of it lost every copy with ``dead``.
    """
    try:
        return _from_live(leaves, step, dead, [], layer, [])
    except _NeedsRollback:
        raise StateUnavailableError(
            f"the state given to step {step + 1} lost a shard with every replica (devices "
            f"{sorted(dead)} died), and it is not the state this step last wrote (another "
            "step returned it, or the caller changed it): no snapshot of this step holds "
            "it. Keep a replica of each shard on another device (a replicated axis), or "
            "give the step state from a checkpoint") from None


def gather_state(leaves: Sequence[jax.Array], step: int, dead: Collection[int],
                 snapshots: Sequence[HostSnapshot], layer, *, live_ok: bool,
                 snapshots_off: str | None = None) -> HostState:
    """The newest complete state on the host, from live replicas and/or snapshots.

    Args:
        leaves: the state arrays after `step` on the old mesh.
        step: the last completed step.
        dead: ids of dead devices (never read).
        snapshots: complete host snapshots, any steps.
        layer: the device layer to read shards through.
        live_ok: False when the live state may have been donated.
        snapshots_off: why no snapshot is taken (the host memory budget), if so.

    Raises:
        StateUnavailableError: no complete copy of any step survives.
        SnapshotCorruptError: a snapshot needed fails its checksum.
    """
    corrupt: list[HostSnapshot] = []
    if live_ok:
        try:
            return _from_live(leaves, step, dead, [s for s in snapshots if s.step == step],
                              layer, corrupt)
        except _NeedsRollback:
            pass
    for snap in sorted(snapshots, key=lambda s: -s.step):
        if any(snap is c for c in corrupt):
            continue
        try:
            return HostState([snap.assemble(i) for i in range(len(snap.leaves))],
                             "host_snapshot", snap.step, snap.nbytes, len(corrupt))
        except SnapshotCorruptError as exc:
            log.warning("mnemojax: %s; never restored", exc)
            corrupt.append(snap)
    live = (f"the live copy of step {step} lost a shard with every replica" if live_ok
            else f"the live state of step {step} was donated to the step that failed")
    held = (f"{len(corrupt)} host snapshot(s) failed their checksums" if corrupt
            else "no host snapshot is complete")
    if snapshots_off is not None and not snapshots:  # (a trial: it said "lower the cadence")
        raise StateUnavailableError(
            f"no complete copy of the state survives: {live}, and no host snapshot is "
            f"taken: {snapshots_off}. Raise SnapshotOptions.host_memory_budget_bytes, or "
            "keep persistent checkpoints (PersistentOptions)", corrupt=0)
    raise StateUnavailableError(
        f"no complete copy of the state survives: {live}, and {held}. Snapshots are "
        "taken of the state the first step starts from, then every SnapshotOptions."
        "every_steps steps (every unreplicated_every_steps where some shard has a single "
        "copy; 0: never): lower the cadence to cover losing every replica of a shard "
        "between two snapshots, or keep persistent checkpoints (PersistentOptions)",
        corrupt=len(corrupt))
