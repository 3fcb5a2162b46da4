"""Per-host data: each process reads only the rows of the global batch its devices hold.

Multi-host input pipelines give each process a slice of the global batch (Grain's
``ShardByJaxProcess``, tf.data's ``shard``). Under mnemojax the slice a process feeds
changes with the world: after a loss the survivors take over the lost slices, so the global
batch, and with it the math, stays the same. A fixed per-process shard cannot do that; a
source addressed by record index can.

`HostBatches` turns a random-access record source (a Grain ``MapDataset``, an ArrayRecord
data source, any sequence of records) into global batches whose leaves are `HostRows`:
array-likes of the global shape that read records only when indexed. The resilient step
places them with ``jax.make_array_from_callback``, which asks each process only for the
rows of its own devices. So a process reads its own slice, and after a recovery (replayed
steps included) the rows its devices hold on the new mesh.

The protocol, for loaders other than Grain's: example ``i`` of step ``k``'s global batch is
record ``(k - 1) * global_batch_size + i`` (steps count from 1, as the resilient step's
do), and ``source[index]`` returns it: a pytree of arrays or numbers whose shapes and
dtypes are the same for every record. ``source[index]`` must be a pure function of
``index``, the same on every process: after a loss another process reads the row again
(seed any augmentation by the index, as Grain's ``random_map`` with a seed does). The iterator's state is the number of batches handed out
(`HostBatches.get_state`): a snapshot or checkpoint of step ``k`` goes with the state after
``k`` batches, so a process that restarts (``ResilientStep.restore`` returns ``k``) starts
its loader with ``start=k``.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import jax
import numpy as np

from mnemojax._src.errors import BatchSplitError, InvalidOptionError

ROWS_READ_KEPT = 1024  # steps whose count of records read `HostBatches.rows_read` keeps


class RecordSource(Protocol):
    """Random access to records: a Grain ``MapDataset``, a data source, a list."""

    def __getitem__(self, index: int, /) -> Any: ...


class _StepRows:
    """One step's global batch: reads row ranges of it on demand and keeps what it read
    (a replay after a recovery asks again, for the rows of the new mesh)."""

    def __init__(self, batches: HostBatches, step: int):
        self._batches = batches
        self.step = step
        self._first = (step - 1) * batches.global_batch_size
        self._read: dict[tuple[int, int], list[np.ndarray]] = {}
        self._lock = threading.Lock()  # make_array_from_callback may call from threads

    def leaves(self, start: int, stop: int) -> list[np.ndarray]:
        """The record leaves of rows [start, stop), stacked (read-only: kept for a replay)."""
        with self._lock:
            got = self._read.get((start, stop))
            if got is None:
                got = self._batches.read(self.step, self._first + start, self._first + stop)
                for leaf in got:
                    leaf.setflags(write=False)
                self._read[start, stop] = got
            return got


class HostRows:
    """One leaf of a step's global batch, read lazily: it has the global ``shape`` and
    ``dtype``, and indexing it reads only the rows asked for.

    ``np.asarray(rows)`` reads every row (one process that holds every device needs them
    all). What indexing returns is read-only (the rows are kept for a replay); ``np.array``
    copies.
    """

    __slots__ = ("_rows", "_leaf", "shape", "dtype")

    def __init__(self, rows: _StepRows, leaf: int, shape: tuple[int, ...], dtype: np.dtype):
        self._rows = rows
        self._leaf = leaf
        self.shape = shape
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def step(self) -> int:
        """The step whose batch this is."""
        return self._rows.step

    def __len__(self) -> int:
        return self.shape[0]

    def head(self, n: int) -> HostRows:
        """The first `n` rows, still unread (``batch_policy='truncate_batch'``)."""
        return HostRows(self._rows, self._leaf, (min(n, self.shape[0]), *self.shape[1:]),
                        self.dtype)

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        first, rest = (index[0], index[1:]) if index else (slice(None), ())
        if isinstance(first, slice):
            start, stop, stride = first.indices(self.shape[0])
            if stride == 1:
                return self._read(start, max(start, stop))[(slice(None), *rest)]
        elif first is not None and first is not Ellipsis and not isinstance(
                first, bool | np.bool_ | np.ndarray | list):
            i = operator.index(first)
            i = i + self.shape[0] if i < 0 else i
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"row {first} of a batch of {self.shape[0]} examples")
            return self._read(i, i + 1)[(0, *rest)]
        return np.asarray(self)[index]  # anything else: read the whole batch

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = self._read(0, self.shape[0])
        if dtype is not None and np.dtype(dtype) != out.dtype:
            return out.astype(dtype)
        return out.copy() if copy else out

    def _read(self, start: int, stop: int) -> np.ndarray:
        return self._rows.leaves(start, stop)[self._leaf]

    def __repr__(self) -> str:
        return f"HostRows(step={self.step}, shape={self.shape}, dtype={self.dtype})"


class HostBatches:
    """Global batches from a random-access record source, read per host.

    Iterating yields step ``start + 1``'s batch, then the next: the record structure with a
    `HostRows` leaf per record leaf, each of shape ``(global_batch_size, *leaf shape)``.
    Pass it to a ``@mnemojax.resilient`` step as the global batch; each process reads only
    the rows its devices hold on the current mesh.

    Args:
        source: the records (see the module docstring for the protocol), e.g.
            ``grain.MapDataset.source(...).shuffle(seed=0).repeat()``.
        global_batch_size: examples per step, over all processes.
        start: batches already consumed: the step ``ResilientStep.restore`` returned.
        steps: stop after this step (default: the end of a finite source; a last batch
            the source cannot fill is dropped).

    Raises:
        InvalidOptionError: a size or count that is not a positive (start, steps:
            non-negative) int.

    Example:
        >>> start = step.restore(model, optimizer)  # doctest: +SKIP
        >>> for batch in HostBatches(dataset, 256, start=start):  # doctest: +SKIP
        ...     step(model, optimizer, batch)
    """

    def __init__(self, source: RecordSource, global_batch_size: int, *, start: int = 0,
                 steps: int | None = None):
        _check_int("global_batch_size", global_batch_size, low=1)
        _check_int("start", start, low=0)
        if steps is not None:
            _check_int("steps", steps, low=0)
        if not hasattr(source, "__getitem__"):
            raise InvalidOptionError(
                f"HostBatches reads records by index, and source is a "
                f"{type(source).__name__}, which has none (a Grain IterDataset streams): "
                "give a random-access source (a Grain MapDataset, a list, an array)")
        self.source = source
        self.global_batch_size = global_batch_size
        self._next = start + 1
        self._last = steps
        try:
            size = len(source)  # pyright: ignore[reportArgumentType]
        except TypeError:
            size = None
        if size is not None:
            whole = size // global_batch_size
            self._last = whole if self._last is None else min(self._last, whole)
        self._structure: tuple[Any, list[tuple[tuple[int, ...], np.dtype]]] | None = None
        self._rows_read: dict[int, int] = {}  # step -> records read (`rows_read`)
        self._rows_lock = threading.Lock()  # placement may read from several threads

    # -- the iterator and its state --------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._last is not None and self._next > self._last:
            raise StopIteration
        batch = self.batch(self._next)
        self._next += 1
        return batch

    def get_state(self) -> dict[str, int]:
        """JSON-able: the batches handed out (the step of the last one)."""
        return {"step": self._next - 1, "global_batch_size": self.global_batch_size}

    def set_state(self, state: dict[str, int]) -> None:
        """Continues after the state's step.

        Raises:
            BatchSplitError: the state is of another global batch size (its steps index
                other records).
        """
        if state.get("global_batch_size", self.global_batch_size) != self.global_batch_size:
            raise BatchSplitError(
                f"the loader state has global_batch_size={state['global_batch_size']}, this "
                f"loader {self.global_batch_size}: its steps index other records")
        _check_int("state['step']", state["step"], low=0)
        self._next = state["step"] + 1

    # -- batches ---------------------------------------------------------------------------
    def batch(self, step: int) -> Any:
        """Step `step`'s global batch (steps count from 1), unread."""
        _check_int("step", step, low=1)
        treedef, leaves = self._record_structure()
        rows = _StepRows(self, step)
        return jax.tree.unflatten(treedef, [
            HostRows(rows, i, (self.global_batch_size, *shape), dtype)
            for i, (shape, dtype) in enumerate(leaves)])

    @property
    def rows_read(self) -> dict[int, int]:
        """Records this process read, per step, for the `ROWS_READ_KEPT` highest steps
        read (for tests and figures: a process that reads its slice reads
        global_batch_size / processes rows per step)."""
        with self._rows_lock:
            return dict(self._rows_read)

    def read(self, step: int, first: int, stop: int) -> list[np.ndarray]:
        """Records [first, stop) of the source, stacked per leaf."""
        with self._rows_lock:
            self._rows_read[step] = self._rows_read.get(step, 0) + stop - first
            if len(self._rows_read) > ROWS_READ_KEPT:
                del self._rows_read[min(self._rows_read)]
        treedef, want = self._record_structure()
        columns: list[list[np.ndarray]] = [[] for _ in want]
        for index in range(first, stop):
            leaves, tree = jax.tree.flatten(self._record(index))
            if tree != treedef or len(leaves) != len(want):
                raise BatchSplitError(f"record {index} has the structure {tree}, record 0 "
                                      f"{treedef}: every record needs the same")
            for column, leaf, (shape, dtype) in zip(columns, leaves, want, strict=True):
                leaf = np.asarray(leaf)
                if leaf.shape != shape or leaf.dtype != dtype:
                    raise BatchSplitError(
                        f"record {index} has a leaf of shape {leaf.shape} and dtype "
                        f"{leaf.dtype}, record 0 {shape} and {dtype}: every record needs the "
                        "same shapes and dtypes")
                column.append(leaf)
        return [np.stack(column).astype(dtype, copy=False) if column
                else np.empty((0, *shape), dtype)
                for column, (shape, dtype) in zip(columns, want, strict=True)]

    def _record(self, index: int) -> Any:
        """Record `index` of the source.

        Raises:
            BatchSplitError: the source has None there (a Grain ``filter`` leaves None
                where it drops a record).
        """
        record = self.source[index]
        if record is None:
            raise BatchSplitError(
                f"record {index} of the source is None (a Grain MapDataset's filter() "
                "leaves None where it drops a record): every index must hold a record; "
                "drop records before they get indices, or replace them in a map()")
        return record

    def _record_structure(self) -> tuple[Any, list[tuple[tuple[int, ...], np.dtype]]]:
        """The records' tree structure and leaf (shape, dtype), from record 0."""
        if self._structure is None:
            leaves, treedef = jax.tree.flatten(self._record(0))
            arrays = [np.asarray(x) for x in leaves]
            self._structure = treedef, [(a.shape, a.dtype) for a in arrays]
        return self._structure


def _check_int(name: str, value: Any, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise InvalidOptionError(f"{name} must be an int >= {low}, got {value!r}")
