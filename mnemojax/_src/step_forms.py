"""Step forms: how a user's call maps onto one pure function on a flat list of arrays.

* Flax NNX: ``step(model, optimizer, batch) -> metrics``, updating both in place.
* Pure: ``step(state, batch) -> (state, metrics)`` on any pytree of arrays.

The runtime only ever sees the `StepForm` interface: ``split_call(args)`` separates a
call's state arguments from its batch, ``state_of(state_args)`` reads the state leaves out
of them, ``pure(leaves, batch) -> (leaves, metrics)`` is what gets compiled, and
``result(state_args, leaves, metrics)`` hands the new state back the way the user's step would have (in place for NNX, returned for the pure
form). It never asks which form it holds. The leaves are what gets sharded, snapshotted and
resharded; typed PRNG keys travel as their raw key data so every leaf is a plain numeric
array.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mnemojax._src.errors import UnsupportedStateError


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_raw(x):
    return jax.random.key_data(x) if _is_key(x) else x


def _leaf_path(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def _key_part(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaf_key(path, top_names: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A leaf's path as strings, for nested-dict checkpoints (top level renamed)."""
    parts = [_key_part(k) for k in path] or ["state"]
    if top_names and parts[0].isdigit() and int(parts[0]) < len(top_names):
        parts[0] = top_names[int(parts[0])]
    return tuple(parts)


def _hookless(var: nnx.Variable) -> bool:
    """True if `var`'s value accessors reduce to reading/writing its raw array."""
    meta = var.get_metadata()
    return ("on_get_value" not in meta and "on_set_value" not in meta
            and isinstance(var.get_raw_value(), jax.Array))


def _entry_of(path, var) -> str:
    """Which snapshot entry a leaf belongs to: params, opt_state or other."""
    if isinstance(var, nnx.Param):
        return "params"
    if isinstance(var, nnx.optimizer.OptState):
        return "opt_state"
    return "other"


class StepForm(abc.ABC):
    """A step reduced to ``pure(leaves, batch)``, plus how to read and write the user's state.

    Attributes:
        kind: a short name for logs and events (``"nnx"``, ``"pytree"``).
        leaf_paths: per leaf, its path (for error messages).
        leaf_keys: per leaf, its path as strings (nested-dict checkpoints).
        leaf_entries: per leaf, its snapshot entry (``params``, ``opt_state``, ...).
        specs: per leaf, its partition spec.
    """

    kind: str
    leaf_paths: list[str]
    leaf_keys: list[tuple[str, ...]]
    leaf_entries: list[str]
    specs: list[PartitionSpec]
    key_impls: list[Any]  # per leaf: the PRNG impl if the leaf is a typed key, else None

    @property
    def arity(self) -> int:
        """Positional arguments of a call, batch included."""
        return len(self.state_arg_names) + 1

    state_arg_names: tuple[str, ...]

    @abc.abstractmethod
    def state_of(self, state_args: Sequence[Any]) -> list:
        """The state leaves held by a call's state arguments (all but the batch).

        Raises:
            UnsupportedStateError: they are not the state this form was built for.
        """

    def split_call(self, args: Sequence[Any]) -> tuple[tuple[Any, ...], Any]:
        """A call's arguments as (state arguments, batch).

        Raises:
            UnsupportedStateError: the call does not have this form's arguments.
        """
        if len(args) != self.arity:
            raise UnsupportedStateError(
                f"this resilient step was built for step({', '.join(self.state_arg_names)}, "
                f"batch); got {len(args)} positional arguments")
        return tuple(args[:-1]), args[-1]

    @abc.abstractmethod
    def pure(self, leaves: list, batch: Any) -> tuple[list, Any]:
        """The user's step as a function of the state leaves and the batch."""

    @abc.abstractmethod
    def result(self, state_args: Sequence[Any], leaves: list, metrics: Any) -> Any:
        """Hands `leaves` back as the user's step would, and returns what it returns."""

    @abc.abstractmethod
    def restored(self, state_args: Sequence[Any], leaves: list, step: int) -> Any:
        """What `ResilientStep.restore` returns once `leaves` (of `step`) are restored."""

    def mutable_objects(self) -> Sequence[object]:
        """The user's objects the step updates in place, one per leaf where it has them
        (a step that carries them is their only owner)."""
        return ()

    def forget_arrays(self, structs: Sequence[tuple[tuple[int, ...], Any]]) -> None:  # noqa: B027
        """Drops every reference to the state's device arrays the form holds (before the
        backend that owns them is torn down); `structs` are the leaves' (shape, dtype)."""

    def _wrap_keys(self, leaves):
        return [leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)
                for leaf, impl in zip(leaves, self.key_impls, strict=True)]


