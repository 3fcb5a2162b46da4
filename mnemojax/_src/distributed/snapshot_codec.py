"""Self-describing snapshot payloads of one worker's shards (numpy only, no JAX).

Payload: ``<Q`` metadata length, JSON metadata, zero padding to 64 bytes, then the shards'
bytes. The metadata holds the step, the worker, the world generation, the number of leaves of
the whole state and, per shard, the leaf index, the leaf's global shape and dtype, the shard's
index (``[start, stop)`` per dimension) and its byte range. Any survivor can rebuild global arrays
from payloads whose shards cover every leaf, whichever mesh they came from; `read_meta` reads
only the metadata, so an agent can say what a copy covers without decoding the shards.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence

import numpy as np

from mnemojax._src.errors import StateUnavailableError

_LEN = struct.Struct("<Q")
ALIGN = 64


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One shard: leaf ``leaf`` (global ``shape``), ``index`` = ((start, stop), ...)."""

    leaf: int
    shape: tuple[int, ...]
    index: tuple[tuple[int, int], ...]
    data: np.ndarray


def pack(step: int, worker_id: int, entries: Sequence[ShardEntry], *,
         num_leaves: int, generation: int = 0) -> list[memoryview]:
    """Encodes shards as buffers to concatenate (no copy of the shard data here).

    Args:
        num_leaves: leaves in the whole state (a worker may hold shards of only some).
        generation: the world that produced the shards (one mesh per world, so the shards
            of one step and generation tile each leaf without partial overlaps).
    """
    meta, offset, datas = [], 0, []
    for e in entries:
        data = np.ascontiguousarray(e.data)
        meta.append({"leaf": e.leaf, "shape": list(e.shape), "dtype": data.dtype.str,
                     "index": [list(i) for i in e.index], "offset": offset,
                     "nbytes": data.nbytes})
        offset += data.nbytes
        datas.append(data)
    head = json.dumps({"step": step, "worker_id": worker_id, "num_leaves": num_leaves,
                       "generation": generation, "shards": meta}).encode()
    pad = (-(_LEN.size + len(head))) % ALIGN
    prefix = _LEN.pack(len(head)) + head + b"\0" * pad
    return [memoryview(prefix)] + [memoryview(d.reshape(-1).view(np.uint8)) for d in datas]


def read_meta(payload: bytes | bytearray | memoryview) -> dict:
    """The metadata of a payload (step, worker_id, num_leaves, shards) without its data.

    Raises:
        ValueError: the payload does not start with valid metadata.
    """
    view = memoryview(payload)
    if len(view) < _LEN.size:
        raise ValueError(f"a payload of {len(view)} bytes has no metadata")
    (head_len,) = _LEN.unpack_from(view, 0)
    if _LEN.size + head_len > len(view):
        raise ValueError(f"metadata length {head_len} exceeds the payload ({len(view)} bytes)")
    meta = json.loads(bytes(view[_LEN.size:_LEN.size + head_len]))
    if not isinstance(meta, dict) or not {"step", "num_leaves", "shards"} <= set(meta):
        raise ValueError("the payload metadata lacks step, num_leaves or shards")
    return meta


def unpack(payload: bytes | bytearray | memoryview) -> tuple[dict, list[ShardEntry]]:
    """Decodes a payload into (metadata, entries); entries view the payload (no copy)."""
    view = memoryview(payload)
    meta = read_meta(view)
    (head_len,) = _LEN.unpack_from(view, 0)
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
        StateUnavailableError: the payloads mix steps, or some element of a leaf is in
            no payload (a shard lost every copy).
    """
    out: dict[int, np.ndarray] = {}
    covered: dict[int, np.ndarray] = {}
    steps = set()
    for payload in payloads:
        meta, entries = unpack(payload)
        steps.add(meta["step"])
        for e in entries:
            if e.leaf not in out:
                out[e.leaf] = np.zeros(e.shape, e.data.dtype)
                covered[e.leaf] = np.zeros(e.shape, bool)
            sl = tuple(slice(a, b) for a, b in e.index)
            out[e.leaf][sl] = e.data
            covered[e.leaf][sl] = True
    if len(steps) > 1:
        raise StateUnavailableError(f"payloads mix steps {sorted(steps)}")
    missing = [i for i in range(num_leaves) if i not in out or not covered[i].all()]
    if missing:
        raise StateUnavailableError(f"leaves {missing} are not fully covered by the payloads")
    return [out[i] for i in range(num_leaves)]
