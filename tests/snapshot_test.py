"""Host snapshots: dedup, double buffering, checksums, budget, never aliasing device memory."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mnemojax._src.checksum import checksum
from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.errors import SnapshotCorruptError
from mnemojax._src.snapshot import SnapshotBudgetWarning, SnapshotStore
from tests import helpers as h

pytestmark = pytest.mark.needs8


@pytest.fixture(scope="module")
def arrays():
    mesh = h.mesh_of((4, 2))
    rng = np.random.default_rng(0)
    host = [rng.normal(size=(8, 6)).astype(np.float32), rng.normal(size=(6,)).astype(np.float32)]
    specs = [P(None, "model"), P()]
    return host, [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(host, specs,
                                                                              strict=True)]


def _store(**kw):
    return SnapshotStore(JaxDeviceLayer(), ["params", "opt_state"], budget_bytes=1 << 30, **kw)


def test_snapshot_is_exact_and_deduplicated(arrays):
    host, dev = arrays
    store = _store()
    store.submit(1, dev)
    assert store.wait_idle(10)
    snap = store.latest()
    assert snap.step == 1
    # (8, 6) sharded 2 ways over model and replicated 4 ways over data: 2 shards kept.
    assert len(snap.leaves[0].shards) == 2 and len(snap.leaves[1].shards) == 1
    assert snap.nbytes == sum(x.nbytes for x in host)
    for i, x in enumerate(host):
        np.testing.assert_array_equal(snap.assemble(i), x)
    store.close()


def test_snapshot_owns_its_memory(arrays):
    _, dev = arrays
    store = _store()
    for leaf in _taken(store, dev).leaves:
        for buf in leaf.shards.values():
            assert buf.flags.owndata and buf.flags.writeable
    store.close()


def test_buffers_are_reused_and_double_buffered(arrays):
    _, dev = arrays
    store = _store()
    first = _taken(store, dev)
    second = _taken(store, dev, 2)
    assert second is not first and second.step == 2
    store.submit(3, dev)
    store.wait_idle(10)
    assert store.latest() is first and first.step == 3  # the older slot was reused
    store.close()


class _CountingLayer(JaxDeviceLayer):
    """Counts the device reads."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def fetch_into(self, piece, device_id, out):
        self.reads += 1
        super().fetch_into(piece, device_id, out)


