"""Host snapshots: dedup, double buffering, checksums, budget, never aliasing device memory."""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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
    store.submit(1, dev)
    store.wait_idle(10)
    for leaf in store.latest().leaves:
        for buf in leaf.shards.values():
            assert buf.flags.owndata and buf.flags.writeable
    store.close()


def test_buffers_are_reused_and_double_buffered(arrays):
    _, dev = arrays
    store = _store()
    store.submit(1, dev)
    store.wait_idle(10)
    first = store.latest()
    store.submit(2, dev)
    store.wait_idle(10)
    second = store.latest()
    assert second is not first and second.step == 2
    store.submit(3, dev)
    store.wait_idle(10)
    assert store.latest() is first and first.step == 3  # the older slot was reused
    store.close()


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
