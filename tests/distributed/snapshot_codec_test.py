"""`distributed.snapshot_codec`: self-describing payloads of one worker's shards."""

from __future__ import annotations

import numpy as np
import pytest

from mnemojax._src.distributed.snapshot_codec import (
    ShardEntry,
    assemble,
    pack,
    read_meta,
    unpack,
)
from mnemojax._src.errors import StateUnavailableError


def _payload(step, worker, entries, num_leaves=2, generation=0):
    return b"".join(bytes(p) for p in pack(step, worker, entries, num_leaves=num_leaves,
                                           generation=generation))


def test_codec_roundtrip_and_assemble_across_workers():
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    b = np.arange(3, dtype=np.int32)
    p0 = _payload(5, 0, [ShardEntry(0, (4, 6), ((0, 4), (0, 3)), w[:, :3]),
                         ShardEntry(1, (3,), ((0, 3),), b)])
    p1 = _payload(5, 1, [ShardEntry(0, (4, 6), ((0, 4), (3, 6)), w[:, 3:])])
    meta, entries = unpack(p0)
    assert meta["step"] == 5 and meta["worker_id"] == 0 and len(entries) == 2
    assert read_meta(p1)["num_leaves"] == 2 and read_meta(p1)["shards"][0]["index"] == [
        [0, 4], [3, 6]]
    full = assemble([p0, p1], 2)
    np.testing.assert_array_equal(full[0], w)
    np.testing.assert_array_equal(full[1], b)
    assert full[1].dtype == np.int32


def test_assemble_refuses_missing_shards_and_mixed_steps():
    w = np.ones((4,), np.float32)
    half = _payload(5, 0, [ShardEntry(0, (4,), ((0, 2),), w[:2])], num_leaves=1)
    with pytest.raises(StateUnavailableError, match="not fully covered"):
        assemble([half], 1)
    other = _payload(6, 1, [ShardEntry(0, (4,), ((2, 4),), w[2:])], num_leaves=1)
    with pytest.raises(StateUnavailableError, match="mix steps"):
        assemble([half, other], 1)


@pytest.mark.parametrize("payload, match", [
    (b"abc", "no metadata"),
    ((10**6).to_bytes(8, "little") + b"{}", "exceeds the payload"),
    ((2).to_bytes(8, "little") + b"{}", "lacks step"),
])
def test_read_meta_rejects_what_is_not_a_payload(payload, match):
    with pytest.raises(ValueError, match=match):
        read_meta(payload)
