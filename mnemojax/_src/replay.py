"""The batches a resilient step keeps for replay after a rollback."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from mnemojax._src.data import HostRows
from mnemojax._src.errors import StateUnavailableError
from mnemojax._src.step_forms import batch_splits, example_axes


class ReplayBuffer:
    """Copies of the inputs of the last `capacity` steps, by step number: the global host
    batch and every other input a step needs to run again (a call's `CallInputs`, whose
    tree structure holds its static arguments).

    A recovery that restores an older state (a host snapshot, an agent's copy, an Orbax
    checkpoint) replays the steps since from here, with the same batches, so the math does
    not change. The buffer keeps its own copies (a loader may refill the caller's arrays in
    place), each in fresh arrays that nothing writes again: the copy is what gets placed
    on the devices, and JAX may keep using a host array it was given (on jaxlib 0.10.2
    CPU, a second ``device_put`` of the same float64 array onto a multi-device sharding,
    refilled in place, returns the first put's values while that result lives; measured,
    `tests/replay_test.py`). Slots reused in place made a recovered multi-process run
    silently train on a stale batch every ``capacity`` steps.
    """

    def __init__(self, capacity: int):
        self._batches: collections.deque[tuple[int, Any]] = collections.deque(maxlen=capacity)

    def append(self, step: int, batch: Any) -> Any:
        """Keeps a copy of `batch` (a pytree of numpy arrays) as the batch of `step`, and
        returns the copy (fresh arrays, never written again)."""
        kept = _copy(batch)
        self._batches.append((step, kept))
        return kept

    def pop(self) -> None:
        """Forgets the newest batch (a skipped step, or a call that raised)."""
        self._batches.pop()

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return iter(list(self._batches))

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def first_step(self) -> int | None:
        """The oldest step whose batch is kept."""
        return self._batches[0][0] if self._batches else None

    @property
    def last(self) -> Any:
        """The newest batch."""
        return self._batches[-1][1]

    def batch(self, step: int) -> Any:
        for s, b in self._batches:
            if s == step:
                return b
        raise StateUnavailableError(f"the batch of step {step} is no longer kept for replay")

    def check_replayable(self, source_step: int, step: int, what: str,
                         cause: BaseException | None = None) -> None:
        """Raises `StateUnavailableError` unless the batches of steps ``source_step + 1 ..
        step - 1`` are kept (so `what`, a state of `source_step`, can be replayed up to
        `step`)."""
        kept = {s for s, _ in self._batches}
        missing = [s for s in range(source_step + 1, step) if s not in kept]
        if missing:
            raise StateUnavailableError(
                f"{what} is of step {source_step}, but the batches of steps "
                f"{missing[0]}..{missing[-1]} are no longer kept for replay") from cause


def _copy(batch: Any) -> Any:
    """A copy of `batch` in fresh arrays. A per-host batch's `HostRows` are read from their
    source on demand, again after a recovery: kept as they are (their rows never change)."""
    return jax.tree.map(lambda x: x if isinstance(x, HostRows) else np.array(x, copy=True),
                        batch)


def batch_struct(batch: Any, examples: int | None) -> Any:
    """The batch's shapes and dtypes, cut to `examples` along each leaf's example axis (a
    plan of ``batch_policy='truncate_batch'`` uses fewer examples per step)."""
    def struct(x, split, axis):
        shape = tuple(x.shape)
        if split and examples is not None:
            shape = (*shape[:axis], examples, *shape[axis + 1:])
        return jax.ShapeDtypeStruct(shape, x.dtype)
    return jax.tree.map(struct, batch, batch_splits(batch), example_axes(batch))
