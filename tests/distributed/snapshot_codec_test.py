"""`distributed.snapshot_codec`: self-describing payloads of one worker's shards."""

from __future__ import annotations

import numpy as np
import pytest

from mnemojax._src.distributed.snapshot_codec import (
    HostBlocks,
    ShardEntry,
    dtype_of,
    header,
    header_of,
    pack,
    read_meta,
    select,
    unpack,
)
from mnemojax._src.errors import StateUnavailableError


def _payload(step, worker, entries, num_leaves=2, generation=0):
    return b"".join(bytes(p) for p in pack(step, worker, entries, num_leaves=num_leaves,
                                           generation=generation))


def test_codec_roundtrip_and_blocks_across_workers():
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    b = np.arange(3, dtype=np.int32)
    p0 = _payload(5, 0, [ShardEntry(0, (4, 6), ((0, 4), (0, 3)), w[:, :3]),
                         ShardEntry(1, (3,), ((0, 3),), b)])
    p1 = _payload(5, 1, [ShardEntry(0, (4, 6), ((0, 4), (3, 6)), w[:, 3:])])
    meta, entries = unpack(p0)
    assert meta["step"] == 5 and meta["worker_id"] == 0 and len(entries) == 2
    assert read_meta(p1)["num_leaves"] == 2 and read_meta(p1)["shards"][0]["index"] == [
        [0, 4], [3, 6]]
    pieces = entries + unpack(p1)[1]
    whole = np.asarray(HostBlocks(0, (4, 6), np.dtype(np.float32),
                                  [e for e in pieces if e.leaf == 0]))
    np.testing.assert_array_equal(whole, w)
    counts = np.asarray(HostBlocks(1, (3,), np.dtype(np.int32), [entries[1]]))
    np.testing.assert_array_equal(counts, b)
    assert counts.dtype == np.int32


@pytest.mark.parametrize("payload, match", [
    (b"abc", "no metadata"),
    ((10**6).to_bytes(8, "little") + b"{}", "exceeds the payload"),
    ((2).to_bytes(8, "little") + b"{}", "lacks step"),
])
def test_read_meta_rejects_what_is_not_a_payload(payload, match):
    with pytest.raises(ValueError, match=match):
        read_meta(payload)


W = np.arange(48, dtype=np.float32).reshape(6, 8)


def _two_column_halves_and_a_scalar() -> bytes:
    return _payload(5, 2, [ShardEntry(0, (6, 8), ((0, 6), (0, 4)), W[:, :4]),
                           ShardEntry(0, (6, 8), ((0, 6), (4, 8)), W[:, 4:]),
                           ShardEntry(1, (), (), np.array(7, np.float32))],
                    generation=3)


def test_select_cuts_the_overlaps_of_the_asked_regions_and_header_is_the_metadata():
    p = _two_column_halves_and_a_scalar()
    asked = [(0, ((2, 4), (2, 6))), (0, ((2, 4), (2, 6))), (1, ())]  # a repeat: cut once
    cut = b"".join(bytes(b) for b in select(p, asked))
    meta, entries = unpack(cut)
    assert (meta["step"], meta["worker_id"], meta["generation"], meta["num_leaves"]) == (
        5, 2, 3, 2)
    assert [(e.leaf, e.index) for e in entries] == [
        (0, ((2, 4), (2, 4))), (0, ((2, 4), (4, 6))), (1, ())]
    np.testing.assert_array_equal(entries[0].data, W[2:4, 2:4])
    np.testing.assert_array_equal(entries[1].data, W[2:4, 4:6])
    assert entries[2].data == 7
    assert len(cut) < len(p)
    assert unpack(b"".join(bytes(b) for b in select(p, [])))[1] == []
    head = header(p)
    assert read_meta(head) == read_meta(p) and len(head) < len(p)
    with pytest.raises(ValueError, match="box of leaf 2: the state has 2 leaves"):
        select(p, [(2, ())])
    with pytest.raises(ValueError, match=r"leaf 0: the leaf has shape \(6, 8\)"):
        select(p, [(0, ((0, 6),))])


def test_host_blocks_build_the_regions_asked_for_and_refuse_a_gap():
    _, entries = unpack(b"".join(bytes(b) for b in select(
        _two_column_halves_and_a_scalar(), [(0, ((2, 4), (2, 6))), (1, ())])))
    blocks = HostBlocks(0, (6, 8), np.dtype(np.float32), entries[:2])
    np.testing.assert_array_equal(blocks[2:4, 2:6], W[2:4, 2:6])  # across two pieces
    np.testing.assert_array_equal(blocks[(slice(3, 4), slice(3, 5))], W[3:4, 3:5])
    assert blocks.nbytes == 2 * (2 * 2) * 4  # two 2 x 2 pieces of float32
    with pytest.raises(StateUnavailableError, match=r"leaf 0: .* do not cover the region "
                                                    r"\(\(1, 3\), \(2, 6\)\)"):
        blocks[1:3, 2:6]
    with pytest.raises(TypeError, match="slices"):
        blocks[1]
    scalar = HostBlocks(1, (), np.dtype(np.float32), entries[2:])
    assert np.asarray(scalar) == 7 and np.asarray(scalar).dtype == np.float32
    with pytest.raises(StateUnavailableError, match="leaf 1"):
        HostBlocks(1, (), np.dtype(np.float32), [])[()]


def test_bfloat16_shards_keep_their_dtype_through_select_and_blocks():
    """JAX's bfloat16 is ``V2`` to numpy without ml_dtypes: the payload names it, so a
    restored leaf is bfloat16 again, not raw bytes."""
    import ml_dtypes

    w = np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    p = _payload(1, 0, [ShardEntry(0, (8,), ((0, 8),), w)], num_leaves=1)
    assert read_meta(p)["shards"][0]["dtype"] == "bfloat16"
    [piece] = unpack(b"".join(bytes(b) for b in select(p, [(0, ((2, 6),))])))[1]
    assert piece.data.dtype == w.dtype
    got = HostBlocks(0, (8,), dtype_of("bfloat16"), [piece])[2:6]
    assert got.dtype == w.dtype and got.astype(np.float32).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="unknown dtype 'float9'"):
        dtype_of("float9")


def test_headers_of_one_layout_differ_in_step_and_world_and_follow_the_dtype():
    # (a worker publishes one layout every step: its shards' part is encoded once)
    f32 = [ShardEntry(0, (4,), ((0, 2),), np.zeros(2, np.float32)),
           ShardEntry(1, (2, 2), ((0, 1), (0, 2)), np.zeros((1, 2), np.int32))]
    i64 = [ShardEntry(0, (4,), ((0, 2),), np.zeros(2, np.int64)), f32[1]]
    for step, generation, entries in ((3, 0, f32), (4, 1, f32), (5, 1, i64)):
        meta = read_meta(header_of(step, 2, entries, num_leaves=2, generation=generation))
        assert (meta["step"], meta["generation"], meta["worker_id"]) == (step, generation, 2)
        size = entries[0].data.nbytes
        assert [(s["leaf"], s["dtype"], s["offset"], s["nbytes"]) for s in meta["shards"]] == [
            (0, entries[0].data.dtype.name, 0, size), (1, "int32", size, 8)]
