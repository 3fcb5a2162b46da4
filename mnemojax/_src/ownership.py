"""Which live resilient step carries which of the user's objects.

A step moves its state to new meshes on its own recoveries, so an NNX variable carried by
two live steps would leave the other running its executable on arrays of a mesh it does
not know. The second step is refused when it is built, before it builds anything.

Owners are held weakly and keyed by ``id()`` of the objects (NNX variables are not all
hashable); the owner's step form holds the objects, so their ids stay valid while the
entry lives. `weak_method` lets a collaborator call back into its step without keeping
the step alive, so an unreferenced step is freed at once and its claim with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

from mnemojax._src.errors import UnsupportedStateError


class Form(Protocol):
    """What is read of a step form: its in-place objects and the leaves' keys."""

    leaf_keys: list[tuple[str, ...]]

    def mutable_objects(self) -> Any: ...


# id(object) -> the live step that carries it.
_owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
# The live step of this process's distributed session (`claim_session`).
_session_step: weakref.ref[Any] | None = None
# Every live step of this process (`enter`), for what one step's recovery reads of the
# others (the mesh they run on: `recovery.DeviceRecovery`).
_live: weakref.WeakSet[Any] = weakref.WeakSet()


def check_unclaimed(owner: object, form: Form) -> None:
    """Refuses the form's objects if another live owner carries one of them.

    Raises:
        UnsupportedStateError: naming the shared object and the other owner.
    """
    objects = form.mutable_objects()
    for obj, key in zip(objects, form.leaf_keys, strict=False):  # none in the pure form
        other = _owners.get(id(obj))
        if other is not None and other is not owner:
            raise UnsupportedStateError(
                f"state {'/'.join(key)} is already carried by another resilient step "
                f"({getattr(other, '__name__', other)!s}); two resilient steps cannot share "
                "a model: make one step of both (a GAN's two updates in one function), run "
                "the second computation (an eval step, say) through the first: "
                "train_step.guard(eval_step), or call other.close() first")


def claim(owner: object, form: Form) -> None:
    """Marks the form's objects as carried by `owner` (see `check_unclaimed`)."""
    for obj in form.mutable_objects():
        _owners[id(obj)] = owner


def claim_session(owner: object) -> None:
    """Makes `owner` the live resilient step of this process's distributed session (under
    ``mnemojax launch``): one at a time. The agents keep one worker's copies by step
    number and a recovery re-forms the world for the step that meets the failure, so a
    second live step would find its own world gone at its next call (a user trial: two
    steps of a GAN ended every survivor with an ``IndexError`` after a kill).

    Raises:
        UnsupportedStateError: naming the other live step.
    """
    global _session_step
    other = _session_step() if _session_step is not None else None
    if other is not None and other is not owner:
        raise UnsupportedStateError(
            f"another resilient step ({getattr(other, '__name__', other)!s}, built "
            "earlier) is live in this process's distributed job: across processes a "
            "process runs one resilient step at a time. Make one step of both (a GAN's "
            "discriminator and generator updates in one function), run work that leaves "
            "the carried state alone (an eval) through the first "
            "(train_step.guard(eval_step)), or call close() on the first")
    _session_step = weakref.ref(owner)


def release(owner: object, *, session: bool = True) -> None:
    """Forgets every claim of `owner` (at its ``close()``); ``session=False``: its
    objects' only (it carries others from now on, stays the session's step and live)."""
    global _session_step
    for key in [k for k, v in _owners.items() if v is owner]:
        _owners.pop(key, None)
    if session:
        _live.discard(owner)
        if _session_step is not None and _session_step() is owner:
            _session_step = None


def enter(owner: object) -> None:
    """Counts `owner` among this process's live steps until its `release`."""
    _live.add(owner)


def others(owner: object) -> list[Any]:
    """This process's live steps other than `owner`."""
    return [step for step in list(_live) if step is not owner]


def weak_method(owner: object, name: str, *, default: Any) -> Callable[[], Any]:
    """``getattr(owner, name)()``, or `default` once `owner` is gone; keeps no reference
    to `owner`."""
    ref = weakref.ref(owner)

    def call() -> Any:
        live = ref()
        return getattr(live, name)() if live is not None else default
    return call
