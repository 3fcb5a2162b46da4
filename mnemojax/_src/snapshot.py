"""Host-memory snapshots of the sharded training state.

After a good step the runtime hands the step's output arrays to a `SnapshotStore`; a
background thread copies them into preallocated host buffers while the next step runs.

* Only addressable shards are copied, and of replicated shards only replica 0 (dedup).
* Two buffers: the copy in flight never overwrites the last complete snapshot; a snapshot
  becomes visible only once every shard is copied and checksummed.
* Requests that arrive while a copy is in flight do not queue up: the newest replaces the
  waiting one (the step never stalls on a snapshot).
* Buffers are allocated once and reused: fresh memory is slow to touch on some VMs.
* Checksums are CRC32C (`mnemojax._src.checksum`), one per shard; a snapshot whose
  checksum fails is never restored.

Per shard the copy thread makes one device read and one checksum (the layout and the
buffers to fill are worked out once per mesh); the retired slot's checksums are checked in
the same pass, just before each buffer is overwritten. On CPU what remains is not the bytes
(a memcpy and a CRC32C of a whole snapshot cost ~0.5 ms) but JAX building the per-device
arrays of each fresh output the first time one is read (~7 us per device buffer).

A `Packed` submit removes most of that: the compiled step also wrote the state packed, each
device's shards of the leaves sharded over the same mesh axes (and of one dtype) side by
side in one flat array (`compiler.StepCompiler`), so the thread reads one buffer per pack and
device instead of one per leaf and device. Each leaf's shard is then a view into its pack's
host buffer, checksummed on its own as before: what a snapshot holds, and how it is read and
verified, does not change. (Across processes the publish to the agent reads the same packs:
`state_transfer.packed_shards`.) A leaf in no pack is read per shard, as without packs.

Shared leaves (`SnapshotStore.share`: leaves the step returns as given, a frozen base) are
the exception to "each slot its own buffers": both slots hold one host copy while the leaf
keeps its value, checked against its checksums at each snapshot that reuses it. A new
value is read into the slot's own older copy where the complete slot does not hold it,
else into new buffers (at most two copies; one where the budget has no room for two: the
older snapshot is given up first).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import numpy as np

from mnemojax._src import checksum as checksums
from mnemojax._src.device_layer import DeviceLayer
from mnemojax._src.errors import SnapshotBudgetWarning as SnapshotBudgetWarning
from mnemojax._src.errors import SnapshotCorruptError, StateUnavailableError

log = logging.getLogger("mnemojax")

IndexKey = tuple[tuple[int, int], ...]
# (addressable position, index key, device id) of each shard a snapshot copies.
LeafLayout = list[tuple[int, IndexKey, int]]


def index_key(index: tuple[slice, ...], shape: Sequence[int]) -> IndexKey:
    """A hashable form of a shard's index into its global array."""
    return tuple((s.start or 0, dim if s.stop is None else s.stop)
                 for s, dim in zip(index, shape, strict=True))


def _as_slices(key: IndexKey) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in key)


# What the copy thread walks, one entry per shard, so that it does no lookups per shard:
# (leaf, addressable position, device id, index key, host buffer, the leaf's checksums).
Fill = tuple[int, int, int, IndexKey, np.ndarray, dict[IndexKey, int]]
# A packed snapshot's: (pack, addressable position, device id, the pack shard's host
# buffer, the `Fill`s of the leaf shards it holds, views into that buffer).
PackFill = tuple[int, int, int, np.ndarray, list[Fill]]


@dataclasses.dataclass(frozen=True)
class Packed:
    """The state of a step also packed by the compiled step (module docstring).

    Attributes:
        arrays: one array per pack, shaped (the sizes of its mesh axes..., -1): on each
            device, the device's shards of its member leaves, flattened and side by side.
        members: per pack, the state leaves it holds, in their order in the pack (not
            every leaf: never a shared one, `SnapshotStore.share`).
    """

    arrays: Sequence[jax.Array]
    members: Sequence[Sequence[int]]


# Per replica-0 shard of a pack: (pack, addressable position, device, its members' pieces:
# (leaf, index key, offset into the flat shard, the leaf shard's shape)).
PackPieces = list[tuple[int, int, Any, list[tuple[int, IndexKey, int, tuple[int, ...]]]]]