class NnxForm(StepForm):
    """``step(model, optimizer, batch) -> metrics``; updates model and optimizer in place."""

    kind = "nnx"
    state_arg_names = ("model", "optimizer")

    def __init__(self, fn: Callable, model: nnx.Module, optimizer: nnx.Optimizer):
        self.fn = fn
        self.model, self.optimizer = model, optimizer
        self.graphdef, state = nnx.split((model, optimizer))
        self.treedef = jax.tree.structure(state)
        flat = jax.tree_util.tree_flatten_with_path(
            nnx.state((model, optimizer)), is_leaf=_is_var)[0]
        self.live_vars: list[nnx.Variable] = [v for _, v in flat]
        self.leaf_paths = [_leaf_path(p) for p, _ in flat]
        self.leaf_keys = [_leaf_key(p, ("model", "optimizer")) for p, _ in flat]
        self.leaf_entries = [_entry_of(p, v) for p, v in flat]
        values = [v.get_value() for v in self.live_vars]
        self.key_impls = [jax.random.key_impl(x) if _is_key(x) else None for x in values]
        specs = jax.tree.leaves(nnx.get_partition_spec(state),
                                is_leaf=lambda x: isinstance(x, PartitionSpec))
        if len(specs) != len(values):
            raise UnsupportedStateError(
                f"could not read one partition spec per state leaf ({len(specs)} specs for "
                f"{len(values)} leaves)"
            )
        self.specs = specs

        # get_value/set_value copy through jax.tree.map and look for hooks on every call
        # (0.7 ms per step for the demo GPT's 92 variables). Variables without value hooks
        # holding a plain array read and write the same through the raw accessors (0.13 ms).
        self._plain = all(_hookless(v) for v in self.live_vars)

    def mutable_objects(self):
        return self.live_vars

    def state_of(self, state_args):
        model, optimizer = state_args
        if model is not self.model or optimizer is not self.optimizer:
            raise UnsupportedStateError(
                "this resilient step was built for another model/optimizer pair; decorate "
                "a new step (or use step.with_options()) for a different model")
        if self._plain:
            return [_to_raw(v.get_raw_value()) for v in self.live_vars]
        return [_to_raw(v.get_value()) for v in self.live_vars]

    def _write(self, leaves) -> None:
        for var, leaf, impl in zip(self.live_vars, leaves, self.key_impls, strict=True):
            value = leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)
            if self._plain:
                var.set_raw_value(value)
            else:
                var.set_value(value)

    def pure(self, leaves, batch):
        state = jax.tree.unflatten(self.treedef, self._wrap_keys(leaves))
        model, optimizer = nnx.merge(self.graphdef, state)
        metrics = self.fn(model, optimizer, batch)
        new = jax.tree.leaves(nnx.state((model, optimizer)))
        return [_to_raw(x) for x in new], metrics

    def result(self, state_args, leaves, metrics):
        self._write(leaves)
        return metrics

    def restored(self, state_args, leaves, step):
        self._write(leaves)
        return step

    def forget_arrays(self, structs):
        for var, (shape, dtype) in zip(self.live_vars, structs, strict=True):
            var.set_value(np.zeros(shape, dtype))


class PytreeForm(StepForm):
    """``step(state, batch) -> (state, metrics)`` on any pytree of arrays."""

    kind = "pytree"
    state_arg_names = ("state",)

    def __init__(self, fn: Callable, state: Any):
        self.fn = fn
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        bad = [(p, x) for p, x in flat if not hasattr(x, "shape") or not hasattr(x, "dtype")]
        if bad:
            path, value = bad[0]
            raise UnsupportedStateError(
                f"state leaf {_leaf_path(path)} is a {type(value).__name__} ({value!r:.60}); "
                "the pure step form needs a pytree of arrays (or pass a Flax NNX model and "
                "optimizer)"
            )
        self.leaf_paths = [_leaf_path(p) for p, _ in flat]
        self.leaf_keys = [_leaf_key(p) for p, _ in flat]
        self.leaf_entries = ["state"] * len(flat)
        values = [x for _, x in flat]
        self.key_impls = [jax.random.key_impl(x) if _is_key(x) else None for x in values]
        self.specs = [
            x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding)
            else PartitionSpec()
            for x in values
        ]

    def state_of(self, state_args):
        leaves = jax.tree.leaves(state_args[0])
        if len(leaves) != len(self.leaf_paths):
            raise UnsupportedStateError(
                f"the state passed has {len(leaves)} leaves; the step was built for "
                f"{len(self.leaf_paths)}"
            )
        return [_to_raw(x) if hasattr(x, "dtype") else np.asarray(x) for x in leaves]

    def _unflatten(self, leaves):
        return jax.tree.unflatten(self.treedef, self._wrap_keys(leaves))

    def pure(self, leaves, batch):
        out = self.fn(self._unflatten(leaves), batch)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise UnsupportedStateError(
                f"a pure step must return (state, metrics); it returned {type(out).__name__}"
            )
        new_state, metrics = out
        new = jax.tree.leaves(new_state)
        if jax.tree.structure(new_state) != self.treedef:
            raise UnsupportedStateError(
                "the step returned a state with another structure than its input: "
                f"{jax.tree.structure(new_state)} != {self.treedef}"
            )
        return [_to_raw(jnp.asarray(x)) for x in new], metrics

    def result(self, state_args, leaves, metrics):
        return self._unflatten(leaves), metrics

    def restored(self, state_args, leaves, step):
        return self._unflatten(leaves), step


def form_for(fn: Callable, args: tuple) -> StepForm:
    """Picks the step form from the call's arguments."""
    if len(args) == 3 and isinstance(args[0], nnx.Module):
        if not isinstance(args[1], nnx.Optimizer):
            raise UnsupportedStateError(
                f"the NNX step form is step(model, optimizer, batch); the second argument is "
                f"a {type(args[1]).__name__}, not an nnx.Optimizer"
            )
        return NnxForm(fn, args[0], args[1])
    if len(args) == 2:
        if isinstance(args[0], nnx.Module):
            raise UnsupportedStateError(
                "got step(model, batch): pass the optimizer too, step(model, optimizer, batch)"
            )
        return PytreeForm(fn, args[0])
    raise UnsupportedStateError(
        f"a resilient step is called as step(model, optimizer, batch) or step(state, batch); "
        f"got {len(args)} positional arguments ({', '.join(type(a).__name__ for a in args)})"
    )
