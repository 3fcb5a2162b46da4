"""Self-describing snapshot payloads of one worker's shards (numpy only, no JAX).

Payload: ``<Q`` metadata length, JSON metadata, zero padding to 64 bytes, then the shards'
bytes. The metadata lists, per shard, the leaf index, the leaf's global shape and dtype, the
shard's index (``[start, stop)`` per dimension) and its byte range. Any survivor can rebuild
global arrays from the payloads of all old workers, whichever mesh they came from.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence

import numpy as np

from mnemojax._src.distributed.errors import SnapshotUnavailableError

_LEN = struct.Struct("<Q")
ALIGN = 64


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One shard: leaf ``leaf`` (global ``shape``), ``index`` = ((start, stop), ...)."""

    leaf: int
    shape: tuple[int, ...]
    index: tuple[tuple[int, int], ...]
    data: np.ndarray


def pack(step: int, worker_id: int, entries: Sequence[ShardEntry]) -> list[memoryview]:
    """Encodes shards as buffers to concatenate (no copy of the shard data here)."""
    meta, offset, datas = [], 0, []
    for e in entries:
        data = np.ascontiguousarray(e.data)
        meta.append({"leaf": e.leaf, "shape": list(e.shape), "dtype": data.dtype.str,
                     "index": [list(i) for i in e.index], "offset": offset,
                     "nbytes": data.nbytes})
        offset += data.nbytes
        datas.append(data)
    head = json.dumps({"step": step, "worker_id": worker_id, "shards": meta}).encode()
    pad = (-(_LEN.size + len(head))) % ALIGN
    prefix = _LEN.pack(len(head)) + head + b"\0" * pad
    return [memoryview(prefix)] + [memoryview(d.reshape(-1).view(np.uint8)) for d in datas]


def unpack(payload: bytes | bytearray | memoryview) -> tuple[dict, list[ShardEntry]]:
    """Decodes a payload into (metadata, entries); entries view the payload (no copy)."""
    view = memoryview(payload)
    (head_len,) = _LEN.unpack_from(view, 0)
    meta = json.loads(bytes(view[_LEN.size:_LEN.size + head_len]))
    base = _LEN.size + head_len
    base += (-base) % ALIGN
    entries = []
    for m in meta["shards"]:
        raw = view[base + m["offset"]:base + m["offset"] + m["nbytes"]]
        shape = tuple(b - a for a, b in m["index"])
        data = np.frombuffer(raw, dtype=np.dtype(m["dtype"])).reshape(shape)
        entries.append(ShardEntry(m["leaf"], tuple(m["shape"]),
                                  tuple(tuple(i) for i in m["index"]), data))
    return meta, entries


def assemble(payloads: Sequence[bytes | bytearray], num_leaves: int) -> list[np.ndarray]:
    """Rebuilds the global value of every leaf from all old workers' payloads.

    Raises:
        SnapshotUnavailableError: the payloads mix steps, or some element of a leaf is in
            no payload (a shard lost every copy).
    """
    out: list[np.ndarray | None] = [None] * num_leaves
    covered: list[np.ndarray | None] = [None] * num_leaves
    steps = set()
    for payload in payloads:
        meta, entries = unpack(payload)
        steps.add(meta["step"])
        for e in entries:
            if out[e.leaf] is None:
                out[e.leaf] = np.zeros(e.shape, e.data.dtype)
                covered[e.leaf] = np.zeros(e.shape, bool)
            sl = tuple(slice(a, b) for a, b in e.index)
            out[e.leaf][sl] = e.data
            covered[e.leaf][sl] = True
    if len(steps) > 1:
        raise SnapshotUnavailableError(f"payloads mix steps {sorted(steps)}")
    missing = [i for i in range(num_leaves) if out[i] is None or not covered[i].all()]
    if missing:
        raise SnapshotUnavailableError(f"leaves {missing} are not fully covered by the payloads")
    return out  # type: ignore[return-value]