class _GatedLayer(JaxDeviceLayer):
    """Blocks inside a copy until released, to look at the store mid-copy."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def fetch_into(self, piece, device_id, out):
        self.entered.set()
        self.gate.wait(10)
        super().fetch_into(piece, device_id, out)


def test_copy_in_flight_never_replaces_the_complete_one(arrays):
    _, dev = arrays
    layer = _GatedLayer()
    store = SnapshotStore(layer, ["params", "opt_state"], budget_bytes=1 << 30)
    layer.gate.set()
    store.submit(1, dev)
    store.wait_idle(10)
    layer.gate.clear()
    layer.entered.clear()
    store.submit(2, dev)
    assert layer.entered.wait(10)
    assert store.latest().step == 1  # step 2 is being copied: not visible yet
    store.submit(3, dev)  # queued behind it; replaces nothing complete
    layer.gate.set()
    store.wait_idle(10)
    assert store.latest().step == 3
    store.close()


def test_corrupt_snapshot_is_never_restored(arrays):
    _, dev = arrays
    store = _store()
    store.submit(1, dev)
    store.wait_idle(10)
    snap = store.latest()
    buf = next(iter(snap.leaves[0].shards.values()))
    buf.view(np.uint8)[3] ^= 0x10  # flip one bit
    with pytest.raises(SnapshotCorruptError, match="CRC32"):
        snap.assemble(0)
    store.close()


def test_budget_exceeded_turns_snapshots_off_with_a_warning(arrays):
    _, dev = arrays
    store = SnapshotStore(JaxDeviceLayer(), ["params", "opt_state"], budget_bytes=64)
    with pytest.warns(SnapshotBudgetWarning, match="host_memory_budget_bytes=64"):
        assert store.submit(1, dev) is False
    assert store.disabled and store.latest() is None
    assert store.submit(2, dev) is False
    store.close()


def _buffers(snap):
    return [(i, key, buf) for i, leaf in enumerate(snap.leaves) for key, buf in leaf.shards.items()]


def test_checksums_are_crc32c_of_each_copy(arrays):
    """One algorithm everywhere: the per-shard values are `checksum.checksum` (CRC32C)."""
    _, dev = arrays
    store = _store()
    snap = _taken(store, dev)
    for i, key, buf in _buffers(snap):
        assert snap.leaves[i].crcs[key] == checksum(buf)
    store.close()


def test_a_flipped_bit_in_any_shard_is_caught_by_shard_and_assemble(arrays):
    _, dev = arrays
    store = _store()
    snap = _taken(store, dev)
    for i, key, buf in _buffers(snap):
        raw = buf.view(np.uint8).reshape(-1)
        for byte in (0, raw.size // 2, raw.size - 1):
            raw[byte] ^= 0x01
            with pytest.raises(SnapshotCorruptError, match="CRC32C"):
                snap.shard(i, key)
            with pytest.raises(SnapshotCorruptError, match="CRC32C"):
                snap.assemble(i)
            raw[byte] ^= 0x01
            np.testing.assert_array_equal(snap.shard(i, key), buf)  # intact again
    store.close()


def _taken(store, dev, step: int = 1, kept=()):
    """Submits `dev` as the snapshot of `step` and returns it once copied."""
    assert store.submit(step, dev, kept=kept)
    assert store.wait_idle(10)
    return store.latest()


def _two_snapshots(store, dev):
    for step in (1, 2):
        _taken(store, dev, step)
    older = store.snapshots()[1]
    assert older.step == 1
    return older


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_corrupt_snapshot_is_reported_when_its_slot_is_reused(arrays, which):
    """The retired slot is checked shard by shard as the next copy overwrites it."""
    host, dev = arrays
    found = []
    store = _store(on_corrupt=found.append)
    older = _two_snapshots(store, dev)
    _, _, buf = _buffers(older)[0 if which == "first" else -1]
    buf.view(np.uint8).reshape(-1)[0] ^= 0x80
    store.submit(3, dev)  # overwrites step 1's slot
    assert store.wait_idle(10)
    assert found == [1] and store.corrupt_found == 1
    snap = store.latest()
    assert snap.step == 3 and not snap.corrupt
    for i, x in enumerate(host):
        np.testing.assert_array_equal(snap.assemble(i), x)
    store.submit(4, dev)  # the slot of step 2 is intact: nothing more is reported
    assert store.wait_idle(10)
    assert found == [1]
    store.close()


class _FailingLayer(JaxDeviceLayer):
    """A device that dies during the copy: the first fetch fails."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def fetch_into(self, piece, device_id, out):
        if self.fail:
            raise RuntimeError("device-to-host transfer failed")
        super().fetch_into(piece, device_id, out)


def test_a_failed_copy_still_checks_the_rest_of_the_retired_slot(arrays):
    _, dev = arrays
    found = []
    layer = _FailingLayer()
    store = SnapshotStore(layer, ["params", "opt_state"], budget_bytes=1 << 30,
                          on_corrupt=found.append)
    older = _two_snapshots(store, dev)
    _, _, buf = _buffers(older)[-1]  # a buffer the failed copy never reaches
    buf.view(np.uint8).reshape(-1)[0] ^= 0x80
    layer.fail = True
    store.submit(3, dev)
    assert store.wait_idle(10)
    assert store.failed == 1 and store.latest().step == 2  # step 3 was never published
    assert found == [1] and store.corrupt_found == 1
    store.close()


