"""The batches a resilient step keeps for replay after a rollback."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from mnemojax._src.data import HostRows
from mnemojax._src.errors import StateUnavailableError


class ReplayBuffer:
    """Copies of the inputs of the last `capacity` steps, by step number: the global host
    batch and every other input a step needs to run again (a call's `CallInputs`, whose
    tree structure holds its static arguments).

    A recovery that restores an older state (a host snapshot, an agent's copy, an Orbax
    checkpoint) replays the steps since from here, with the same batches, so the math does
    not change. The buffer keeps its own copies (a loader may refill the caller's arrays in
    place), in `capacity` slots whose arrays are reused when the next batch has the same
    structure: no fresh memory per step.
    """

    def __init__(self, capacity: int):
        self._batches: collections.deque[tuple[int, Any]] = collections.deque(maxlen=capacity)
        self._spare: Any = None  # the arrays of a forgotten batch, to copy the next one into

    def append(self, step: int, batch: Any) -> Any:
        """Keeps a copy of `batch` (a pytree of numpy arrays) as the batch of `step`, and
        returns the copy."""
        if len(self._batches) == self._batches.maxlen:
            self._spare = self._batches.popleft()[1]
        kept = _copy_into(self._spare, batch)
        self._spare = None
        self._batches.append((step, kept))
        return kept

    def pop(self) -> None:
        """Forgets the newest batch (a skipped step, or a call that raised)."""
        self._spare = self._batches.pop()[1]

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


def _copy_into(spare: Any, batch: Any) -> Any:
    """A copy of `batch`, written into `spare`'s arrays when they have the same structure,
    shapes and dtypes."""
    if any(isinstance(x, HostRows) for x in jax.tree.leaves(batch)):
        # A per-host batch is read from its source on demand, again after a recovery: it
        # is kept as it is (its rows never change), and its other leaves copied.
        return jax.tree.map(lambda x: x if isinstance(x, HostRows) else np.array(x, copy=True),
                            batch)
    if spare is not None and jax.tree.structure(spare) == jax.tree.structure(batch):
        pairs = list(zip(jax.tree.leaves(spare), jax.tree.leaves(batch), strict=True))
        if all(s.shape == b.shape and s.dtype == b.dtype for s, b in pairs):
            for s, b in pairs:
                np.copyto(s, b)
            return spare
    return jax.tree.map(lambda x: np.array(x, copy=True), batch)


def batch_struct(batch: Any, examples: int | None) -> Any:
    """The batch's shapes and dtypes, cut to `examples` along the leading axis (a plan of
    ``batch_policy='truncate_batch'`` uses fewer examples per step)."""
    def struct(x):
        shape = x.shape if not x.ndim or examples is None else (examples, *x.shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype)
    return jax.tree.map(struct, batch)
