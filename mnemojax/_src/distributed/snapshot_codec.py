"""Self-describing snapshot payloads of one worker's shards (numpy only, no JAX).

Payload: ``<Q`` metadata length, JSON metadata, zero padding to 64 bytes, then the shards'
bytes. The metadata holds the step, the worker, the world generation, the number of leaves of
the whole state and, per shard, the leaf index, the leaf's global shape and dtype, the shard's
index (``[start, stop)`` per dimension) and its byte range, so a survivor on any mesh can take
the regions it needs: an agent cuts them out of a copy (`select`) and the survivor builds its
devices' blocks from the pieces (`HostBlocks`). `read_meta` reads only the metadata
(`header`), so an agent can say what a copy covers without decoding the shards.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from mnemojax._src.errors import StateUnavailableError

_LEN = struct.Struct("<Q")
ALIGN = 64


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One shard: leaf ``leaf`` (global ``shape``), ``index`` = ((start, stop), ...).

    ``data``: a host array; or, to be packed, any array with ``dtype`` and ``nbytes``
    that numpy can read (a device array is copied to the host by `data_views`)."""

    leaf: int
    shape: tuple[int, ...]
    index: tuple[tuple[int, int], ...]
    data: Any


def pack(step: int, worker_id: int, entries: Sequence[ShardEntry], *,
         num_leaves: int, generation: int = 0) -> list[memoryview]:
    """Encodes shards as buffers to concatenate (no copy of host shard data here): the
    `header` and the `data_views`.

    Args:
        num_leaves: leaves in the whole state (a worker may hold shards of only some).
        generation: the world that produced the shards (one mesh per world, so the shards
            of one step and generation tile each leaf without partial overlaps).
    """
    return [memoryview(header_of(step, worker_id, entries, num_leaves=num_leaves,
                                 generation=generation)), *data_views(entries)]


# The shards' part of a header per layout (what `header_of` encodes of them), encoded once:
# a worker publishes the same layout every step, and its JSON cost ~5 us per shard.
_SHARDS_JSON: dict[tuple, str] = {}
_SHARDS_JSON_MAX = 256


def _shards_json(entries: Sequence[ShardEntry]) -> str:
    layout = tuple((e.leaf, e.shape, e.index, e.data.dtype) for e in entries)
    text = _SHARDS_JSON.get(layout)
    if text is None:
        meta, offset = [], 0
        for e in entries:
            nbytes = int(e.data.nbytes)
            meta.append({"leaf": e.leaf, "shape": list(e.shape),
                         "dtype": np.dtype(e.data.dtype).name,
                         "index": [list(i) for i in e.index], "offset": offset,
                         "nbytes": nbytes})
            offset += nbytes
        if len(_SHARDS_JSON) >= _SHARDS_JSON_MAX:
            _SHARDS_JSON.clear()
        text = _SHARDS_JSON[layout] = json.dumps(meta)
    return text


def header_of(step: int, worker_id: int, entries: Sequence[ShardEntry], *,
              num_leaves: int, generation: int = 0) -> bytes:
    """A payload's metadata prefix (`pack`), from the shards' sizes and dtypes alone: a
    device array's data is not read."""
    fixed = json.dumps({"step": step, "worker_id": worker_id, "num_leaves": num_leaves,
                        "generation": generation})
    head = f'{fixed[:-1]}, "shards": {_shards_json(entries)}}}'.encode()
    pad = (-(_LEN.size + len(head))) % ALIGN
    return _LEN.pack(len(head)) + head + b"\0" * pad


def data_views(entries: Sequence[ShardEntry]) -> list[memoryview]:
    """The shards' bytes, in `header_of`'s order: views of host arrays (a device array is
    read to the host here; on CPU that is a view of its buffer too)."""
    return [np.ascontiguousarray(e.data).reshape(-1).view(np.uint8).data for e in entries]


def dtype_of(name: str) -> np.dtype:
    """A payload's dtype from its name: numpy's, or one of JAX's extra types (bfloat16,
    float8, int4: `ml_dtypes`, which numpy alone knows only as raw ``V2`` bytes).

    Raises:
        ValueError: no such dtype.
    """
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # registers its types with numpy (a JAX dependency; no JAX import)

        try:
            return np.dtype(getattr(ml_dtypes, name, name))
        except TypeError:
            raise ValueError(f"a snapshot payload names an unknown dtype {name!r}") from None


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
        data = np.frombuffer(raw, dtype=dtype_of(m["dtype"])).reshape(shape)
        entries.append(ShardEntry(m["leaf"], tuple(m["shape"]),
                                  tuple(tuple(i) for i in m["index"]), data))
    return meta, entries


Index = tuple[tuple[int, int], ...]  # ((start, stop), ...) per dimension
Box = tuple[int, Index]  # (leaf, index): a region of one leaf