def test_a_corrupt_snapshot_is_reported_when_the_layout_changes(arrays):
    """Reused slots are checked before new buffers replace them (another mesh)."""
    _, dev = arrays
    found = []
    store = _store(on_corrupt=found.append)
    older = _two_snapshots(store, dev)
    _, _, buf = _buffers(older)[0]
    buf.view(np.uint8).reshape(-1)[0] ^= 0x80
    mesh = h.mesh_of((2, 4))
    other = [jax.device_put(np.asarray(x), NamedSharding(mesh, s))
             for x, s in zip(dev, [P("model", None), P()], strict=True)]
    store.submit(3, other)
    assert store.wait_idle(10)
    assert found == [1] and store.latest().step == 3
    store.close()


# -- shared leaves (a frozen base the step returns as given: `SnapshotStore.share`) ------

def test_a_kept_shared_leaf_is_copied_once_and_held_by_both_slots(arrays):
    host, dev = arrays
    layer = _CountingLayer()
    store = SnapshotStore(layer, ["params", "opt_state"], budget_bytes=1 << 30)
    assert store.share([0])
    first = _taken(store, dev)
    reads = layer.reads
    second = _taken(store, [dev[0], dev[1] * 2], 2, kept=[0])
    # Only leaf 1's one shard was read again; leaf 0's copy is the one the first holds.
    assert layer.reads - reads == 1
    assert second.leaves[0] is first.leaves[0] and second.leaves[1] is not first.leaves[1]
    np.testing.assert_array_equal(second.assemble(0), host[0])
    np.testing.assert_array_equal(second.assemble(1), host[1] * 2)
    np.testing.assert_array_equal(first.assemble(1), host[1])
    # Host memory: each slot's own leaf, and the shared leaf once.
    assert store.shared_bytes == host[0].nbytes
    assert store.host_bytes == 2 * host[1].nbytes + host[0].nbytes
    store.close()


def test_a_shared_leaf_not_kept_gets_a_new_copy_and_the_older_snapshot_keeps_its_own(arrays):
    """A frozen base changed between steps (new weights loaded) is copied anew; the copy
    the other slot holds is never written over, so that older snapshot still restores
    the value it was taken of."""
    host, dev = arrays
    store = _store()
    assert store.share([0])
    first = _taken(store, dev)
    changed = [dev[0] + 1, dev[1]]
    second = _taken(store, changed, 2)  # (nothing kept: a new value)
    assert second.leaves[0] is not first.leaves[0]
    np.testing.assert_array_equal(second.assemble(0), host[0] + 1)
    np.testing.assert_array_equal(first.assemble(0), host[0])
    third = _taken(store, changed, 3, kept=[0])  # over the first slot: the new copy kept
    assert third is first and third.leaves[0] is second.leaves[0]
    np.testing.assert_array_equal(third.assemble(0), host[0] + 1)
    store.close()


def test_a_shared_leaf_on_another_mesh_is_copied_again_even_if_kept(arrays):
    host, dev = arrays
    store = _store()
    assert store.share([0])
    first = _taken(store, dev)
    mesh = h.mesh_of((2, 4))
    other = [jax.device_put(x, NamedSharding(mesh, s))
             for x, s in zip(host, [P("model", None), P()], strict=True)]
    second = _taken(store, other, 2, kept=[0])
    assert second.leaves[0] is not first.leaves[0] and len(second.leaves[0].shards) == 4
    np.testing.assert_array_equal(second.assemble(0), host[0])
    store.close()


def test_the_budget_counts_a_shared_leaf_once(arrays):
    host, dev = arrays
    need = 2 * host[1].nbytes + host[0].nbytes  # (under 2 x the whole state)
    store = SnapshotStore(JaxDeviceLayer(), ["params", "opt_state"], budget_bytes=need)
    assert store.share([0])
    assert store.submit(1, dev) and store.wait_idle(10) and not store.disabled
    store.close()
    store = SnapshotStore(JaxDeviceLayer(), ["params", "opt_state"], budget_bytes=need - 1)
    assert store.share([0])
    with pytest.warns(SnapshotBudgetWarning, match=r"2 x 24 bytes \(and 192 bytes copied once"):
        assert store.submit(1, dev) is False
    store.close()


