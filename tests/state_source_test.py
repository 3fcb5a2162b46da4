"""Where a recovery takes the state from (mnemojax._src.state_source.gather_state):
live replicas, then the same step's snapshot, then an older snapshot, else a typed error."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.snapshot import SnapshotStore
from mnemojax._src.state_source import gather_state
from mnemojax.errors import StateUnavailableError
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8

SPECS = [P(None, "model"), P()]


class _ReadLog(JaxDeviceLayer):
    """The real layer, recording which devices shards were read from."""

    def __init__(self):
        super().__init__()
        self.read_from: list[int] = []

    def fetch(self, shard):
        self.read_from.append(shard.device.id)
        return super().fetch(shard)


def _host(offset=0.0):
    w = np.arange(64, dtype=np.float32).reshape(8, 8) + offset
    return [w, np.arange(8, dtype=np.int32) + int(offset)]


def _on(mesh_shape, host):
    mesh = h.mesh_of(mesh_shape)
    return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(host, SPECS, strict=True)]


def _snapshot(step, arrays):
    store = SnapshotStore(JaxDeviceLayer(), ["params", "opt_state"], budget_bytes=1 << 30)
    try:
        assert store.submit(step, arrays) and store.wait_idle(30)
        snap = store.latest()
    finally:
        store.close()
    assert snap is not None and snap.step == step
    return snap


def _assert_state(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def _flip_a_bit(snap):
    buf = next(iter(snap.leaves[0].shards.values()))
    buf.reshape(-1).view(np.uint8)[0] ^= 1


# -- 1. live replicas ----------------------------------------------------------------------

def test_replicated_state_comes_from_live_replicas_never_from_dead_devices():
    layer = _ReadLog()
    got = gather_state(_on((4, 2), _host()), 5, {1, 2}, [], layer, live_ok=True)
    assert got.source == "live_replicas" and got.step == 5
    _assert_state(got.leaves, _host())
    assert got.bytes_read == sum(x.nbytes for x in _host())  # one copy of each shard
    assert not {1, 2} & set(layer.read_from)
    assert got.corrupt_snapshots == 0


def test_live_replicas_win_over_snapshots_of_the_same_step():
    stale = _snapshot(5, _on((4, 2), _host(offset=100.0)))  # marked: must not be used
    got = gather_state(_on((4, 2), _host()), 5, {3}, [stale], JaxDeviceLayer(), live_ok=True)
    assert got.source == "live_replicas"
    _assert_state(got.leaves, _host())


def test_an_unreadable_replica_is_skipped_for_the_next_one():
    """Device 0 died, but nobody has noticed yet (it is not in `dead`): its read fails
    and the copy on another data replica is read instead."""
    faults = FaultInjector().lose_devices(1, [0])
    layer = faults.wrap(JaxDeviceLayer())
    layer.execute(lambda: None, (), step=1, devices=())  # the loss happens
    got = gather_state(_on((4, 2), _host()), 1, set(), [], layer, live_ok=True)
    assert got.source == "live_replicas"
    _assert_state(got.leaves, _host())


# -- 2. the same step's snapshot for shards with no surviving copy --------------------------

def test_lost_single_copy_shard_comes_from_the_same_step_snapshot():
    """(1, 8): every column of `w` lives on one device only. The snapshot is marked
    (+100) to show that exactly the lost column comes from it."""
    marked = _snapshot(5, _on((1, 8), _host(offset=100.0)))
    got = gather_state(_on((1, 8), _host()), 5, {3}, [marked], JaxDeviceLayer(), live_ok=True)
    assert got.source == "live_replicas+snapshot" and got.step == 5
    want = _host()
    want[0][:, 3] += 100.0
    _assert_state(got.leaves, want)


def test_snapshot_laid_out_for_another_mesh_is_cut_to_the_lost_shard():
    marked = _snapshot(5, _on((4, 2), _host(offset=100.0)))  # shards are half-columns
    got = gather_state(_on((1, 8), _host()), 5, {6}, [marked], JaxDeviceLayer(), live_ok=True)
    assert got.source == "live_replicas+snapshot"
    want = _host()
    want[0][:, 6] += 100.0
    _assert_state(got.leaves, want)


def test_an_older_snapshot_never_fills_in_a_shard():
    """A recovery never mixes steps: with only an older snapshot, the whole state rolls
    back to it."""
    older = _snapshot(4, _on((1, 8), _host(offset=100.0)))
    got = gather_state(_on((1, 8), _host()), 5, {3}, [older], JaxDeviceLayer(), live_ok=True)
    assert got.source == "host_snapshot" and got.step == 4
    _assert_state(got.leaves, _host(offset=100.0))
    assert got.bytes_read == older.nbytes


# -- 3. the whole state from the newest usable snapshot -------------------------------------

def test_newest_snapshot_is_used_when_the_live_state_is_not_usable():
    snaps = [_snapshot(s, _on((4, 2), _host(offset=float(s)))) for s in (2, 4, 3)]
    got = gather_state(_on((4, 2), _host()), 5, set(), snaps, JaxDeviceLayer(), live_ok=False)
    assert got.source == "host_snapshot" and got.step == 4
    _assert_state(got.leaves, _host(offset=4.0))


def test_corrupt_same_step_snapshot_falls_back_to_an_older_one():
    same = _snapshot(5, _on((1, 8), _host(offset=5.0)))
    older = _snapshot(4, _on((1, 8), _host(offset=4.0)))
    _flip_a_bit(same)
    got = gather_state(_on((1, 8), _host()), 5, set(range(8)), [same, older],
                       JaxDeviceLayer(), live_ok=True)
    assert got.source == "host_snapshot" and got.step == 4
    assert got.corrupt_snapshots == 1 and same.corrupt
    _assert_state(got.leaves, _host(offset=4.0))


def test_corrupt_newest_snapshot_is_skipped_without_live_state():
    newest = _snapshot(4, _on((4, 2), _host(offset=4.0)))
    older = _snapshot(3, _on((4, 2), _host(offset=3.0)))
    _flip_a_bit(newest)
    got = gather_state(_on((4, 2), _host()), 4, set(), [older, newest], JaxDeviceLayer(),
                       live_ok=False)
    assert got.step == 3 and got.corrupt_snapshots == 1
    _assert_state(got.leaves, _host(offset=3.0))


# -- nothing left ------------------------------------------------------------------------

def test_no_copy_anywhere_is_a_typed_error():
    with pytest.raises(StateUnavailableError, match="live copy of step 5 lost a shard") as info:
        gather_state(_on((1, 8), _host()), 5, {3}, [], JaxDeviceLayer(), live_ok=True)
    assert info.value.corrupt == 0


def test_only_corrupt_snapshots_is_a_typed_error_that_counts_them():
    snaps = [_snapshot(s, _on((1, 8), _host())) for s in (4, 5)]
    for snap in snaps:
        _flip_a_bit(snap)
    with pytest.raises(StateUnavailableError,
                       match=r"2 host snapshot\(s\) failed their checksums") as info:
        gather_state(_on((1, 8), _host()), 5, set(range(8)), snaps, JaxDeviceLayer(),
                     live_ok=True)
    assert info.value.corrupt == 2


def test_donated_live_state_without_snapshots_is_a_typed_error():
    with pytest.raises(StateUnavailableError):
        gather_state(_on((4, 2), _host()), 5, set(), [], JaxDeviceLayer(), live_ok=False)