def overlap(a: Index, b: Index) -> Index | None:
    """The region two regions of one leaf share, or None (``()`` for a 0-d leaf)."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def index_of(slices: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A region given as slices (a shard's ``index``, or what ``make_array_from_callback``
    asks for; missing trailing dimensions are whole) as ``((start, stop), ...)``.

    Raises:
        TypeError: a slice with a stride.
    """
    out = []
    for i, n in enumerate(shape):
        start, stop, stride = (slices[i] if i < len(slices) else slice(None)).indices(n)
        if stride != 1:
            raise TypeError(f"region {slices!r} has stride {stride}")
        out.append((start, max(start, stop)))
    return tuple(out)


def _within(part: Index, region: Index) -> tuple[slice, ...]:
    """Slices that take ``part`` out of an array holding ``region`` (which contains it)."""
    return tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(part, region, strict=True))


def header(payload: bytes | bytearray | memoryview) -> bytes:
    """The payload's metadata part alone (what `read_meta` reads): what a copy covers,
    without its data.

    Raises:
        ValueError: the payload does not start with valid metadata.
    """
    read_meta(payload)
    (head_len,) = _LEN.unpack_from(payload, 0)
    return bytes(memoryview(payload)[:_LEN.size + head_len])


def select(payload: bytes | bytearray | memoryview, boxes: Sequence[Box]) -> list[memoryview]:
    """The parts of ``payload`` inside ``boxes``, encoded as a payload (`pack`) of the same
    step, worker and world: for each of its shards and each box of that shard's leaf that
    overlaps it, the overlap. A survivor asks its sources for the regions its devices hold
    on the new mesh, so it receives only those (the whole state only when its devices
    hold all of it, as with replicated leaves).

    Raises:
        ValueError: the payload does not start with valid metadata, or a box names a leaf
            the state does not have or has the wrong rank.
    """
    meta, entries = unpack(payload)
    wanted: dict[int, list[Index]] = {}
    for leaf, index in dict.fromkeys(
            (int(leaf), tuple((int(a), int(b)) for a, b in index)) for leaf, index in boxes):
        if not 0 <= leaf < meta["num_leaves"]:
            raise ValueError(f"box of leaf {leaf}: the state has {meta['num_leaves']} leaves")
        wanted.setdefault(leaf, []).append(index)
    out = []
    for e in entries:
        for index in wanted.get(e.leaf, ()):
            if len(index) != len(e.shape):
                raise ValueError(f"box {index} of leaf {e.leaf}: the leaf has shape {e.shape}")
            part = overlap(e.index, index)
            if part is None:
                continue
            out.append(ShardEntry(e.leaf, e.shape, part, e.data[_within(part, e.index)]))
    return pack(meta["step"], meta.get("worker_id", -1), out, num_leaves=meta["num_leaves"],
                generation=meta.get("generation", 0))


class HostBlocks:
    """One leaf of the agreed state as the pieces fetched for this process's devices
    (`select` replies): it has the leaf's global ``shape`` and ``dtype``, and indexing it
    with a device's index (slices, as ``jax.make_array_from_callback`` asks) builds that
    block from the pieces. The whole leaf is never assembled unless asked for.

    Raises (on indexing):
        StateUnavailableError: the pieces do not cover the region asked for.
    """

    __slots__ = ("leaf", "shape", "dtype", "_pieces")

    def __init__(self, leaf: int, shape: tuple[int, ...], dtype: np.dtype,
                 pieces: Sequence[ShardEntry]):
        self.leaf, self.shape, self.dtype = leaf, tuple(shape), np.dtype(dtype)
        self._pieces = list(pieces)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.ndim or not all(isinstance(s, slice) for s in index):
            raise TypeError(f"HostBlocks of leaf {self.leaf} takes slices per dimension, "
                            f"got {index!r}")
        box = index_of(index, self.shape)
        out = np.empty(tuple(b - a for a, b in box), self.dtype)
        covered = np.zeros(out.shape, bool)
        for p in self._pieces:
            part = overlap(p.index, box)
            if part is None:
                continue
            dst = _within(part, box)
            out[dst] = p.data[_within(part, p.index)]
            covered[dst] = True
        if out.size and not covered.all():
            raise StateUnavailableError(
                f"leaf {self.leaf}: the fetched copies do not cover the region {box} of "
                f"shape {self.shape} (pieces held: {[p.index for p in self._pieces][:16]})")
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        del copy  # a fresh array either way
        out = self[tuple(slice(None) for _ in self.shape)]
        return out if dtype is None else out.astype(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the pieces held."""
        return sum(p.data.nbytes for p in self._pieces)

    def __repr__(self) -> str:
        return f"HostBlocks(leaf={self.leaf}, shape={self.shape}, dtype={self.dtype})"