def test_leaves_are_shared_only_before_the_first_snapshot(arrays):
    _, dev = arrays
    store = _store()
    _taken(store, dev)
    assert not store.share([0])
    second = _taken(store, dev, 2, kept=[0])
    assert second.leaves[0] is not store.snapshots()[1].leaves[0]  # (each slot its own)
    store.close()


def test_a_corrupt_shared_copy_is_caught_on_restore(arrays):
    _, dev = arrays
    store = _store()
    assert store.share([0])
    _taken(store, dev)
    snap = _taken(store, dev, 2, kept=[0])
    next(iter(snap.leaves[0].shards.values())).view(np.uint8)[0] ^= 0x01
    for held in store.snapshots():  # (both slots hold that copy)
        with pytest.raises(SnapshotCorruptError, match="leaf 0"):
            held.assemble(0)
    store.close()
    assert store.corrupt_found == 1  # (and said at close, as a retired slot's would be)


def test_a_corrupt_shared_copy_is_read_again_at_the_next_snapshot(arrays):
    """Review 31: both slots hold the one copy, so a flipped bit left no fallback. Each
    snapshot that reuses it checks it: found, said, the older snapshot marked corrupt, and
    the copy read again from the devices."""
    host, dev = arrays
    found = []
    store = _store(on_corrupt=found.append)
    assert store.share([0])
    _taken(store, dev)
    older = _taken(store, dev, 2, kept=[0])
    bad = older.leaves[0]
    next(iter(bad.shards.values())).view(np.uint8)[0] ^= 0x01
    newest = _taken(store, dev, 3, kept=[0])
    assert store.corrupt_found == 1 and found == [2] and older.corrupt
    assert newest.leaves[0] is not bad and not newest.corrupt
    np.testing.assert_array_equal(newest.assemble(0), host[0])
    store.close()


def test_a_shared_leaf_that_keeps_changing_has_at_most_two_copies(arrays):
    """Review 31: each new value got new buffers while the older stayed with a slot and the
    retiring one: up to three copies. A new value now goes into the retiring slot's own
    copy where the complete slot does not hold it."""
    host, dev = arrays
    store = _store()
    assert store.share([0])
    first = _taken(store, dev)
    copy = first.leaves[0]
    for step in (2, 3, 4, 5):
        _taken(store, [dev[0] + step, dev[1]], step)
        assert store.host_bytes == 2 * host[0].nbytes + 2 * host[1].nbytes
    # (steps 3 and 5 went to the first slot: into its own copy, written over)
    assert store.latest().leaves[0] is copy and store.snapshots()[1].leaves[0] is not copy
    np.testing.assert_array_equal(store.latest().assemble(0), host[0] + 5)
    np.testing.assert_array_equal(store.snapshots()[1].assemble(0), host[0] + 4)
    store.close()


def test_a_tight_budget_gives_up_the_older_snapshot_for_a_new_shared_copy(arrays):
    """A budget with room for one copy of the shared leaf (2 x the rest + it): a new value
    gives up the older snapshot first, so the host never holds two."""
    host, dev = arrays
    need = 2 * host[1].nbytes + host[0].nbytes
    store = SnapshotStore(JaxDeviceLayer(), ["params", "opt_state"], budget_bytes=need)
    assert store.share([0])
    _taken(store, dev)
    _taken(store, dev, 2, kept=[0])
    assert len(store.snapshots()) == 2 and store.gave_up == 0
    newest = _taken(store, [dev[0] + 1, dev[1]], 3)
    assert store.gave_up == 1 and store.snapshots() == [newest]
    assert store.host_bytes == need
    np.testing.assert_array_equal(newest.assemble(0), host[0] + 1)
    fourth = _taken(store, [dev[0] + 1, dev[1] * 2], 4, kept=[0])
    assert len(store.snapshots()) == 2 and fourth.leaves[0] is newest.leaves[0]
    store.close()


