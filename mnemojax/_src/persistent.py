"""The persistent tier: plain Orbax checkpoints, the last resort after host memory.

A checkpoint is an Orbax `CheckpointManager` step directory with two items:

* ``state``: the training state as a nested dict of arrays (for the NNX form
  ``{"model": ..., "optimizer": ...}`` mirroring ``nnx.state``), saved with
  `ocp.args.StandardSave`, so any Orbax user can restore it without mnemojax;
* ``mnemojax``: JSON with the step and every leaf's path, shape and dtype, checked on
  restore so a checkpoint of another model is refused with a typed error.

Saves are asynchronous (Orbax copies to host, then writes in the background); Orbax's
commit marker makes a step visible only when complete, so a crash mid-save leaves the
previous checkpoint as the latest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mnemojax._src.errors import CheckpointMismatchError

log = logging.getLogger("mnemojax")

Key = tuple[str, ...]


def nest(keys: Sequence[Key], leaves: Sequence[Any]) -> dict[str, Any]:
    """Nested dict with `leaves` placed at `keys`."""
    out: dict[str, Any] = {}
    for key, leaf in zip(keys, leaves, strict=True):
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = leaf
    return out


def unnest(keys: Sequence[Key], tree: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for key in keys:
        node = tree
        for part in key:
            node = node[part]
        out.append(node)
    return out


class PersistentTier:
    """Orbax checkpoints of the flat state leaves (see module docstring)."""

    def __init__(self, directory: str, *, keys: Sequence[Key], max_to_keep: int):
        import orbax.checkpoint as ocp  # lazily: only jobs with a persistent tier need it

        self._ocp = ocp
        self.directory = Path(directory).expanduser().resolve()
        self._keys = [tuple(k) for k in keys]
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "mnemojax"),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                 enable_async_checkpointing=True))
        self.last_saved_step: int | None = None

    def _describe(self, leaves: Sequence[Any]) -> list[dict[str, Any]]:
        return [{"path": "/".join(k), "shape": list(np.shape(x)), "dtype": str(x.dtype)}
                for k, x in zip(self._keys, leaves, strict=True)]

    def save(self, step: int, leaves: Sequence[Any], *, wait: bool = False) -> float:
        """Starts saving the state after `step`; returns the seconds the caller was blocked.

        With `wait`, returns only once the checkpoint is committed on disk.
        """
        if step == self.last_saved_step:
            if wait:
                self._manager.wait_until_finished()
            return 0.0
        t0 = time.perf_counter()
        ocp = self._ocp
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(nest(self._keys, leaves)),
            mnemojax=ocp.args.JsonSave({"step": step, "leaves": self._describe(leaves)})))
        if wait:
            self._manager.wait_until_finished()
        self.last_saved_step = step
        return time.perf_counter() - t0

    def latest_step(self) -> int | None:
        self._manager.wait_until_finished()
        self._manager.reload()
        return self._manager.latest_step()

    def restore(self, step: int, shardings: Sequence[jax.sharding.Sharding],
                structs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[jax.Array]:
        """Restores checkpoint `step` onto `shardings` (any mesh); checks it is ours."""
        ocp = self._ocp
        meta = self._manager.restore(step, args=ocp.args.Composite(
            mnemojax=ocp.args.JsonRestore()))["mnemojax"]
        want = [{"path": "/".join(k), "shape": list(shape), "dtype": str(np.dtype(dtype))}
                for k, (shape, dtype) in zip(self._keys, structs, strict=True)]
        if meta["leaves"] != want:
            raise CheckpointMismatchError(_mismatch(meta["leaves"], want, self.directory, step))
        abstract = nest(self._keys, [
            jax.ShapeDtypeStruct(shape, dtype, sharding=s)
            for (shape, dtype), s in zip(structs, shardings, strict=True)])
        state = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
        return unnest(self._keys, state)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _mismatch(saved: list[dict[str, Any]], want: list[dict[str, Any]], directory: Path,
              step: int) -> str:
    where = f"checkpoint {directory}/{step}"
    if len(saved) != len(want):
        return (f"{where} holds {len(saved)} state leaves; this model has {len(want)}: it "
                "belongs to another model")
    for s, w in zip(saved, want, strict=True):
        if s != w:
            return (f"{where} belongs to another model: leaf {s['path']} is "
                    f"{s['dtype']}{s['shape']}, this model has {w['path']} "
                    f"{w['dtype']}{w['shape']}")
    return f"{where} does not match this model"
