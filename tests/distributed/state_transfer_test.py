"""`distributed.worker.state_transfer`: the agreed state onto a new mesh, fetching only the
regions the process's devices hold (`AgreedCopies.fetch`, `snapshot_codec.select`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.distributed.snapshot_codec import ShardEntry, pack
from mnemojax._src.distributed.worker import state_transfer
from mnemojax._src.errors import StateUnavailableError
from tests.distributed.fakes import local_copies

W = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
B = np.arange(6, dtype=np.int32)


def _copies_of_three_workers(requests=None):
    """Step 4 of an old 3-worker mesh: each worker held 16 columns of ``W``; worker 0
    also held ``B`` and a 0-d counter."""
    def payload(worker, entries):
        return b"".join(bytes(p) for p in pack(4, worker, entries, num_leaves=3))

    cols = {w: ShardEntry(0, W.shape, ((0, 64), (16 * w, 16 * w + 16)),
                          W[:, 16 * w:16 * w + 16]) for w in range(3)}
    return local_copies({0: payload(0, [cols[0], ShardEntry(1, (6,), ((0, 6),), B),
                                        ShardEntry(2, (), (), np.array(9, np.int32))]),
                         1: payload(1, [cols[1]]), 2: payload(2, [cols[2]])}, 4,
                        requests=requests)


def test_restore_onto_another_mesh_places_every_leaf_exactly():
    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices()[:8])
    shardings = [NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P()),
                 NamedSharding(mesh, P())]
    copies = _copies_of_three_workers()
    leaves = state_transfer.restore_leaves(copies, shardings, put=JaxDeviceLayer().put)
    np.testing.assert_array_equal(np.asarray(leaves[0]), W)
    np.testing.assert_array_equal(np.asarray(leaves[1]), B)
    assert int(leaves[2]) == 9 and leaves[2].dtype == np.int32
    assert [x.sharding for x in leaves] == shardings


def test_fetch_asks_only_the_copies_that_overlap_and_only_their_overlap():
    """A process whose devices hold rows 0-32 of columns 0-24 of W asks worker 0 and
    worker 1 for those cells alone, and worker 2 nothing."""
    requests = []
    copies = _copies_of_three_workers(requests)
    before = copies.fetched_bytes
    pieces = copies.fetch([(0, ((0, 32), (0, 24)))])
    assert sorted(o for o, _ in requests) == [0, 1]
    assert sorted((p.leaf, p.index) for p in pieces) == [(0, ((0, 32), (0, 16))),
                                                         (0, ((0, 32), (16, 24)))]
    np.testing.assert_array_equal(pieces[0].data, W[:32, :16])
    assert copies.fetched_from == {0: "agent-0", 1: "agent-1"}
    assert copies.fetched_bytes - before == 32 * 24 * W.itemsize  # those cells alone


def test_assemble_agreed_is_the_whole_state_and_a_missing_leaf_is_named():
    whole = state_transfer.assemble_agreed(_copies_of_three_workers(), 3)
    np.testing.assert_array_equal(whole[0], W)
    np.testing.assert_array_equal(whole[1], B)
    with pytest.raises(StateUnavailableError, match="state of 3 leaves; this one has 4"):
        _copies_of_three_workers().leaves(4)
    lacking = local_copies({1: b"".join(bytes(p) for p in pack(
        4, 1, [ShardEntry(0, (2,), ((0, 2),), np.zeros(2, np.float32))], num_leaves=2))}, 4)
    with pytest.raises(StateUnavailableError, match=r"leaves \[1\] are in none"):
        lacking.leaves(2)


def test_a_copy_of_another_step_is_never_placed_and_the_next_source_is_asked():
    """An agent answering for the agreed step 4 with a copy of step 5 (a mixed-step state)
    is passed over for the copy's next source; when none has a good one, the fetch fails
    as a peer failure would (`CopiesUnreachableError`), never with a silent mix."""
    from mnemojax._src.distributed.snapshot_codec import read_meta, select
    from mnemojax._src.distributed.worker.recovery import AgreedCopies, CopiesUnreachableError

    def payload(step):
        return b"".join(bytes(p) for p in pack(
            step, 1, [ShardEntry(0, W.shape, ((0, 64), (16, 32)), W[:, 16:32])],
            num_leaves=1))

    served = {"stale": payload(5), "good": payload(4)}
    asked = []

    def fetch(addrs, origin, step, *, secret, boxes):
        asked.append(addrs[0])
        return bytearray(b"".join(select(served[addrs[0]], boxes))), addrs[0]

    def copies(sources):
        return AgreedCopies(4, 0, {1: read_meta(served["good"])}, {1: sources}, b"",
                            fetch=fetch)

    [piece] = copies(("stale", "good")).fetch([(0, ((0, 64), (16, 32)))])
    np.testing.assert_array_equal(piece.data, W[:, 16:32])
    assert asked == ["stale", "good"]
    with pytest.raises(CopiesUnreachableError, match="is of step 5.*not the agreed step 4"):
        copies(("stale",)).fetch([(0, ((0, 64), (16, 32)))])


def test_copies_that_disagree_on_a_leaf_are_refused():
    def payload(worker, dtype):
        return b"".join(bytes(p) for p in pack(
            4, worker, [ShardEntry(0, (4,), ((2 * worker, 2 * worker + 2),),
                                   np.zeros(2, dtype))], num_leaves=1))

    mixed = local_copies({0: payload(0, np.float32), 1: payload(1, np.int32)}, 4)
    with pytest.raises(StateUnavailableError, match="disagree on leaf 0"):
        mixed.leaves(1)


def test_held_shards_are_the_replicas_a_process_holds_beyond_what_it_owns():
    """Process 2's view of a (4, 2) data x model mesh over 4 processes: it owns nothing
    (data row 0 does) and holds a whole replica: W's two column halves, and B on both its
    devices (one held region). A region it owns on one device is not held again."""
    from types import SimpleNamespace as NS

    def shard(cols, replica_id, value):
        return NS(index=(slice(None), slice(*cols)), replica_id=replica_id, data=value)

    w = NS(shape=(64, 48), addressable_shards=[shard((0, 24), 2, W[:, :24]),
                                               shard((24, 48), 2, W[:, 24:])])
    b = NS(shape=(6,), addressable_shards=[NS(index=(slice(None),), replica_id=r, data=B)
                                           for r in (4, 5)])
    held = state_transfer.held_shards([w, b])  # type: ignore[arg-type]
    assert [(e.leaf, e.index) for e in held] == [(0, ((0, 64), (0, 24))),
                                                 (0, ((0, 64), (24, 48))), (1, ((0, 6),))]
    np.testing.assert_array_equal(held[1].data, W[:, 24:])
    # Over ``max_bytes`` (the budget's room), None before any host copy; at it, the regions.
    assert state_transfer.held_shards([w, b], max_bytes=W.nbytes) is None  # type: ignore[arg-type]
    assert len(state_transfer.held_shards(  # type: ignore[arg-type]
        [w, b], max_bytes=W.nbytes + B.nbytes) or ()) == 3
    b.addressable_shards[0].replica_id = 0  # owned here: in its snapshot already
    assert [e.leaf for e in state_transfer.held_shards([w, b])] == [0, 0]  # type: ignore[arg-type]


def test_a_held_copy_is_asked_only_for_the_regions_no_snapshot_has():
    """Worker 0's snapshot (columns 0-16 of W, B, the counter) is lost; survivor 2's held
    copy (`held_origin`) has columns 0-32 as replicas. The restore asks worker 1 and 2's
    snapshots for their columns, and the held copy for columns 0-16 alone, each region
    once, and places every leaf exactly."""
    from mnemojax._src.distributed.agreement import held_origin

    def payload(origin, entries):
        return b"".join(bytes(p) for p in pack(4, origin, entries, num_leaves=3))

    cols = {w: ShardEntry(0, W.shape, ((0, 64), (16 * w, 16 * w + 16)),
                          W[:, 16 * w:16 * w + 16]) for w in range(3)}
    held = payload(held_origin(2), [cols[0], cols[1], ShardEntry(1, (6,), ((0, 6),), B),
                                    ShardEntry(2, (), (), np.array(9, np.int32))])
    requests = []
    copies = local_copies({1: payload(1, [cols[1]]), 2: payload(2, [cols[2]]),
                           held_origin(2): held}, 4, requests=requests)
    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices()[:8])
    shardings = [NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P()),
                 NamedSharding(mesh, P())]
    leaves = state_transfer.restore_leaves(copies, shardings, put=JaxDeviceLayer().put)
    np.testing.assert_array_equal(np.asarray(leaves[0]), W)
    np.testing.assert_array_equal(np.asarray(leaves[1]), B)
    assert int(leaves[2]) == 9
    asked = {origin: boxes for origin, boxes in requests}
    assert [o for o, _ in requests] == [1, 2, held_origin(2)]
    held_cols = {index[1] for leaf, index in asked[held_origin(2)] if leaf == 0}
    assert held_cols and all(16 * 0 <= a < b <= 16 for a, b in held_cols)  # never 16-32
    # Every cell of W arrives once: 64 x 48 floats, plus B and the counter.
    assert copies.fetched_bytes == W.nbytes + B.nbytes + 4


def test_local_shards_are_the_owned_shards_of_each_array_given():
    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices()[:8])
    specs = [P("x", "y"), P(), P(None, "y"), P("x", "y")]
    host = [W[:8, :4], B, W[:8, :4] + 1, W[8:16, :4]]  # (leaves 0 and 3: one layout)

    def owned(leaves):
        return [(i, state_transfer.index_of(s.index, x.shape), np.asarray(s.data))
                for i, x in enumerate(leaves) for s in x.addressable_shards
                if s.replica_id == 0]

    for scale in (1, 2):  # the second time from the layouts worked out the first
        leaves = [jax.device_put(h * scale, NamedSharding(mesh, s))
                  for h, s in zip(host, specs, strict=True)]
        got = state_transfer.local_shards(leaves)
        want = owned(leaves)
        assert [(e.leaf, e.index) for e in got] == [(i, index) for i, index, _ in want]
        for e, (_, _, data) in zip(got, want, strict=True):
            assert e.shape == host[e.leaf].shape
            np.testing.assert_array_equal(e.data, data)
    # Every element of every leaf once (replica 0 of each region).
    assert sum(e.data.size for e in got) == sum(h.size for h in host)


def test_packed_shards_are_the_owned_shards_read_from_the_packs():
    from mnemojax._src.compiler import pack_groups, packer
    from mnemojax._src.distributed.snapshot_codec import header_of, unpack
    from mnemojax._src.snapshot import Packed

    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices()[:8])
    # float32 over x and y (leaves 0, 4) and over y (2, 3), int32 replicated (1)
    specs = [P("x", "y"), P(), P(None, "y"), P("y"), P("x", "y")]
    host = [W[:8, :4], B, W[:8, :4] + 1, W[0, :4], W[8:16, :4]]
    leaves = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(host, specs,
                                                                        strict=True)]
    groups = pack_groups(specs, [(x.shape, x.dtype) for x in host], mesh)
    packs = [packer(mesh, [specs[i] for i in m], axes)(*(leaves[i] for i in m))
             for axes, m in groups]
    packed = Packed(packs, [m for _, m in groups])

    entries, data = state_transfer.packed_shards(leaves, packed)
    owned = {(e.leaf, e.index): np.asarray(e.data) for e in state_transfer.local_shards(leaves)}
    assert len(data) < len(owned) == len(entries)  # (one buffer per pack and device)
    assert {(e.leaf, e.index) for e in entries} == set(owned)
    for e in entries:
        np.testing.assert_array_equal(e.data, owned[(e.leaf, e.index)])
    # The header of the entries describes the packs' bytes: a payload decodes to the shards.
    payload = header_of(3, 0, entries, num_leaves=5) + b"".join(bytes(d) for d in data)
    _, decoded = unpack(payload)
    for e in decoded:
        np.testing.assert_array_equal(e.data, owned[(e.leaf, e.index)])

    # Packs that do not hold exactly the owned shards are not read.
    assert state_transfer.packed_shards(leaves, Packed(packs[:1], packed.members[:1])) is None