def test_a_corrupt_older_shared_copy_is_reported_before_it_is_written_over(arrays):
    host, dev = arrays
    found = []
    store = _store(on_corrupt=found.append)
    assert store.share([0])
    first = _taken(store, dev)
    _taken(store, [dev[0] + 1, dev[1]], 2)  # a new value: the other slot's own copy
    next(iter(first.leaves[0].shards.values())).view(np.uint8)[0] ^= 0x01
    third = _taken(store, [dev[0] + 2, dev[1]], 3)  # into the first slot's copy, in place
    assert third is first and found == [1] and store.corrupt_found == 1
    np.testing.assert_array_equal(third.assemble(0), host[0] + 2)
    store.close()


def test_a_tight_budget_gives_up_by_identity_with_an_own_leaf_first(arrays):
    """Review 32: the slot given up was found by equality, which compared two snapshots of
    the same step down to their numpy buffers and raised: every later copy was abandoned.
    Here the shared leaf is the second, and a change made between steps is snapshotted at
    the step of the snapshot before it."""
    host, dev = arrays
    store = SnapshotStore(JaxDeviceLayer(), ["params", "opt_state"],
                          budget_bytes=2 * host[0].nbytes + host[1].nbytes)
    assert store.share([1])
    _taken(store, dev, 0)
    _taken(store, dev, 1, kept=[1])
    _taken(store, dev, 2, kept=[1])
    _taken(store, [dev[0], dev[1] + 1], 2)  # a change between steps, at step 2 again
    for step in (3, 4, 5):
        _taken(store, [dev[0] * 2, dev[1] + 2], step, kept=[1] if step > 3 else ())
    assert store.failed == 0 and store.latest().step == 5 and store.gave_up == 2
    np.testing.assert_array_equal(store.latest().assemble(1), host[1] + 2)
    store.close()


def test_the_older_snapshot_is_given_up_before_the_copy_and_its_copy_never_written(arrays):
    """Review 32: under a tight budget the older snapshot was given up in the middle of the
    copy, and its shared copy written over in place: a recovery that had it (its wait for
    the copy timed out) read a mixed or empty state. It is given up before the copy
    starts, and the new value goes to new buffers."""
    host, dev = arrays
    layer = _GatedLayer()
    layer.gate.set()
    store = SnapshotStore(layer, ["params", "opt_state"],
                          budget_bytes=2 * host[1].nbytes + host[0].nbytes)
    assert store.share([0])
    _taken(store, dev)
    held = _taken(store, dev, 2, kept=[0]).leaves[0]  # (a reader's copy of the base)
    layer.gate.clear()
    layer.entered.clear()
    assert store.submit(3, [dev[0] + 1, dev[1]])
    assert layer.entered.wait(10)
    assert store.snapshots() == [] and store.gave_up == 1  # (before anything was read)
    layer.gate.set()
    assert store.wait_idle(10)
    for k, buf in held.shards.items():  # never written over
        np.testing.assert_array_equal(buf, host[0][tuple(slice(a, b) for a, b in k)])
    np.testing.assert_array_equal(store.latest().assemble(0), host[0] + 1)
    store.close()


def test_close_checks_every_shared_copy_a_complete_snapshot_holds(arrays):
    """Review 32: `close` checked only the newest shared copies; the older snapshot's own
    copy of a leaf that changed went unchecked."""
    _, dev = arrays
    store = _store()
    assert store.share([0])
    older = _taken(store, dev)
    _taken(store, [dev[0] + 1, dev[1]], 2)  # a new value: its own copy
    next(iter(older.leaves[0].shards.values())).view(np.uint8)[0] ^= 0x01
    store.close()
    assert store.corrupt_found == 1