def pack_pieces(leaves: Sequence[jax.Array], packed: Packed) -> PackPieces | None:
    """Where each leaf's shards lie in ``packed``'s replica-0 shards: on a device, a pack
    holds that device's shard of each member, in the members' order. None where the
    members' shards do not fill a pack shard (the members do not describe the packs)."""
    indices = [x.sharding.devices_indices_map(tuple(x.shape)) for x in leaves]
    out: PackPieces = []
    for p, (pack, members) in enumerate(zip(packed.arrays, packed.members, strict=True)):
        size = int(np.prod(pack.sharding.shard_shape(tuple(pack.shape))))
        for position, shard in enumerate(pack.addressable_shards):
            if shard.replica_id != 0:
                continue
            pieces, offset = [], 0
            for leaf in members:
                key = index_key(indices[leaf][shard.device], leaves[leaf].shape)
                extent = tuple(b - a for a, b in key)
                pieces.append((leaf, key, offset, extent))
                offset += int(np.prod(extent))
            if offset != size:
                return None
            out.append((p, position, shard.device, pieces))
    return out


@dataclasses.dataclass
class LeafCopy:
    """The host copy of one leaf's shards.

    Attributes:
        shards: index key -> host buffer of the shard.
        crcs: index key -> the buffer's checksum (`checksum.checksum`) when it was copied.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    entry: str
    shards: dict[IndexKey, np.ndarray]
    crcs: dict[IndexKey, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)  # (compared by identity: its fields hold numpy arrays)
class HostSnapshot:
    """A complete, checksummed host copy of the state after `step`."""

    step: int
    leaves: list[LeafCopy]
    verify: bool = True
    corrupt: bool = False  # a checksum failed (and was reported)
    # What the slot's buffers were laid out for (`SnapshotStore._slot_key`): a slot with
    # the same key is filled in place.
    key: tuple = ()
    # Every shard buffer of the leaves the slot copies itself (checked before reuse), and
    # of those the ones read per shard; the rest are views into the pack buffers.
    fills: list[Fill] = dataclasses.field(default_factory=list, repr=False)
    leaf_fills: list[Fill] = dataclasses.field(default_factory=list, repr=False)
    # A packed snapshot (`Packed`): the pack buffers to fill.
    pack_fills: list[PackFill] = dataclasses.field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for leaf in self.leaves for b in leaf.shards.values())

    def nbytes_by_entry(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for leaf in self.leaves:
            out[leaf.entry] = out.get(leaf.entry, 0) + sum(b.nbytes for b in leaf.shards.values())
        return out

    def shard(self, leaf: int, key: IndexKey) -> np.ndarray | None:
        """The verified host copy of one shard, or None if this snapshot lacks it."""
        copy = self.leaves[leaf]
        buf = copy.shards.get(key)
        if buf is None:
            return None
        return self._verified(leaf, key, buf)

    def _verified(self, leaf: int, key: IndexKey, buf: np.ndarray) -> np.ndarray:
        if self.verify and checksums.checksum(buf) != self.leaves[leaf].crcs[key]:
            self.corrupt = True
            raise SnapshotCorruptError(
                f"snapshot of step {self.step}: leaf {leaf} shard {key} fails its "
                f"{checksums.NAME} check")
        return buf

    def assemble(self, leaf: int) -> np.ndarray:
        """The whole global array of one leaf, from the verified shards."""
        copy = self.leaves[leaf]
        out = np.empty(copy.shape, copy.dtype)
        covered = 0
        for key, buf in copy.shards.items():
            block = self._verified(leaf, key, buf)
            out[_as_slices(key)] = block
            covered += block.size
        if covered < out.size:
            raise StateUnavailableError(
                f"snapshot of step {self.step} covers {covered} of {out.size} elements of "
                f"leaf {leaf}")
        return out


def _leaf_layout(x: jax.Array) -> LeafLayout:
    """(addressable position, index key, device id) of the shards to copy: replica 0 only."""
    return [(i, index_key(s.index, x.shape), s.device.id)
            for i, s in enumerate(x.addressable_shards) if s.replica_id == 0]


def _keys(layout: LeafLayout) -> tuple[IndexKey, ...]:
    """Where a layout's shards lie in the global array (what a host copy holds, whatever
    the devices)."""
    return tuple(k for _, k, _ in layout)


def _fits(copy: LeafCopy, x: jax.Array, layout: LeafLayout) -> bool:
    """Whether `copy`'s buffers hold `x`'s replica-0 shards (`layout`)."""
    return (copy.shape == tuple(x.shape) and copy.dtype == np.dtype(x.dtype)
            and set(copy.shards) == {k for _, k, _ in layout})


def has_single_copy_shards(leaves: Sequence[jax.Array]) -> bool:
    """True if some shard of some leaf is held by one device only (no live replica)."""
    seen: set[tuple[Any, tuple[int, ...]]] = set()
    for x in leaves:
        k = (x.sharding, x.shape)
        if k in seen:
            continue
        seen.add(k)
        keys = [index_key(s.index, x.shape) for s in x.addressable_shards]
        if any(keys.count(key) == 1 for key in set(keys)):
            return True
    return False


class SnapshotStore:
    """Double-buffered asynchronous host snapshots (see module docstring)."""

    def __init__(self, layer: DeviceLayer, entries: Sequence[str], *, budget_bytes: int,
                 verify: bool = True, name: str = "state",
                 on_corrupt: Callable[[int], object] | None = None):
        self._layer = layer
        self._entries = list(entries)
        self._budget = budget_bytes
        self._verify = verify
        self._name = name
        self._cv = threading.Condition()
        self._pending: tuple[int, list[jax.Array], Packed | None, tuple[int, ...]] | None = None
        self._busy = False
        self._slots: list[HostSnapshot | None] = [None, None]
        self._complete: int | None = None
        self._intact = [False, False]  # slot holds a finished copy not being overwritten
        self._thread: threading.Thread | None = None
        self._closed = False
        self.disabled = False
        self.disabled_why: str | None = None  # (the budget's warning, for a recovery's error)
        self.state_bytes: int | None = None
        self._bytes_mesh: object = None
        self.taken = 0
        self.packed = 0  # of them, copies read from the packs the step wrote
        self.replaced = 0
        self.failed = 0
        self.copy_seconds: list[float] = []
        self._layouts: dict[tuple[Any, tuple[int, ...], np.dtype], LeafLayout] = {}
        # Shared leaves (`share`): one host copy each, held by both slots while the leaf
        # keeps its value. Per leaf, a version that a submit not keeping it advances, and
        # the newest copy: (version, its shards' index keys, copy).
        self._shared: frozenset[int] = frozenset()
        self._versions: list[int] = []
        self._shared_copies: dict[int, tuple[int, tuple[IndexKey, ...], LeafCopy]] = {}
        self.shared_bytes = 0  # of `state_bytes`, the shared leaves' (copied once)
        self.shared_copied = 0  # copies of a shared leaf read (not taken from the last)
        # No room in the budget for two copies of the shared leaves: a new copy gives up
        # the older snapshot first (`_give_up`).
        self._tight = False
        self.gave_up = 0
        self._on_corrupt = on_corrupt  # called (step) from the copy thread
        self.corrupt_found = 0

    # -- producer side (training thread) -------------------------------------------
    def share(self, leaves: Collection[int]) -> bool:
        """Copies the state leaves at these positions once, not into each slot: both
        slots hold the same host copy while `submit` says the leaf kept its value (a
        frozen base the step returns as given: `compiler.StepFacts.forwarded`). Such a
        copy is never written over; a leaf that changes gets a new one (the older stays
        with the slot that holds it until that slot is filled again). Called before the
        first `submit`; later, nothing is shared (returns False: the leaves are copied
        into each slot, as any other)."""
        if self._pending is not None or self._complete is not None or self._busy:
            return False
        self._shared = frozenset(int(i) for i in leaves)
        self.state_bytes = None  # (the budget is checked again with them)
        return True

    def submit(self, step: int, leaves: Sequence[jax.Array],
               packed: Packed | None = None, kept: Collection[int] = ()) -> bool:
        """Queues a snapshot of `leaves` (the state after `step`), read from ``packed``
        where it holds a leaf (the same state packed by the step); never blocks. ``kept``:
        the shared leaves (`share`) whose value is that of the previous submit (the step
        returned them as given, and nothing else changed them since): their host copy
        is the one already held."""
        if self.disabled or self._closed:
            return False
        mesh = getattr(leaves[0].sharding, "mesh", None) if leaves else None
        if self.state_bytes is None or mesh is not self._bytes_mesh:
            # Checked once per mesh, on the training thread, so a warning reaches the caller.
            self._bytes_mesh = mesh
            sizes = [sum(x.dtype.itemsize * int(np.prod([b - a for a, b in key]))
                         for _, key, _ in self._layout(x)) for x in leaves]
            self.state_bytes = sum(sizes)
            self.shared_bytes = sum(n for i, n in enumerate(sizes) if i in self._shared)
            own = self.state_bytes - self.shared_bytes
            self._tight = 2 * self.state_bytes > self._budget
            if 2 * own + self.shared_bytes > self._budget:
                self.disabled = True
                need = (f"2 x {own} bytes (and {self.shared_bytes} bytes copied once, of "
                        "leaves the step returns unchanged)" if self.shared_bytes
                        else f"2 x {own} bytes")
                self.disabled_why = (f"{self._name} snapshots need {need} of host memory, "
                                     f"over host_memory_budget_bytes={self._budget}")
                warnings.warn(f"mnemojax: {self.disabled_why}; snapshots are off",
                              SnapshotBudgetWarning, stacklevel=3)
                return False
        if len(self._versions) != len(leaves):
            self._versions = [0] * len(leaves)
            self._shared_copies.clear()  # (no copy of another count of leaves is reused)
        for i in self._shared:
            if i not in kept:
                self._versions[i] += 1
        with self._cv:
            if self._pending is not None:
                self.replaced += 1
            self._pending = (step, list(leaves), packed, tuple(self._versions))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"mnemojax-snapshot-{self._name}")
                self._thread.start()
            self._cv.notify_all()
        return True

    @property
    def host_bytes(self) -> int:
        """The host memory the snapshots hold: each slot's own buffers, and each shared
        copy once."""
        with self._cv:
            slots = [s for s in self._slots if s is not None]
        seen: set[int] = set()
        total = 0
        for snap in slots:
            for copy in snap.leaves:
                if id(copy) not in seen:
                    seen.add(id(copy))
                    total += sum(b.nbytes for b in copy.shards.values())
        # (views into one pack buffer are counted once each: the views are disjoint)
        return total

    def latest(self) -> HostSnapshot | None:
        """The newest complete snapshot, or None."""
        with self._cv:
            return None if self._complete is None else self._slots[self._complete]

    def snapshots(self) -> list[HostSnapshot]:
        """The complete snapshots, newest first: the latest and, while no copy is writing
        over it, the one before (a fallback if the latest fails its checksum)."""
        with self._cv:
            if self._complete is None:
                return []
            newest_first = [self._slots[self._complete]]
            other = 1 - self._complete
            if self._intact[other]:
                newest_first.append(self._slots[other])
            return [snap for snap in newest_first if snap is not None]

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Waits until no copy is queued or in flight."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._busy,
                                     timeout=timeout_s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for slot, intact in zip(self._slots, self._intact, strict=True):
            if intact:
                self._scrub(slot)  # a corruption that no restore or reuse met
        # The shared copies the complete slots hold (not in their own checks; each once).
        held = {id(c): c for slot, intact in zip(self._slots, self._intact, strict=True)
                if intact and slot is not None for i, c in enumerate(slot.leaves)
                if i in self._shared}
        for copy in held.values():
            if self._verify and any(checksums.checksum(buf) != copy.crcs[k]
                                    for k, buf in copy.shards.items()):
                self.corrupt_found += 1
                log.warning("mnemojax: a host copy of a shared state leaf failed its %s check "
                            "at close (host memory corruption)", checksums.NAME)

    def median_copy_s(self) -> float:
        return statistics.median(self.copy_seconds) if self.copy_seconds else 0.0

    # -- worker side ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                pending = self._pending
                if self._closed or pending is None:
                    return
                step, leaves, packed, versions = pending
                self._pending = None
                self._busy = True
                target = 0 if self._complete is None else 1 - self._complete
                reuse = self._slots[target]
                keep = self._slots[1 - target] if self._intact[1 - target] else None
                retiring = self._intact[target]
                self._intact[target] = False  # being overwritten from now on
                fresh = False
                if keep is not None and self._tight and self._changes_shared(leaves, versions):
                    # No room for two copies of a shared leaf: the older snapshot goes
                    # before the copy starts, under the lock (a reader that got it before
                    # meets empty copies, never one written over: `fresh`).
                    self._give_up(keep)
                    keep, fresh = None, True
            try:
                snap = self._copy(step, leaves, packed, versions, reuse, keep, scrub=retiring,
                                  fresh=fresh)
            except Exception as exc:  # noqa: BLE001 - a failed copy is simply not published
                log.warning("mnemojax: snapshot of step %d abandoned: %s", step, exc)
                self.failed += 1
                snap = None
            # The arrays copied (a step's state, its packs) go now, not at the next
            # submit: they would otherwise be on the devices beside the next step's.
            del pending, leaves, packed, keep
            with self._cv:
                if snap is not None:
                    self._slots[target] = snap
                    self._intact[target] = True
                    self._complete = target
                    self.taken += 1
                self._busy = False
                self._cv.notify_all()

    def _scrub(self, snap: HostSnapshot | None, fills: Sequence[Fill] | None = None) -> None:
        """Checks a snapshot's checksums once more before its buffers are reused (all of
        them, or only `fills`), so memory corruption of a snapshot is noticed even if it
        is never restored."""
        if snap is None or not self._verify or snap.corrupt:
            return
        for _, _, _, key, buf, crcs in snap.fills if fills is None else fills:
            if checksums.checksum(buf) != crcs[key]:
                self._retired_corrupt(snap)
                return

    def _retired_corrupt(self, snap: HostSnapshot) -> None:
        snap.corrupt = True
        self.corrupt_found += 1
        log.warning("mnemojax: snapshot of step %d failed its %s check while being retired "
                    "(host memory corruption)", snap.step, checksums.NAME)
        if self._on_corrupt is not None:
            self._on_corrupt(snap.step)

    def _layout(self, x: jax.Array) -> LeafLayout:
        # Shard objects are slow to build; the layout depends only on sharding and shape
        # (and the buffers on the dtype too). Cached, so the same layout is the same object.
        k = (x.sharding, x.shape, x.dtype)
        layout = self._layouts.get(k)
        if layout is None:
            layout = self._layouts[k] = _leaf_layout(x)
        return layout

    def _slot_key(self, leaves: Sequence[jax.Array], packed: Packed | None) -> tuple:
        """What a slot's buffers were laid out for: its own leaves' layouts (cached: the
        same object for the same layout) and the packs' members and shardings. A slot
        whose key is this one is filled in place."""
        own = tuple(id(self._layout(x)) for i, x in enumerate(leaves) if i not in self._shared)
        if packed is None:
            return own, None
        return own, (tuple(tuple(m) for m in packed.members),
                     tuple((a.sharding, a.shape, a.dtype) for a in packed.arrays))

    def _allocate(self, leaves: Sequence[jax.Array], packed: Packed | None,
                  key: tuple) -> HostSnapshot:
        """Host buffers for the leaves this slot copies itself (not `_shared`): views into
        one buffer per replica-0 pack shard for those in ``packed`` (`pack_pieces`), one
        buffer per replica-0 shard for the others. Shared leaves get theirs at each copy
        (`_attach_shared`)."""
        copies = [LeafCopy(tuple(x.shape), np.dtype(x.dtype), entry, {})
                  for x, entry in zip(leaves, self._entries, strict=True)]
        fills: list[Fill] = []
        pack_fills: list[PackFill] = []
        in_packs: set[int] = set()
        if packed is not None:
            layout = pack_pieces(leaves, packed)
            if layout is None:
                raise ValueError("the packs' members do not fill their shards")
            for p, position, device, pieces in layout:
                pack = packed.arrays[p]
                buf = np.empty(pack.sharding.shard_shape(tuple(pack.shape)), pack.dtype)
                flat, views = buf.reshape(-1), []
                for leaf, key_, offset, extent in pieces:
                    view = flat[offset:offset + int(np.prod(extent))].reshape(extent)
                    copies[leaf].shards[key_] = view
                    views.append((leaf, -1, device.id, key_, view, copies[leaf].crcs))
                fills += views
                pack_fills.append((p, position, device.id, buf, views))
            in_packs = {leaf for members in packed.members for leaf in members}
            for leaf in in_packs:
                wanted = {k for _, k, _ in self._layout(leaves[leaf])}
                if set(copies[leaf].shards) != wanted:
                    raise ValueError(f"the packs hold shards {sorted(copies[leaf].shards)} of "
                                     f"leaf {leaf}, its replica-0 shards are {sorted(wanted)}")
        leaf_fills: list[Fill] = []
        for leaf, (x, copy) in enumerate(zip(leaves, copies, strict=True)):
            if leaf in in_packs or leaf in self._shared:
                continue
            for position, key_, device_id in self._layout(x):
                copy.shards[key_] = np.empty([b - a for a, b in key_], x.dtype)
                leaf_fills.append((leaf, position, device_id, key_, copy.shards[key_],
                                   copy.crcs))
        return HostSnapshot(-1, copies, verify=self._verify, fills=fills + leaf_fills,
                            leaf_fills=leaf_fills, pack_fills=pack_fills, key=key)

    def _copy(self, step: int, leaves: Sequence[jax.Array], packed: Packed | None,
              versions: Sequence[int], reuse: HostSnapshot | None,
              keep: HostSnapshot | None = None, *, scrub: bool,
              fresh: bool = False) -> HostSnapshot:
        """Copies `leaves` into `reuse`'s buffers (new ones if the layout changed) and
        checksums each shard: one device read per pack shard where ``packed`` holds a leaf
        (its shards are views into it), one per shard for the others; the shared leaves
        last (`_attach_shared`).

        With `scrub`, `reuse` is the complete snapshot being retired: each buffer's old
        checksum is checked (`_scrub`) just before the buffer is overwritten, while it is
        in cache anyway, instead of in a pass of its own.
        """
        t0 = time.perf_counter()
        key = self._slot_key(leaves, packed)
        if reuse is None or reuse.key != key:
            if scrub:
                self._scrub(reuse)
            reuse, scrub = self._allocate(leaves, packed, key), False
        scrub = scrub and self._verify and not reuse.corrupt
        fetch_into, checksum = self._layer.fetch_into, checksums.checksum
        pack_fills, fills = reuse.pack_fills, reuse.leaf_fills
        at_pack = at_leaf = -1  # the fill being copied (for the scrub of those not reached)
        try:
            for at_pack in range(len(pack_fills)):
                p, position, device_id, buf, views = pack_fills[at_pack]
                if scrub and any(checksum(v) != crcs[k] for _, _, _, k, v, crcs in views):
                    scrub = False
                    self._retired_corrupt(reuse)
                assert packed is not None  # (the key has packs)
                fetch_into(packed.arrays[p].addressable_data(position), device_id, buf)
                for _, _, _, k, view, crcs in views:
                    crcs[k] = checksum(view)
            at_pack = len(pack_fills)
            for at_leaf in range(len(fills)):
                leaf, position, device_id, k, buf, crcs = fills[at_leaf]
                if scrub and checksum(buf) != crcs[k]:
                    scrub = False
                    self._retired_corrupt(reuse)
                fetch_into(leaves[leaf].addressable_data(position), device_id, buf)
                crcs[k] = checksum(buf)
        except BaseException:
            if scrub:  # the buffers not reached still hold the retired snapshot
                self._scrub(reuse, [f for *_, views in pack_fills[at_pack + 1:] for f in views]
                            + fills[at_leaf + 1:])
            raise
        self._attach_shared(reuse, keep, leaves, versions, scrub=scrub, fresh=fresh)
        reuse.step = step
        reuse.corrupt = False
        if pack_fills:
            self.packed += 1
        self.copy_seconds.append(time.perf_counter() - t0)
        return reuse

    def _changes_shared(self, leaves: Sequence[jax.Array], versions: Sequence[int]) -> bool:
        """Whether a copy of ``leaves`` reads some shared leaf anew (another version, or
        shards at other positions)."""
        for leaf in self._shared:
            held = self._shared_copies.get(leaf)
            if held is None or held[0] != versions[leaf] or held[1] != _keys(
                    self._layout(leaves[leaf])):
                return True
        return False

    def _attach_shared(self, snap: HostSnapshot, keep: HostSnapshot | None,
                       leaves: Sequence[jax.Array], versions: Sequence[int], *,
                       scrub: bool = False, fresh: bool = False) -> None:
        """Gives `snap` the copy of each shared leaf at its version: the one already held
        where the version and the shards' positions are the same (nothing read; a mesh
        change that keeps them, a replicated leaf's, keeps the copy; its checksums are
        checked again, so a corruption of the one copy both slots hold is found within a
        snapshot and read anew, not met at a restore with no fallback), else one read now:
        into the copy `snap` held before where `keep` (the complete slot, not written
        over) does not hold it and no reader may (not ``fresh``: `_run` gave up the older
        snapshot), else into new buffers, the older copy let go first: at most two
        copies of a shared leaf, one where `_run` gave up the older snapshot. With `scrub`
        (`snap` was complete: `_copy`), its own older copy is checked before it is written
        over (a copy that failed midway left it without valid checksums)."""
        fetch_into, checksum = self._layer.fetch_into, checksums.checksum
        for leaf in sorted(self._shared):
            x = leaves[leaf]
            layout = self._layout(x)
            keys = _keys(layout)
            held = self._shared_copies.get(leaf)
            check = scrub
            if held is not None and held[0] == versions[leaf] and held[1] == keys:
                if not self._verify or all(checksum(buf) == held[2].crcs[k]
                                           for k, buf in held[2].shards.items()):
                    snap.leaves[leaf] = held[2]
                    continue
                self._shared_corrupt(keep, leaf, held[2])  # read again below
                check = False  # (said once)
            mine = snap.leaves[leaf]
            # (an entry being written is never reused: versions only grow, but a torn copy
            # is better not named at all)
            self._shared_copies.pop(leaf, None)
            if fresh or (keep is not None and keep.leaves[leaf] is mine) \
                    or not _fits(mine, x, layout):
                snap.leaves[leaf] = LeafCopy(mine.shape, mine.dtype, mine.entry, {})
                del mine, held  # (its memory goes now, unless the other slot holds it)
                mine = LeafCopy(tuple(x.shape), np.dtype(x.dtype), self._entries[leaf],
                                {k: np.empty([b - a for a, b in k], x.dtype)
                                 for _, k, _ in layout})
            elif check and any(checksum(buf) != mine.crcs.get(k)
                               for k, buf in mine.shards.items()):
                self._retired_corrupt(snap)  # (its own older copy, about to be written over)
            for position, k, device_id in layout:
                fetch_into(x.addressable_data(position), device_id, mine.shards[k])
                mine.crcs[k] = checksum(mine.shards[k])
            self._shared_copies[leaf] = (versions[leaf], keys, mine)
            self.shared_copied += 1
            snap.leaves[leaf] = mine

    def _shared_corrupt(self, keep: HostSnapshot | None, leaf: int, copy: LeafCopy) -> None:
        """The one copy of shared leaf `leaf` failed its checksum: said, and the complete
        snapshot holding it is marked corrupt (never restored)."""
        self.corrupt_found += 1
        log.warning("mnemojax: the host copy of state leaf %d that both snapshots share "
                    "failed its %s check (host memory corruption); it is read again from "
                    "the devices", leaf, checksums.NAME)
        if keep is not None and keep.leaves[leaf] is copy and not keep.corrupt:
            keep.corrupt = True
            if self._on_corrupt is not None:
                self._on_corrupt(keep.step)

    def _give_up(self, keep: HostSnapshot) -> None:
        """Makes room for a new copy of the shared leaves within the budget (`_tight`): the
        complete snapshot `keep` is no longer offered, and its copies of the shared leaves
        go (the next copy writes over its slot anyway). Called with ``_cv`` held."""
        index = next(i for i, slot in enumerate(self._slots) if slot is keep)
        self._intact[index] = False
        if self._complete == index:
            self._complete = None
        for leaf in self._shared:
            copy = keep.leaves[leaf]
            keep.leaves[leaf] = LeafCopy(copy.shape, copy.dtype, copy.entry, {})
        self.gave_up += 1
        log.info("mnemojax: the snapshot of step %d is given up to copy the shared leaves "
                 "anew within host_memory_budget_bytes", keep.step)
        if self.gave_up == 1:
            log.warning("mnemojax: %s snapshots: host_memory_budget_bytes=%d has room for one "
                        "copy of the leaves the step returns unchanged, not two: each time "
                        "they change (a recovery onto other shards, a change between steps), "
                        "the older snapshot is given up while they are copied anew (said "
                        "once; Statistics.snapshots_given_up)", self._name, self._budget)
