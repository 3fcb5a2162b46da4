"""Step forms: how a user's call maps onto one pure function on a flat list of arrays.

A resilient step takes its arguments the way ``nnx.jit`` (and ``jax.jit``) does:

* **State.** NNX graph objects (Module, Optimizer, Rngs, Metric / MultiMetric, Variable)
  anywhere in the arguments, positional or keyword, nested in tuples, lists or dicts, are
  the carried state (`NnxForm`): their Variables are the state leaves, and the step
  updates the objects in place. Rngs counters are state, so random streams continue
  exactly after a recovery. A step given no NNX object is pure (`PytreeForm`): its first
  argument is the state, a pytree of arrays (a Linen ``TrainState`` too, whose
  ``apply_fn`` and ``tx`` are static fields), and it returns ``(state, out)`` or the
  state alone.
* **Statics** (``static_argnums`` / ``static_argnames``) are passed as given: hashable,
  part of the compile key (another value compiles the step again).
* **Inputs** are every other argument's leaves: arrays, typed PRNG keys and Python
  numbers, on the host. Every input array with a leading dimension is part of the global
  batch: all of them have the global batch size as leading dimension, and they are split
  along the data axis. Replicated (placed whole on every device) and traced instead:
  Python numbers (weakly typed, as under jit), 0-d arrays and 0-d typed PRNG keys, and
  every array of the arguments named in ``replicated_argnums``/``replicated_argnames`` (a
  raw PRNG key, a table). Typed keys travel as their raw data and are wrapped again when
  traced; one with a leading dimension (``jax.random.split(key, batch)``) is part of the
  batch like any array. A replicated input is never cut: under
  ``batch_policy='truncate_batch'`` a per-example array must not be named replicated.
* **Return values** come back as the function returns them; carried NNX objects it
  returns are the caller's own objects.

The runtime only ever sees the `StepForm` interface: ``split_call(args, kwargs)``
separates a call's state arguments from its inputs (a `CallInputs` pytree, whose tree
structure also holds the statics), ``state_of(state_args)`` reads the state leaves out of
them, ``pure(leaves, inputs) -> (leaves, out)`` is what gets compiled, and
``result(state_args, leaves, out)`` hands the new state back the way the user's step would
have (in place for NNX, returned for the pure form). It never asks which form it holds.
The leaves are what gets sharded, snapshotted and resharded; typed PRNG keys travel as
their raw key data so every leaf is a plain numeric array.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import logging
import operator
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mnemojax._src import sharding as shd
from mnemojax._src.data import HostRows
from mnemojax._src.errors import (
    BatchSplitError,
    InvalidOptionError,
    ShardingMismatchError,
    UnsupportedStateError,
)

log = logging.getLogger("mnemojax")

_PY_NUMBERS = (bool, int, float, complex)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _is_graph(x) -> bool:
    return nnx.graph.is_graph_node(x)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_raw(x):
    return jax.random.key_data(x) if _is_key(x) else x


def host_scalar(x) -> np.ndarray:
    """A Python number as the 0-d numpy array JAX would make of it (int32, float32, ...)."""
    return np.asarray(x, dtype=jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))


def _weakly_typed(x):
    """`x` as a weakly typed value, as jit traces a Python number. The compiled program is
    the same; only dtype promotion inside the step depends on it (``0.1 * bf16`` stays
    bf16). JAX has no public spelling of this conversion."""
    from jax._src.lax import lax as lax_internal  # noqa: PLC0415

    return lax_internal._convert_element_type(x, weak_type=True)


def _leaf_path(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def _key_part(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _hookless(var: nnx.Variable | _ArrayLeaf) -> bool:
    """True if `var`'s value accessors reduce to reading/writing its raw array."""
    meta = var.get_metadata()
    return ("on_get_value" not in meta and "on_set_value" not in meta
            and isinstance(var.get_raw_value(), jax.Array))


def _number_to_array(var: nnx.Variable | _ArrayLeaf) -> None:
    """A Python number held as state (``nnx.Variable(0)``) is held as a 0-d JAX array of
    JAX's dtype for it from now on (numpy state stays on the host until the step places
    it). Strongly typed, unlike ``nnx.jit``, which keeps it weakly typed: mixed with a
    lower-precision array (bfloat16) it promotes (README, "Known limits")."""
    value = var.get_raw_value()
    if isinstance(value, (bool, int, float, complex)):
        var.set_raw_value(jnp.asarray(value, dtype=jnp.asarray(value).dtype))


def _raw_key(k) -> Any:
    """A path entry's key as the node holds it (an int for an `nnx.List`'s items)."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, str) and not isinstance(node, Mapping):
        return getattr(node, key)
    return node[key]


def _owner_of(root: Any, keys: Sequence[Any]) -> Any:
    """What holds the leaf at path ``keys`` under ``root`` (the path's last key names it
    there)."""
    owner = root
    for key in keys[:-1]:
        owner = _child(owner, key)
    return owner


class _ArrayLeaf:
    """A `jax.Array` an NNX object holds as a plain attribute or item, not in an
    `nnx.Variable` (Flax's array leaves: ``self.w = jnp.zeros(...)`` in a Module, or in an
    `nnx.List`/`nnx.Dict`/dict), read and written in place through its owner, with the
    accessors of a hookless Variable that `NnxForm` uses. One per (owner, key) while it
    lives (`at`), so that two steps carrying it are told apart (`ownership`)."""

    _live: weakref.WeakValueDictionary[tuple[int, Any], _ArrayLeaf] = \
        weakref.WeakValueDictionary()

    def __init__(self, owner: Any, key: Any, path: str):
        impl = nnx.graph.get_node_impl(owner)
        set_key = getattr(impl, "set_key", None)
        if set_key is None:
            raise UnsupportedStateError(
                f"state {path} is held inside a {type(owner).__name__}, which cannot be "
                "written in place: hold it in an nnx.Variable (or an nnx.List, nnx.Dict or "
                "dict)")
        self.owner, self.key, self._set = owner, key, set_key

    @classmethod
    def at(cls, root: Any, keys: Sequence[Any], path: str) -> _ArrayLeaf:
        owner = _owner_of(root, keys)
        ident = (id(owner), keys[-1])
        leaf = cls._live.get(ident)
        if leaf is None or leaf.owner is not owner:
            leaf = cls(owner, keys[-1], path)
            cls._live[ident] = leaf
        return leaf

    def get_raw_value(self) -> Any:
        return _child(self.owner, self.key)

    def set_raw_value(self, value: Any) -> None:
        self._set(self.owner, self.key, value)

    get_value, set_value = get_raw_value, set_raw_value

    def get_metadata(self) -> dict:
        return {}


def _entry_of(var) -> str:
    """Which snapshot entry a leaf belongs to: params, opt_state or other."""
    if isinstance(var, nnx.Param):
        return "params"
    if isinstance(var, nnx.optimizer.OptState):
        return "opt_state"
    return "other"


def _is_jitted(fn) -> bool:
    """`fn` is already a jit-compiled function (``jax.jit``, ``nnx.jit``)."""
    return callable(getattr(fn, "lower", None)) and callable(getattr(fn, "eval_shape", None))


def _argnums(value, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, int) else tuple(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise InvalidOptionError(f"{what}={value!r} is invalid: expected an int or ints")
    return items


def _argnames(value, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) for n in items):
        raise InvalidOptionError(f"{what}={value!r} is invalid: expected a str or strs")
    return items


class Convention:
    """jit's argument conventions for one step function: which arguments are static,
    which are donated, and the names of its positional parameters.

    As with ``jax.jit``: given only argnums (or only argnames), the other is inferred from
    ``inspect.signature(fn)``; given both, they are used as given.

    Raises:
        InvalidOptionError: `fn` is already jitted, an argnum or argname has the wrong type
            or names no parameter of `fn`.
    """

    def __init__(self, fn: Callable, *, static_argnums=None, static_argnames=None,
                 donate_argnums=None, donate_argnames=None, replicated_argnums=None,
                 replicated_argnames=None, example_axes=None):
        name = getattr(fn, "__name__", repr(fn))
        if _is_jitted(fn):
            raise InvalidOptionError(
                f"resilient() got {name}, which is already jitted (jax.jit or nnx.jit): "
                "mnemojax compiles the step itself, for every mesh it runs on (a recovery "
                "changes the mesh, so the jit's shardings would not hold). Pass the "
                f"undecorated function ({name}.__wrapped__), and give its static_argnums, "
                "static_argnames and donate_argnames to mnemojax.resilient")
        self.name = name
        try:
            self.signature: inspect.Signature | None = inspect.signature(fn)
            params = list(self.signature.parameters.values())
        except (TypeError, ValueError):  # builtins and other callables without a signature
            self.signature = params = None
        kinds = inspect.Parameter
        positional = [p.name for p in params or ()
                      if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        self.positional_names = tuple(positional)
        self.var_positional = any(p.kind == kinds.VAR_POSITIONAL for p in params or ())
        keywords = {p.name for p in params or ()
                    if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
        any_keyword = params is None or any(p.kind == kinds.VAR_KEYWORD for p in params)

        def resolve(nums, names, what):
            nums, names = _argnums(nums, f"{what}_argnums"), _argnames(names, f"{what}_argnames")
            bad = [n for n in names if n not in keywords and not any_keyword]
            if bad:
                raise InvalidOptionError(
                    f"{what}_argnames={names!r}: {name} has no parameter {bad[0]!r} "
                    f"(parameters: {', '.join(p.name for p in params or ())})")
            if params is not None and not self.var_positional:
                bad_nums = [i for i in nums if not -len(positional) <= i < len(positional)]
                if bad_nums:
                    raise InvalidOptionError(
                        f"{what}_argnums={nums!r}: {name} takes {len(positional)} positional "
                        f"arguments, so {bad_nums[0]} is out of range")
                nums = tuple(i % len(positional) for i in nums)
            elif any(i < 0 for i in nums):
                raise InvalidOptionError(f"{what}_argnums={nums!r}: negative argnums need "
                                         f"a signature with a fixed number of arguments")
            if nums and not names:
                names = tuple(positional[i] for i in nums if i < len(positional))
            elif names and not nums:
                nums = tuple(positional.index(n) for n in names if n in positional)
            return frozenset(nums), frozenset(names)

        self.static_argnums, self.static_argnames = resolve(static_argnums, static_argnames,
                                                            "static")
        self.donate_argnums, self.donate_argnames = resolve(donate_argnums, donate_argnames,
                                                            "donate")
        self.replicated_argnums, self.replicated_argnames = resolve(
            replicated_argnums, replicated_argnames, "replicated")
        both = sorted(self.static_argnames & self.replicated_argnames) or sorted(
            self.static_argnums & self.replicated_argnums)
        if both:
            raise InvalidOptionError(
                f"argument {both[0]!r} of {name} is both static and replicated: a "
                "static argument is part of the compile key, a replicated one is a traced "
                "input placed whole on every device; name it in one of the two")
        # Argument (position, name) -> the axis of its arrays that holds the examples.
        self.example_axes_by_num: dict[int, int] = {}
        self.example_axes_by_name: dict[str, int] = {}
        if example_axes is not None and not isinstance(example_axes, Mapping):
            raise InvalidOptionError(
                f"example_axes={example_axes!r} is invalid: expected a mapping of argument "
                "(position or name) to the axis of its arrays that holds the examples, "
                "e.g. {'batch': 1}")
        for where, axis in (example_axes or {}).items():
            if (not isinstance(axis, int) or isinstance(axis, bool) or axis < 0
                    or not isinstance(where, (int, str)) or isinstance(where, bool)):
                raise InvalidOptionError(
                    f"example_axes={example_axes!r} is invalid: expected argument positions "
                    f"or names mapped to axes >= 0, got {where!r}: {axis!r}")
            try:
                nums, names = resolve(where if isinstance(where, int) else None,
                                      where if isinstance(where, str) else None, "example")
            except InvalidOptionError as e:  # (its text names example_argnums/argnames)
                raise InvalidOptionError(f"example_axes={example_axes!r}: "
                                         f"{str(e).split(': ', 1)[-1]}") from None
            if nums & (self.static_argnums | self.replicated_argnums) or names & (
                    self.static_argnames | self.replicated_argnames):
                raise InvalidOptionError(
                    f"example_axes names argument {where!r} of {name}, which is static or "
                    "replicated: only inputs split along the batch have an example axis")
            clash = [*(n for n in nums if self.example_axes_by_num.get(n, axis) != axis),
                     *(n for n in names if self.example_axes_by_name.get(n, axis) != axis)]
            if clash:
                raise InvalidOptionError(
                    f"example_axes={example_axes!r} gives argument {clash[0]!r} two axes "
                    "(by position and by name)")
            self.example_axes_by_num.update(dict.fromkeys(nums, axis))
            self.example_axes_by_name.update(dict.fromkeys(names, axis))

    def check_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Raises `UnsupportedStateError` if `fn` cannot take these arguments."""
        if self.signature is None:
            return
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise UnsupportedStateError(
                f"{self.name}{self.signature} cannot be called with {len(args)} positional "
                f"arguments and keywords {sorted(kwargs)}: {exc}") from None

    def arg_name(self, position: int) -> str:
        """The name of positional argument `position` (``arg{i}`` beyond the named ones)."""
        if position < len(self.positional_names):
            return self.positional_names[position]
        return f"arg{position}"

    def donated(self, where: int | str) -> bool:
        """Whether the argument at `where` (a position or a keyword) is donated."""
        return self._named(where, self.donate_argnums, self.donate_argnames)

    def replicated(self, where: int | str) -> bool:
        """Whether the argument at `where` (a position or a keyword) is a replicated input."""
        return self._named(where, self.replicated_argnums, self.replicated_argnames)

    def example_axis(self, where: int | str) -> int:
        """The axis of the arrays of the argument at `where` (a position or a keyword)
        that holds the examples: 0 unless named in ``example_axes``."""
        if isinstance(where, int) and where in self.example_axes_by_num:
            return self.example_axes_by_num[where]
        name = self.arg_name(where) if isinstance(where, int) else where
        return self.example_axes_by_name.get(name, 0)

    def _named(self, where: int | str, nums: frozenset[int], names: frozenset[str]) -> bool:
        if isinstance(where, int):
            return where in nums or self.arg_name(where) in names
        return where in names

    def split_statics(self, args: Sequence[Any], kwargs: dict[str, Any]
                      ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[tuple[Any, Any], ...]]:
        """A call's (dynamic positional arguments with None for statics, dynamic keyword
        arguments, statics as ``(position or keyword, value)`` pairs)."""
        if not self.static_argnums and not self.static_argnames:
            return tuple(args), kwargs, ()
        dyn = list(args)
        statics: list[tuple[Any, Any]] = []
        for i in sorted(self.static_argnums):
            if i < len(args):
                statics.append((i, args[i]))
                dyn[i] = None
        dyn_kwargs = {}
        for k, v in kwargs.items():
            if k in self.static_argnames:
                statics.append((k, v))
            else:
                dyn_kwargs[k] = v
        return tuple(dyn), dyn_kwargs, tuple(statics)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a call's arguments are rebuilt from its state and its inputs (hashable: it is
    the aux data of `CallInputs`, so compiled executables are keyed by it)."""

    treedef: Any  # (dynamic args, dynamic kwargs), state objects and inputs as leaves
    slots: tuple[int, ...]  # per leaf: an input's index (>= 0) or state object -1 - slot
    weak: tuple[bool, ...]  # per input: a Python number (traced weakly typed)
    statics: tuple[tuple[Any, Any], ...]  # (position or keyword, value)
    key_impls: tuple[Any, ...]  # per input: the PRNG impl of a typed key (as its data), or None
    replicated: tuple[bool, ...]  # per input: placed whole on every device, not split
    names: tuple[str, ...] = dataclasses.field(compare=False)  # per input, for messages
    axes: tuple[int, ...] = ()  # per input: the axis that holds the examples (default 0)

    def rebuild(self, objects: Sequence[Any], inputs: Sequence[Any]
                ) -> tuple[list[Any], dict[str, Any]]:
        inputs = [_weakly_typed(x) if weak
                  else x if impl is None else jax.random.wrap_key_data(x, impl=impl)
                  for x, weak, impl in zip(inputs, self.weak, self.key_impls, strict=True)]
        leaves = [objects[-1 - s] if s < 0 else inputs[s] for s in self.slots]
        args, kwargs = jax.tree.unflatten(self.treedef, leaves)
        args, kwargs = list(args), dict(kwargs)
        for where, value in self.statics:
            if isinstance(where, int):
                args[where] = value
            else:
                kwargs[where] = value
        return args, kwargs


class CallInputs:
    """The inputs of one call as a pytree: its leaves are the input arrays; its tree
    structure holds the rest of the call (the statics, where state objects go)."""

    __slots__ = ("leaves", "layout")

    def __init__(self, leaves: Sequence[Any], layout: _Layout):
        self.leaves = list(leaves)
        self.layout = layout

    def __repr__(self) -> str:
        return f"CallInputs({dict(zip(self.layout.names, self.leaves, strict=True))!r})"


jax.tree_util.register_pytree_with_keys(
    CallInputs,
    lambda c: ([(jax.tree_util.GetAttrKey(n), x) for n, x in
                zip(c.layout.names, c.leaves, strict=True)], c.layout),
    lambda layout, leaves: CallInputs(list(leaves), layout),
    lambda c: (c.leaves, c.layout))


class _Returned:
    """A carried state object in a step's return value (given back as the caller's own)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


jax.tree_util.register_pytree_node(
    _Returned, lambda r: ((), r.index), lambda index, _: _Returned(index))


def _path_name(top: str, path) -> str:
    return "/".join([top, *(_key_part(k) for k in path)])


class StepForm(abc.ABC):
    """A step reduced to ``pure(leaves, inputs)``, plus how to read and write the user's
    state (see the module docstring).

    Attributes:
        kind: a short name for logs and events (``"nnx"``, ``"pytree"``).
        leaf_paths: per leaf, its path (for error messages).
        leaf_keys: per leaf, its path as strings (nested-dict checkpoints).
        leaf_entries: per leaf, its snapshot entry (``params``, ``opt_state``, ...).
        specs: per leaf, its partition spec.
        key_impls: per leaf, the PRNG impl if the leaf is a typed key, else None.
        donates_state: a donated argument holds state (the runtime donates all of it).
        last_state: the pure form: the state pytree last handed to the caller (None in
            the NNX form, whose objects hold the state).
    """

    kind: str
    leaf_paths: list[str]
    leaf_keys: list[tuple[str, ...]]
    leaf_entries: list[str]
    specs: list[PartitionSpec]
    key_impls: list[Any]
    donates_state: bool = False
    last_state: Any = None

    def __init__(self, fn: Callable, convention: Convention):
        self.fn = fn
        self.convention = convention
        self._layouts: dict[tuple, _Layout] = {}
        self._found: dict[int, int] = {}  # id(state object) -> its index (set by subclasses)

    # -- the call ------------------------------------------------------------------------
    def split_call(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None
                   ) -> tuple[tuple[Any, ...], CallInputs]:
        """A call's arguments as (state arguments, inputs).

        Raises:
            UnsupportedStateError: the call does not carry this form's state, an input is
                not an array or a number, or a static argument is not hashable.
            BatchSplitError: input arrays of different leading (batch) sizes.
        """
        dyn, dyn_kwargs, statics = self.convention.split_statics(args, kwargs or {})
        leaves, treedef = jax.tree.flatten(self._mark_state(dyn, dyn_kwargs),
                                           is_leaf=self._is_state_leaf)
        slots, inputs, weak, impls, scalar = [], [], [], [], []
        for x in leaves:
            index = self._state_index(x)
            if index is not None:
                slots.append(-1 - index)
                continue
            slots.append(len(inputs))
            impl, number = None, type(x) in _PY_NUMBERS
            scalar.append(number or np.ndim(x) == 0)  # a key's own shape, not its data's
            if number:  # traced weakly typed, as jit does
                x = host_scalar(x)
            elif _is_key(x):  # travels as its raw data, a plain array (wrapped when traced)
                impl = jax.random.key_impl(x)
                x = jax.random.key_data(x)  # (read to the host with the other inputs)
            elif not (hasattr(x, "shape") and hasattr(x, "dtype")):
                self._bad_input(dyn, dyn_kwargs, len(inputs), x)
            weak.append(number)
            impls.append(impl)
            inputs.append(x)
        state_args = self._state_args(slots, leaves)
        key = (treedef, tuple(slots), tuple(weak), statics, tuple(impls), tuple(scalar))
        try:
            layout = self._layouts.get(key)
        except TypeError:
            bad = next((w, v) for w, v in statics if not _hashable(v))
            raise UnsupportedStateError(
                f"static argument {self._where(bad[0])} is a {type(bad[1]).__name__}, which "
                "is not hashable: static arguments are part of the compile key") from None
        if layout is None:
            self.convention.check_call(args, kwargs or {})
            wheres, names = self._input_places(dyn, dyn_kwargs)
            replicated = tuple(one or self.convention.replicated(where)
                               for one, where in zip(scalar, wheres, strict=True))
            axes = tuple(self.convention.example_axis(where) for where in wheres)
            layout = self._layouts[key] = _Layout(
                treedef, tuple(slots), tuple(weak), statics, tuple(impls), replicated, names,
                axes)
        _check_batch_sizes(inputs, layout.names, layout.replicated, layout.axes)
        return state_args, CallInputs(inputs, layout)

    def _where(self, where: int | str) -> str:
        return repr(self.convention.arg_name(where) if isinstance(where, int) else where)

    def _input_places(self, dyn, dyn_kwargs) -> tuple[list[int | str], tuple[str, ...]]:
        """Per input: the argument it is in (a position or a keyword) and its name."""
        marked = self._mark_state(dyn, dyn_kwargs)
        flat = jax.tree_util.tree_flatten_with_path(marked, is_leaf=self._is_state_leaf)[0]
        wheres, names = [], []
        for path, x in flat:
            top = path[0].idx if hasattr(path[0], "idx") else 0
            where = path[1]
            positional = top == 0 and hasattr(where, "idx")
            name = self.convention.arg_name(where.idx) if positional else _key_part(where)
            where = where.idx if positional else _key_part(where)
            if self._state_index(x) is not None:
                if self.convention.replicated(where):
                    raise InvalidOptionError(
                        f"replicated argument {name!r} holds the step's state: only inputs "
                        "are replicated (the state is sharded by its own annotations)")
                continue
            wheres.append(where)
            names.append(name + jax.tree_util.keystr(path[2:]))
        return wheres, tuple(names)

    def _bad_input(self, dyn, dyn_kwargs, index: int, x) -> None:
        name = self._input_places(dyn, dyn_kwargs)[1][index]
        raise UnsupportedStateError(
            f"input {name} is a {type(x).__name__} ({x!r:.60}): a resilient step's inputs "
            "are arrays, PRNG keys and numbers. Mark a non-array argument static "
            "(static_argnames=...)")

    # -- what the forms differ in ----------------------------------------------------------
    @abc.abstractmethod
    def _mark_state(self, dyn: tuple, dyn_kwargs: dict) -> Any:
        """The call's dynamic arguments with the state where `_is_state_leaf` finds it."""

    @abc.abstractmethod
    def _is_state_leaf(self, x) -> bool: ...

    def _state_index(self, x) -> int | None:
        """The index of the state object `x`, None for an input.

        Raises:
            UnsupportedStateError: `x` is state this form was not built for.
        """
        if not self._is_state_leaf(x):
            return None
        index = self._found.get(id(x))
        if index is None:
            self._unknown_state(x)
        return index

    def _unknown_state(self, x) -> None:
        raise UnsupportedStateError(
            f"this resilient step was built for other state objects; got a "
            f"{type(x).__name__} it does not carry: decorate a new step (or use "
            "step.with_options()) for a different model")

    @abc.abstractmethod
    def _state_args(self, slots: list[int], leaves: list) -> tuple[Any, ...]: ...

    @abc.abstractmethod
    def split_restore(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The state arguments among `ResilientStep.restore`'s arguments."""

    @abc.abstractmethod
    def state_of(self, state_args: Sequence[Any]) -> list:
        """The state leaves held by a call's state arguments.

        Raises:
            UnsupportedStateError: they are not the state this form was built for.
        """

    @abc.abstractmethod
    def pure(self, leaves: list, inputs: CallInputs) -> tuple[list, Any]:
        """The user's step as a function of the state leaves and the inputs."""

    @abc.abstractmethod
    def result(self, state_args: Sequence[Any], leaves: list, out: Any) -> Any:
        """Hands `leaves` back as the user's step would, and returns what it returns."""

    @abc.abstractmethod
    def restored(self, state_args: Sequence[Any], leaves: list, step: int) -> Any:
        """What `ResilientStep.restore` returns once `leaves` (of `step`) are restored."""

    @abc.abstractmethod
    def write_back(self, leaves: list) -> None:
        """After a recovery the caller does not get a new state from (in guarded work,
        `ResilientStep.guard`, or a step that then raised): the state the caller's objects
        hold becomes `leaves` (NNX: written into the objects; the pure form: `last_state`,
        a new state pytree, rebuilt from them)."""

    def mutable_objects(self) -> Sequence[object]:
        """The user's objects the step updates in place, one per leaf where it has them
        (a step that carries them is their only owner)."""
        return ()

    def forget_arrays(self, structs: Sequence[tuple[tuple[int, ...], Any]]) -> None:  # noqa: B027
        """Drops every reference to the state's device arrays the form holds in the
        user's objects (before the backend that owns them is torn down); `structs` are the
        leaves' (shape, dtype). The pure form keeps `last_state`, which its caller holds
        too (after a recovery in guarded work, it stands for the recovered state)."""

    def _wrap_keys(self, leaves):
        return [leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)
                for leaf, impl in zip(leaves, self.key_impls, strict=True)]

    def _call(self, objects: Sequence[Any], inputs: CallInputs) -> Any:
        """Calls the user's function (tracing), on rebuilt arguments."""
        args, kwargs = inputs.layout.rebuild(objects, inputs.leaves)
        try:
            return self.fn(*args, **kwargs)
        except flax_errors.TraceContextError as exc:
            raise _closure_error(self.fn, exc, set(self._found)) from exc


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _check_batch_sizes(inputs: Sequence[Any], names: Sequence[str],
                       replicated: Sequence[bool], axes: Sequence[int]) -> None:
    sizes = {}
    for x, name, whole, axis in zip(inputs, names, replicated, axes, strict=True):
        if whole:
            continue
        if axis and np.ndim(x) <= axis:
            raise BatchSplitError(
                f"input {name} has shape {tuple(np.shape(x))}, which has no example axis "
                f"{axis} (example_axes)")
        if axis and isinstance(x, HostRows):  # (rows are examples: axis 0)
            raise BatchSplitError(
                f"input {name} holds per-host rows (mnemojax.data), whose examples are "
                f"their leading axis: example_axes cannot give it axis {axis}")
        sizes.setdefault(np.shape(x)[axis], name)
    if len(sizes) > 1:
        (a, name_a), (b, name_b) = list(sizes.items())[:2]
        raise BatchSplitError(
            f"input {name_a} has {a} examples and input {name_b} has {b}: every input array "
            "is part of the global batch, split along the data axis, so all of them have "
            "its size along their example axis (the leading one, unless example_axes names "
            "another). Name an argument that every device takes whole (a raw PRNG key, a "
            "table) in replicated_argnames, or keep it in the state")


def batch_splits(batch: Any) -> Any:
    """Per leaf of `batch` (a call's `CallInputs`, or any pytree of arrays or their
    shapes), True where it is split along the batch axes, False where every device takes
    it whole: a pytree of bools of `batch`'s structure."""
    leaves, treedef = jax.tree.flatten(batch)
    whole = batch.layout.replicated if isinstance(batch, CallInputs) else [False] * len(leaves)
    return jax.tree.unflatten(treedef, [not w and len(np.shape(x)) > 0
                                        for x, w in zip(leaves, whole, strict=True)])


def example_axes(batch: Any) -> Any:
    """Per leaf of `batch` (as `batch_splits`), the axis that holds its examples: the
    leading one unless the step's ``example_axes`` names another for its argument."""
    leaves, treedef = jax.tree.flatten(batch)
    axes = batch.layout.axes if isinstance(batch, CallInputs) else ()
    return jax.tree.unflatten(treedef, list(axes) or [0] * len(leaves))


def _closure_error(fn: Callable, exc: Exception, carried: set[int]) -> UnsupportedStateError:
    """The error for a step that mutates NNX state it reaches without taking it as an
    argument (Flax raises a trace-level error)."""
    found = [f"{name} (an {type(obj).__module__.split('.')[0]}.{type(obj).__name__})"
             for name, obj in _closed_over_graph_objects(fn) if id(obj) not in carried]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = getattr(fn, "__name__", "the step")
    if found:
        what = f"{name} closes over {', '.join(found)} and mutates NNX state outside its arguments"
        fix = f"pass {'them' if len(found) > 1 else found[0].split(' ')[0]} to the step"
    else:
        what = (f"{name} mutates an NNX object that it (or a function it calls) closes over "
                "instead of taking as an argument")
        fix = ("pass the object to the step, and to any inner nnx transform "
               "(nnx.value_and_grad(loss_fn)(model, rngs), not a loss_fn closing over rngs)")
    return UnsupportedStateError(
        f"{what} ({type(exc).__name__}: {first}). A resilient step, like nnx.jit, carries "
        f"and updates only the NNX objects passed to it as arguments: {fix}, e.g. "
        "train_step(model, optimizer, rngs, batch)")


class _GraphFingerprint:
    """What the carried objects' graph holds, node by node: each node's attribute
    (child) objects, by identity. Checked at every call, cheaply (no ``nnx.split``; ~1 µs
    per node: 0.012 ms for the demo GPT, `bench.micro` 1; a graph is rebuilt, ~1 ms, after
    an ``nnx.jit`` call between steps): a submodule or Variable replaced between steps
    (model surgery, ``model.l2 = nnx.Linear(...)``), or a static attribute set anew, shows
    as another object; so does a hyperparameter replaced in an optimizer's state (optax's
    ``hyperparams['learning_rate'] = x``), not a Variable replaced inside its per-parameter
    trees (Adam's ``mu``), which count only replaced whole. The
    children are held (not their ids: a replaced child freed could leave its id to the
    new one). Array leaves (the step writes new ones) and Flax's own
    bookkeeping (``_pytree__state``) do not count, and a plain pytree child (a list, a
    tuple, an optax state) counts by its structure and the objects in it: an ``nnx.jit``
    call rebuilds those, and sets a node's attributes again in another order."""

    def __init__(self, objects: tuple):
        self.objects = objects
        # [children container, their values, structure, path]
        self.nodes: list[list[Any]] = []
        graph = list(nnx.graph.iter_graph(objects))
        # Not inside the per-parameter parts of an optimizer's state (Adam's mu and nu:
        # `nnx.State` trees as large as the model's, half the nodes of a model with Adam;
        # their parent sees them replaced whole); the rest of it is a few nodes, where a
        # hyperparameter lives (optax's `inject_hyperparams` dict).
        mirrors = [path for path, node in graph
                   if isinstance(node, nnx.State) and "opt_state" in path]
        for path, node in graph:
            if node is None or _is_var(node) or not nnx.graph.is_node(node) or any(
                    isinstance(p, str) and p.startswith("_pytree__") for p in path) or any(
                    path[:len(m)] == m for m in mirrors):
                continue
            container = _children_of(node)
            values: tuple | None = tuple(_values_of(container))
            if any(isinstance(v, _CONCRETE_ARRAYS) for v in values):
                values = None  # (compared by structure: no array of a past step is held)
            self.nodes.append([container, values, self._structure(container), path])

    def changes(self, names: Sequence[str], most: int = 3) -> str:
        """What differs since this fingerprint was taken, for a message: the attributes
        added, removed or set to another object (static values with both values)."""
        found: list[tuple[tuple, list[str]]] = []  # (node path, what changed there)
        for container, _, structure, path in self.nodes:
            now = self._structure(container)
            where = "/".join([names[int(path[0])], *map(str, path[1:])] if path else [])
            out = [f"{where}/{k} removed" for k in structure.keys() - now.keys()]
            out += [f"{where}/{k} added" for k in now.keys() - structure.keys()]
            for k in now.keys() & structure.keys():
                old, new = structure[k], now[k]
                if _Tree.same(new, old):
                    continue
                shown = (f": {old!r} -> {new!r}" if all(
                    isinstance(v, int | float | bool | str | type(None)) for v in (old, new))
                    else " replaced")
                out.append(f"{where}/{k}{shown}")
            if out:
                found.append((tuple(path), out))
        # A change inside plain containers (an optax state's tuples) shows at each one
        # holding it too: the innermost are named.
        return listed([text for path, out in found if not any(
            len(other) > len(path) and other[:len(path)] == path for other, _ in found)
            for text in out], most)

    @staticmethod
    def _structure(container: Any) -> dict:
        """A node's children by key: arrays and ``_pytree__`` entries stand in as None, a
        plain pytree child as its `_Tree`."""
        items = container.items() if hasattr(container, "items") else enumerate(container)
        return {k: None if isinstance(v, _CONCRETE_ARRAYS) or (
            isinstance(k, str) and k.startswith("_pytree__")) else _Tree.of(v)
            for k, v in items}

    def same(self) -> bool:
        """Whether every node still holds the same attribute objects."""
        rebuilt = False
        for container, values, structure, _ in self.nodes:
            if values is not None:
                now = tuple(_values_of(container))
                if len(now) == len(values) and all(map(operator.is_, now, values)):
                    continue  # (the common case: nothing replaced)
            now_structure = self._structure(container)
            if now_structure.keys() != structure.keys() or any(
                    not _Tree.same(v, structure[k]) for k, v in now_structure.items()):
                return False
            rebuilt = rebuilt or values is not None
        if rebuilt:  # the same graph, rebuilt containers: follow them from now on
            self.__init__(self.objects)
        return True


class _Tree:
    """A plain pytree child of a graph node (not itself a graph node): its structure and
    the objects in it (graph nodes, Variables, static values; arrays stand in as None)."""

    __slots__ = ("leaves", "treedef")

    def __init__(self, treedef: Any, leaves: tuple):
        self.treedef, self.leaves = treedef, leaves

    @classmethod
    def of(cls, value: Any) -> Any:
        """`value` itself, or a `_Tree` of it when it is a plain pytree container."""
        if value is None or _is_var(value) or not nnx.graph.is_node(value) or (
                nnx.graph.is_graph_node(value)):
            return value
        leaves, treedef = jax.tree_util.tree_flatten(
            value, is_leaf=lambda x: _is_var(x) or nnx.graph.is_graph_node(x))
        return cls(treedef, tuple(None if isinstance(x, _CONCRETE_ARRAYS) else x
                                  for x in leaves))

    @staticmethod
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, _Tree) and isinstance(b, _Tree):
            return a.treedef == b.treedef and len(a.leaves) == len(b.leaves) and all(
                map(operator.is_, a.leaves, b.leaves))
        return a is b


def _children_of(node: Any) -> Any:
    """The container of a graph node's children: its ``__dict__`` (a Module, a Pytree),
    or the node itself (a dict, list or tuple)."""
    if isinstance(node, dict | list | tuple):
        return node
    if hasattr(node, "__dict__"):
        return vars(node)
    return _NodeChildren(node)


class _NodeChildren:
    """A graph node's children as its node implementation gives them, read anew each
    time (a node type registered with Flax that keeps them elsewhere)."""

    def __init__(self, node: Any):
        self.node, self.impl = node, nnx.graph.get_node_impl(node)

    def items(self) -> Iterable[tuple[Any, Any]]:
        return self.impl.node_dict(self.node).items() if self.impl is not None else ()

    def values(self) -> Iterable[Any]:
        return [v for _, v in self.items()]


def _values_of(container: Any) -> Iterable[Any]:
    if isinstance(container, list | tuple):
        return container
    return container.values()  # (a dict, `_NodeChildren`)


def _variables_of(x: Any) -> list:
    """The Variables an NNX object (or an `nnx.State`, e.g. of ``nnx.split((model,
    optimizer))``) holds. ``nnx.state`` of such a State fails in Flax (IndexError), and a
    warning must never fail the call it warns about."""
    try:
        tree = x if isinstance(x, nnx.State) else nnx.state(x)
        return [v for v in jax.tree.leaves(tree, is_leaf=_is_var) if _is_var(v)]
    except Exception:  # noqa: BLE001 - nothing to warn about then
        return []


def _array_leaves_of(x: Any) -> list[tuple[int, Any]]:
    """The arrays an NNX object holds without a Variable, as (id of their owner, key)
    (`_ArrayLeaf`); never fails."""
    if isinstance(x, nnx.State):
        return []
    try:
        flat = jax.tree_util.tree_flatten_with_path(nnx.state(x), is_leaf=_is_var)[0]
        found = []
        for path, v in flat:
            if isinstance(v, jax.Array):
                keys = [_raw_key(k) for k in path]
                found.append((id(_owner_of(x, keys)), keys[-1]))
        return found
    except Exception:  # noqa: BLE001 - nothing to warn about then
        return []


def _annotated_or_placed(spec: PartitionSpec, value: Any, path: str = "") -> PartitionSpec:
    """A variable's partition spec: its sharding annotation, else (none, or a replicated
    one) the `NamedSharding` its array already has: parameters made as Flax's explicit
    sharding guide makes them (``jax.random.normal(..., out_sharding=P('fsdp', None))``
    in an ``nnx.Param`` without sharding metadata) keep their layout, as under
    ``jax.jit`` (a user trial: they were silently replicated, and a mesh of one device per
    process failed on them).

    An annotation that does not divide the array over the mesh its array is placed on
    (Flax's FSDP example shards a (32, 1) kernel's last dimension over a 4-wide axis)
    yields to that placement (JAX left such a kernel replicated), with a warning: the
    program runs as it does without mnemojax (a user trial: it was refused).

    An annotation naming axes the mesh its array is placed on lacks (logical names, as
    Flax's GSPMD guide gives them, read after the ``nnx.logical_axis_rules`` block the
    model was made in has closed, when Flax returns them unresolved) yields to that
    placement too, which those rules made: as ``nnx.jit`` runs it (a user trial: it was
    refused, naming the logical axis)."""
    sharding = getattr(value, "sharding", None)
    placed = sharding if isinstance(sharding, NamedSharding) else None
    if any(axis is not None for axis in spec):
        if placed is not None and any(n not in placed.mesh.shape for _, names in
                                      shd.spec_axes(spec) for n in names):
            return placed.spec
        if placed is not None and not _fits(spec, np.shape(value), placed.mesh.shape):
            log.warning(
                "mnemojax: %s: its sharding annotation %s does not divide its shape %s over "
                "the mesh %s; it keeps the layout JAX gave its array, %s",
                path or "a state variable", spec, tuple(np.shape(value)),
                dict(placed.mesh.shape), placed.spec)
            return placed.spec
        return spec
    if placed is not None and any(a is not None for a in placed.spec):
        return placed.spec
    return spec


def _fits(spec: PartitionSpec, shape: tuple[int, ...], mesh_shape: Any) -> bool:
    """Whether ``spec`` shards ``shape`` evenly over ``mesh_shape`` (a spec that names an
    axis the mesh lacks, or more dimensions than the array has, is not judged here:
    `sharding.validate_specs` names it later)."""
    if len(spec) > len(shape) or any(n not in mesh_shape for _, names in shd.spec_axes(spec)
                                     for n in names):
        return True
    try:
        shd.validate_specs([spec], [shape], [""], mesh_shape)
    except ShardingMismatchError:
        return False
    return True


def _closed_over_graph_objects(fn: Callable, depth: int = 0) -> list[tuple[str, Any]]:
    """NNX objects `fn` reaches through its closure, the globals it names and partial
    arguments; also through the plain functions it reaches (two levels)."""
    found: list[tuple[str, Any]] = []
    if isinstance(fn, functools.partial):
        values: Iterable[tuple[str, Any]] = [
            *((f"partial argument {i}", a) for i, a in enumerate(fn.args)),
            *fn.keywords.items()]
        inner = fn.func
    else:
        inner = inspect.unwrap(fn) if callable(fn) else fn
        if not hasattr(inner, "__code__"):
            return found
        try:
            cv = inspect.getclosurevars(inner)
        except (TypeError, ValueError):
            return found
        values = [*cv.nonlocals.items(), *cv.globals.items()]
        inner = None
    for name, value in values:
        if _is_graph(value):
            found.append((name, value))
        elif depth < 2 and (inspect.isfunction(value) or isinstance(value, functools.partial)):
            found.extend(_closed_over_graph_objects(value, depth + 1))
    if inner is not None and depth < 2:
        found.extend(_closed_over_graph_objects(inner, depth + 1))
    return found


# What to do when a step is called with other NNX objects than those it carries.
_NEW_OBJECTS = (
    "A step carries the objects it first ran with, or others of the same structure (graph, "
    "static attributes, an optimizer's optax transformation object, shapes and dtypes), "
    "which it then carries instead: to go on with the values of objects of another "
    "structure, copy them into the carried ones (nnx.update(model, nnx.state(other))); an "
    "optimizer with another transformation, or another model, needs a new step "
    "(step.close(), then step.with_options(): the objects are this step's until it is "
    "closed)")


# Clones of each carried object remembered (`NnxForm._clone_index`).
_ALIASES = 2

# What a variable of objects taken in place of carried ones may hold (not a
# ShapeDtypeStruct: ``nnx.eval_shape``'s abstract objects).
_CONCRETE = (jax.Array, np.ndarray, np.generic, int, float, bool, complex)
_CONCRETE_ARRAYS = (jax.Array, np.ndarray, np.generic)


# How long `NnxForm.replaced_since_written` waits, in all, for values still being computed
# (a copy dispatched just before the step) before it counts them as changed.
_COMPARE_WAIT_S = 1.0


def is_ready(x: jax.Array) -> bool:
    """Whether ``x``'s value is computed (or failed): `jax.Array.is_ready`, which the
    type stubs of `jax.Array` leave out (a typed PRNG key array has none: its data's)."""
    return bool(_to_raw(x).is_ready())  # pyright: ignore[reportAttributeAccessIssue]


def listed(names: Sequence[str], most: int = 4) -> str:
    """``a, b, c, d and 3 more``: the first `most` names, for a message."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _same_local_values(a: Any, b: Any, deadline: float) -> bool:
    """Whether two arrays hold equal values in this process's shards; False when unsure.
    An array not computed by `deadline` (``time.monotonic()``; its computation may wait
    on a peer that is gone) is not read."""
    try:
        if not (isinstance(a, jax.Array) and isinstance(b, jax.Array)) or (
                a.shape != b.shape or a.dtype != b.dtype):
            return False
        if _is_key(a):  # (typed PRNG keys: compared by their data, and their impl)
            if jax.random.key_impl(a) != jax.random.key_impl(b):
                return False
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        while not (is_ready(a) and is_ready(b)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        mine = {s.device: s for s in a.addressable_shards}
        theirs = {s.device: s for s in b.addressable_shards}
        return mine.keys() == theirs.keys() and all(
            mine[d].index == theirs[d].index
            and np.array_equal(np.asarray(mine[d].data), np.asarray(theirs[d].data))
            for d in mine)
    except Exception:  # noqa: BLE001 - a deleted (donated) buffer: unsure
        return False


# Variable metadata that changes nothing a compiled step computes: whether the variable
# was created under ``nnx.use_eager_sharding`` (a submodule made inside ``jax.set_mesh``
# for a model built outside it, as the README shows, differs only there: a user trial).
_INERT_METADATA = frozenset({"eager_sharding"})


def _plain_graphdef(graphdef: Any) -> Any:
    """``graphdef`` without `_INERT_METADATA` in its variables' definitions."""
    nodes = getattr(graphdef, "nodes", None)
    if nodes is None:
        return graphdef
    VariableDef = nnx.graph.VariableDef  # noqa: N806

    def plain(node: Any) -> Any:
        if not isinstance(node, VariableDef) or not _INERT_METADATA & set(node.metadata):
            return node
        kept = {k: v for k, v in node.metadata.items() if k not in _INERT_METADATA}
        return dataclasses.replace(node, metadata=type(node.metadata)(kept))

    return dataclasses.replace(graphdef, nodes=[plain(n) for n in nodes])


def _carries(x: Any) -> bool:
    """Whether a state leaf (a Variable, or an array held without one) is one the step
    carries: not a Variable holding no array (None, optax's ``MaskedNode`` where
    ``optax.masked`` / ``multi_transform`` leave a parameter out): the state's structure
    holds those, and the step rebuilds them from it as they were."""
    return not _is_var(x) or bool(jax.tree.leaves(x.get_raw_value()))


def _held(x: Any) -> Any:
    """The array a Variable (or `_ArrayLeaf`) holds; an array leaf is itself."""
    return x.get_raw_value() if hasattr(x, "get_raw_value") else x


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def _refuse_containers(values: Sequence[Any], paths: Sequence[str]) -> None:
    """A variable holding several arrays (a tuple, list, dict or other pytree: what
    ``sow`` leaves in an ``Intermediate``, Linen's through `nnx.bridge.ToNNX` too) is not
    carried.

    Raises:
        UnsupportedStateError: naming the first such variable and what it holds.
    """
    for value, path in zip(values, paths, strict=True):
        if value is None or hasattr(value, "shape"):
            continue
        leaves = jax.tree.leaves(value)
        if len(leaves) == 1 and leaves[0] is value:  # (a number)
            continue
        n = len(leaves)
        raise UnsupportedStateError(
            f"the variable {path} holds a {type(value).__name__} of {n} "
            f"{'array' if n == 1 else 'arrays'} (what sow leaves in an Intermediate): a "
            "resilient step carries variables that hold one array each. Take sown values "
            "out of the objects before the step (nnx.pop(model, nnx.Intermediate) after "
            "the call that sowed them; Linen: mutable=... without 'intermediates'), and "
            "inside it, or hold each array in its own variable")


class NnxForm(StepForm):
    """A step whose arguments hold NNX objects; it updates them in place (``nnx.jit``).

    Args:
        fn: the user's step.
        *objects: the NNX objects the step carries, in call order.
        names: per object, its name in the call (``model``, ``state/model``); default: the
            names of `fn`'s first positional parameters.
        convention: statics and donation (default: none).
        donated: per object, whether the argument holding it is donated.
    """

    kind = "nnx"

    def __init__(self, fn: Callable, *objects: Any, names: Sequence[str] | None = None,
                 convention: Convention | None = None, donated: Sequence[bool] = ()):
        convention = convention or Convention(fn)
        super().__init__(fn, convention)
        names = list(names) if names is not None else [
            convention.arg_name(i) for i in range(len(objects))]
        self.object_names = names
        self.donates_state = any(donated)
        flat = self._bind(tuple(objects))
        self.graphdef, state = nnx.split(self.objects)
        self._plain_def = _plain_graphdef(self.graphdef)  # what a change is compared with
        self.treedef = jax.tree.structure(state)
        self.leaf_keys = [tuple(path.split("/")) for path in self.leaf_paths]
        self.leaf_entries = [_entry_of(v) for _, v in flat]
        values = [v.get_value() for v in self.live_vars]
        _refuse_containers(values, self.leaf_paths)
        self.key_impls = [jax.random.key_impl(x) if _is_key(x) else None for x in values]
        # Per variable (a Variable of the spec state holds its spec, None where Flax has
        # none), those of the carried ones (`_carries`: an annotated variable holding no
        # array has a spec too).
        spec_leaves = jax.tree.leaves(nnx.get_partition_spec(state), is_leaf=lambda x: (
            _is_var(x) or isinstance(x, PartitionSpec)))
        every = jax.tree.leaves(state, is_leaf=_is_var)
        specs = [x.get_raw_value() if _is_var(x) else x
                 for x, v in zip(spec_leaves, every, strict=False) if _carries(v)]
        if len(spec_leaves) != len(every) or len(specs) != len(values) or not all(
                isinstance(x, PartitionSpec) for x in specs):
            raise UnsupportedStateError(
                f"could not read one partition spec per state leaf ({len(specs)} specs for "
                f"{len(values)} leaves)"
            )
        self.specs = [_annotated_or_placed(spec, x, path) for spec, x, path in
                      zip(specs, values, self.leaf_paths, strict=True)]
        self._returns_objects = False
        self._has_keys = any(impl is not None for impl in self.key_impls)

    def _bind(self, objects: tuple) -> list:
        """Carries `objects`: their variables (and array leaves) become `live_vars`;
        returns their state's flat (path, variable) list."""
        self.objects = objects
        self._found = {id(obj): i for i, obj in enumerate(objects)}
        self._aliases: list[Any] = []  # clones taken for carried objects (`_clone_index`)
        every = jax.tree_util.tree_flatten_with_path(nnx.state(objects), is_leaf=_is_var)[0]
        flat = [(p, v) for p, v in every if _carries(v)]
        # Variables holding no array (`_carries`), with what they hold: one that is given an
        # array between steps changes the structure (`changed_in_place`); per variable of
        # the state, whether it is carried (`pure` checks the step keeps that).
        self._empty = [(v, v.get_raw_value()) for _, v in every if not _carries(v)]
        self._empty_paths = {self._path_of(p) for p, v in every if not _carries(v)}
        self._carried_mask = [_carries(v) for _, v in every]
        self.leaf_paths = [self._path_of(p) for p, _ in flat]
        if hijax := [path for (_, v), path in zip(flat, self.leaf_paths, strict=True)
                     if getattr(v, "hijax", False)]:
            raise UnsupportedStateError(
                f"the variable {hijax[0]} is a hijax variable (nnx.var_defaults(hijax=True), "
                "Flax's experimental variables): a resilient step does not carry those yet "
                "(Flax cannot read their partition specs). Create the model's variables "
                "without hijax")
        # (an array held without a Variable is written back through its owner)
        self.live_vars: list[nnx.Variable | _ArrayLeaf] = [
            v if _is_var(v) else _ArrayLeaf.at(objects, [_raw_key(k) for k in p], path)
            for (p, v), path in zip(flat, self.leaf_paths, strict=True)]
        for var in self.live_vars:
            _number_to_array(var)
        self._written: list | None = None  # the values `_write` set, in `live_vars` order
        self._rebound: list[str] = []  # leaves carried anew since `_write` (`adopt`)
        # get_value/set_value copy through jax.tree.map and look for hooks on every call
        # (0.7 ms per step for the demo GPT's 92 variables). Variables without value hooks
        # holding a plain array read and write the same through the raw accessors (0.13 ms).
        self._plain = all(_hookless(v) for v in self.live_vars)
        self._fingerprint = _GraphFingerprint(objects)
        return flat

    def changed_in_place(self) -> list[str] | None:
        """None while the carried objects' graph holds what the step carries (checked by
        identity, `_GraphFingerprint`). Else, after a change between steps, the paths of
        the state leaves now held by other Variables of the same structure (a submodule
        replaced by a new one of the same shapes: ``nnx.jit`` takes those); the step
        carries them from then on (`rebind`).

        Raises:
            UnsupportedStateError: the graph changed otherwise (a submodule of another
                structure, a variable shared or added, a static attribute changed:
                ``nnx.jit`` would trace again), naming the way out.
        """
        if self._fingerprint.same() and all(
                var.get_raw_value() is held for var, held in self._empty):
            return None
        try:
            graphdef, state = nnx.split(self.objects)
        except Exception as e:
            raise UnsupportedStateError(
                f"the NNX objects this step carries ({', '.join(self.object_names)}) changed "
                f"between steps and cannot be split any more ({type(e).__name__}: {e})") from e
        paths, now, emptied = self._carried(state)
        if _plain_graphdef(graphdef) != self._plain_def or paths != self.leaf_paths or any(
                np.shape(_held(a)) != np.shape(_held(b)) or _dtype(_held(a)) != _dtype(
                    _held(b)) for a, b in zip(now, self.live_vars, strict=True)):
            # (a variable given an array, or none, shows in the paths carried)
            what = ", ".join(filter(None, [listed(
                [f"{p} holds an array now" for p in paths
                 if p not in self.leaf_paths and p in self._empty_paths]
                + [f"{p} holds none now" for p in self.leaf_paths
                   if p not in paths and p in emptied]),
                self._fingerprint.changes(self.object_names)]))
            raise UnsupportedStateError(
                f"the structure of {', '.join(self.object_names)} changed since this step "
                f"was built{f' ({what})' if what else ''}: between steps a submodule was "
                "replaced by one of another structure or shapes, a variable shared, added or "
                "removed, or a static attribute set anew (model.eval() before a training "
                "step; model.train() the first time, where a module's flag was None, as "
                "MultiHeadAttention's deterministic: call it before the step's first call). "
                "A variable replaced by a plain value (optax's hyperparams['learning_rate'] "
                "= x) changes the structure too: set its value in place instead "
                "(hyperparams['learning_rate'][...] = x). "
                "A resilient step runs what it compiled for the structure it was built with "
                "(nnx.jit would trace again): put the structure back, or call step.close() "
                "and make a new resilient step (step.with_options() after close())")
        replaced = [path for path, a, b in zip(self.leaf_paths, now, self.live_vars, strict=True)
                    if ((a is not b) if _is_var(a) else (b.get_raw_value() is not a))]
        if replaced:  # (`rebind` takes the new fingerprint, if the change is taken)
            return replaced
        self._fingerprint = _GraphFingerprint(self.objects)  # an equal value set anew
        return None

    _BINDING = ("objects", "_found", "_aliases", "leaf_paths", "live_vars", "_written",
                "_plain", "_fingerprint", "_rebound", "_empty", "_empty_paths",
                "_carried_mask")

    def _path_of(self, key_path: tuple) -> str:
        """A state leaf's name (``model/l1/kernel``) from its key path in the objects'
        state."""
        return _path_name(self.object_names[int(_key_part(key_path[0]))], key_path[1:])

    def _carried(self, state: Any) -> tuple[list[str], list, set[str]]:
        """Of an NNX state of the carried objects: the names and leaves of those the step
        carries (`_carries`), in order, and the names of the variables holding no array."""
        every = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0]
        paths = [self._path_of(p) for p, v in every if _carries(v)]
        return (paths, [v for _, v in every if _carries(v)],
                {self._path_of(p) for p, v in every if not _carries(v)})

    def rebind(self, changed: Sequence[str] = ()) -> Callable[[], None]:
        """Carries the Variables the objects hold now (`changed_in_place`); their values are
        the state from now on. Returns what puts the binding before back."""
        before = {name: getattr(self, name) for name in self._BINDING}
        self.adopt(self.objects)
        self._rebound = list(changed)

        def undo() -> None:
            for name, value in before.items():
                setattr(self, name, value)
        return undo

    def replacements(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple | None:
        """The NNX objects of a call that passes other objects of the same structure in
        place of those carried (one loaded from a checkpoint, a model resharded between
        steps: ``nnx.jit`` takes any), in call order (the carried objects' order); None
        when the call's objects are not such, or hold no concrete arrays (abstract ones,
        ``nnx.eval_shape``'s): then the call is refused as before."""
        dyn, dyn_kwargs, _ = self.convention.split_statics(args, kwargs)
        given = [x for x in jax.tree.leaves(self._mark_state(dyn, dyn_kwargs), is_leaf=_is_graph)
                 if _is_graph(x)]
        if len(given) != len(self.objects) or all(
                id(x) in self._found for x in given):
            return None
        new = tuple(given)
        try:
            graphdef, state = nnx.split(new)
        except Exception:  # noqa: BLE001 - not objects a step could carry: refused as before
            return None
        paths, leaves, _ = self._carried(state)
        if _plain_graphdef(graphdef) != self._plain_def or paths != self.leaf_paths:
            return None  # (the same variables carried, by name: `adopt` relies on it)
        values = [v.get_value() if _is_var(v) else v for v in leaves]
        carried = [v.get_value() for v in self.live_vars]
        if any(not isinstance(a, _CONCRETE) or np.shape(a) != np.shape(b)
               or _dtype(a) != _dtype(b) for a, b in zip(values, carried, strict=True)):
            return None
        return new

    def adopt(self, objects: tuple) -> None:
        """Carries `objects` (`replacements`; or the same objects, whose graph holds other
        variables now: `rebind`) instead of the objects before; their values are the state
        from now on."""
        paths = self.leaf_paths
        names = {n for n, a, b in zip(self.object_names, objects, self.objects, strict=True)
                 if a is not b}
        self._bind(objects)
        assert self.leaf_paths == paths, "the structure was checked before"
        self._rebound = [p for p in paths if any(p.startswith(f"{n}/") for n in names)]

    def mutable_objects(self):
        return self.live_vars

    def _mark_state(self, dyn, dyn_kwargs):
        return (dyn, dyn_kwargs)

    def _is_state_leaf(self, x) -> bool:
        return _is_graph(x)

    def _state_index(self, x) -> int | None:
        if id(x) in self._found or not _is_graph(x):
            return super()._state_index(x)
        return self._clone_index(x)

    def _clone_index(self, x) -> int | None:
        """The index of the carried object ``x`` stands for: one holding the same Variables
        (`nnx.cached_partial` calls the step with clones sharing the objects' Variables,
        the objects themselves may come in other calls); else refused."""
        held = frozenset(id(v) for v in _variables_of(x))
        for i, obj in enumerate(self.objects):
            if held and held == frozenset(id(v) for v in _variables_of(obj)):
                # Kept while its id is a key (so the id stays its own); the newest few per
                # object only (a loop that merges its model anew each step makes a clone
                # per call).
                stale = [a for a in self._aliases if self._found.get(id(a)) == i][:-_ALIASES]
                for a in stale:
                    del self._found[id(a)]
                self._aliases = [a for a in self._aliases if all(a is not o for o in stale)]
                self._found[id(x)] = i
                self._aliases.append(x)
                return i
        self._unknown_state(x)
        return None

    def _unknown_state(self, x) -> None:
        raise UnsupportedStateError(
            f"got a {type(x).__name__} this resilient step does not carry (it carries "
            f"{', '.join(self.object_names)}: the objects it first ran with). {_NEW_OBJECTS}")

    def _state_args(self, slots, leaves):
        seen = {-1 - s for s in slots if s < 0}
        if len(seen) != len(self.objects):
            missing = [n for i, n in enumerate(self.object_names) if i not in seen]
            raise UnsupportedStateError(
                f"this resilient step carries {', '.join(self.object_names)}; the call lacks "
                f"{', '.join(missing)}: pass every NNX object the step carries at each call")
        return self.objects

    def split_restore(self, args, kwargs):
        flat = jax.tree.leaves((tuple(args), kwargs), is_leaf=_is_graph)
        seen = {self._state_index(x) for x in flat if _is_graph(x)}
        if len(seen) != len(self.objects):
            missing = [n for i, n in enumerate(self.object_names) if i not in seen]
            raise UnsupportedStateError(
                f"restore() needs every NNX object the step carries; missing "
                f"{', '.join(missing)}")
        return self.objects

    def state_of(self, state_args):
        if len(state_args) != len(self.objects) or any(
                a is not b for a, b in zip(state_args, self.objects, strict=False)):
            raise UnsupportedStateError(
                f"this resilient step was built for another model/optimizer. {_NEW_OBJECTS}")
        values = [_to_raw(v.get_raw_value() if self._plain else v.get_value())
                  for v in self.live_vars]
        if any(x is None for x in values):
            raise UnsupportedStateError(
                f"{listed([p for p, x in zip(self.leaf_paths, values, strict=True) if x is None])}"
                " held an array when this step was built and holds None now (set between "
                "steps): the structure of the state changed (nnx.jit would trace again). "
                "Give it an array of its shape, or call step.close() and make a new "
                "resilient step")
        return values

    def _write(self, leaves) -> None:
        written = [] if self._has_keys else leaves  # (a key is wrapped into a new value)
        for var, leaf, impl in zip(self.live_vars, leaves, self.key_impls, strict=True):
            value = leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)
            if self._plain:
                var.set_raw_value(value)
            else:
                var.set_value(value)
            if self._has_keys:
                written.append(value)
        self._written, self._rebound = written, []

    def mark_written(self) -> None:
        """The values the variables hold now count as written by the step (`untouched`):
        they were found equal to the step's."""
        self._written = [v.get_raw_value() for v in self.live_vars] if self._plain else None

    def replaced_since_written(self) -> list[str]:
        """The paths of the state leaves whose variables no longer hold the values this
        form last wrote into them (changed outside the step: a metrics reset); a leaf
        replaced by equal values (a jitted call that wrote copies back) is left out where
        this process's shards tell; [] when unsure."""
        written = self._written
        if written is None:  # other objects or variables carried since (`adopt`)
            return list(self._rebound)
        if not self._plain:
            return []
        deadline = time.monotonic() + _COMPARE_WAIT_S
        return [path for path, var, w in zip(self.leaf_paths, self.live_vars, written,
                                             strict=True)
                if (now := var.get_raw_value()) is not w
                and not _same_local_values(now, w, deadline)]

    def untouched(self) -> bool:
        """Whether every variable still holds the value this form last wrote into it
        (identity: nothing outside the step replaced it; False when unsure)."""
        written = self._written
        return self._plain and written is not None and all(
            var.get_raw_value() is w for var, w in zip(self.live_vars, written, strict=True))

    def uncarried_objects(self, tree: Any, fn: Callable | None = None) -> list[str]:
        """The NNX objects in ``tree``, or that ``fn`` reaches through its closure, holding
        arrays in variables the step does not carry (an eval's own metrics; a view of the
        model, `nnx.view`, shares its variables): their names, for a warning."""
        carried = {id(v) for v in self.live_vars}
        carried_arrays = {(id(v.owner), v.key) for v in self.live_vars
                          if isinstance(v, _ArrayLeaf)}
        found = [(type(x).__name__, x) for x in jax.tree.leaves(tree, is_leaf=_is_graph)
                 if _is_graph(x)]
        if fn is not None:
            found += [(f"{type(x).__name__} {name!r}", x)
                      for name, x in _closed_over_graph_objects(fn)]
        return [name for name, x in found if any(
            isinstance(v.get_raw_value(), jax.Array) and id(v) not in carried
            for v in _variables_of(x)) or not carried_arrays.issuperset(_array_leaves_of(x))]

    def pure(self, leaves, inputs):
        state = jax.tree.unflatten(self.treedef, self._wrap_keys(leaves))
        objects = nnx.merge(self.graphdef, state)
        out = self._call(objects, inputs)
        new_state = nnx.state(objects)
        new = jax.tree.leaves(new_state)
        if len(new) != len(leaves) or [  # (a variable given an array and another none)
                _carries(v) for v in jax.tree.leaves(new_state, is_leaf=_is_var)
        ] != self._carried_mask:
            self._changed_structure(new_state)
        index = {id(obj): i for i, obj in enumerate(objects)}

        def returned(x):
            if _is_graph(x) and id(x) in index:
                self._returns_objects = True
                return _Returned(index[id(x)])
            return x

        out = jax.tree.map(returned, out, is_leaf=_is_graph)
        return [_to_raw(x) for x in new], out

    def _changed_structure(self, new_state) -> None:
        paths, _, _ = self._carried(new_state)
        added = sorted(set(paths) - set(self.leaf_paths))
        removed = sorted(set(self.leaf_paths) - set(paths))
        raise UnsupportedStateError(
            "the step changed the structure of its NNX state (added "
            f"{added[:5] or 'none'}, removed {removed[:5] or 'none'}): a resilient step's "
            "state keeps its shape from step to step. Take sown intermediates out inside "
            "the step (nnx.pop(model, nnx.Intermediate)) and return them instead")

    def result(self, state_args, leaves, out):
        self._write(leaves)
        if self._returns_objects:
            out = jax.tree.map(
                lambda x: self.objects[x.index] if isinstance(x, _Returned) else x, out,
                is_leaf=lambda x: isinstance(x, _Returned))
        return out

    def restored(self, state_args, leaves, step):
        self._write(leaves)
        return step

    def write_back(self, leaves):
        self._write(leaves)

    def forget_arrays(self, structs):
        self._written = None
        for var, (shape, dtype) in zip(self.live_vars, structs, strict=True):
            var.set_value(np.zeros(shape, dtype))


_STATE = object()  # where the pure form's state sits in a call's arguments


class PytreeForm(StepForm):
    """``step(state, *inputs) -> (state, out)``, or ``-> state``, on any pytree of arrays
    (``jax.jit``).

    The state is the first argument (positional, or by the name of `fn`'s first
    parameter). Python numbers in it (a fresh ``TrainState.step``) become 0-d arrays.
    """

    kind = "pytree"

    def __init__(self, fn: Callable, state: Any, *, where: int | str = 0,
                 convention: Convention | None = None):
        convention = convention or Convention(fn)
        super().__init__(fn, convention)
        self.where = where
        self.donates_state = convention.donated(where)
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        bad = [(p, x) for p, x in flat if not _arraylike(x)]
        if bad:
            path, value = bad[0]
            raise UnsupportedStateError(
                f"state leaf {_leaf_path(path)} is a {type(value).__name__} ({value!r:.60}); "
                "the pure step form needs a pytree of arrays (mark non-array fields "
                "static, as flax.struct.field(pytree_node=False) does, or pass Flax NNX "
                "objects)"
            )
        self._state_only = False  # the step returns its state alone (set when traced)
        self.leaf_paths = [_leaf_path(p) for p, _ in flat]
        self.leaf_keys = [tuple(_key_part(k) for k in p) or ("state",) for p, _ in flat]
        self.leaf_entries = ["state"] * len(flat)
        values = [x for _, x in flat]
        self.key_impls = [jax.random.key_impl(x) if _is_key(x) else None for x in values]
        self.specs = [
            x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding)
            else PartitionSpec()
            for x in values
        ]

    def _mark_state(self, dyn, dyn_kwargs):
        if isinstance(self.where, int):
            if len(dyn) <= self.where:
                raise UnsupportedStateError(
                    f"a pure resilient step takes the state as its first argument; the call "
                    f"has {len(dyn)} positional arguments")
            self._state = dyn[self.where]
            return ((*dyn[:self.where], _STATE, *dyn[self.where + 1:]), dyn_kwargs)
        if self.where not in dyn_kwargs:
            raise UnsupportedStateError(
                f"a pure resilient step takes the state as its first argument, "
                f"{self.where!r}; the call lacks it")
        self._state = dyn_kwargs[self.where]
        return (dyn, {**dyn_kwargs, self.where: _STATE})

    def _is_state_leaf(self, x) -> bool:
        return x is _STATE

    def _state_index(self, x) -> int | None:
        return 0 if x is _STATE else None

    def _state_args(self, slots, leaves):
        state, self._state = self._state, None
        return (state,)

    def split_restore(self, args, kwargs):
        if isinstance(self.where, str) and self.where in kwargs:
            return (kwargs[self.where],)
        if args:
            return (args[0],)
        raise UnsupportedStateError("restore() of a pure step takes the state: "
                                    "state, step = train_step.restore(state)")

    def state_of(self, state_args):
        leaves = jax.tree.leaves(state_args[0])
        if len(leaves) != len(self.leaf_paths):
            raise UnsupportedStateError(
                f"the state passed has {len(leaves)} leaves; the step was built for "
                f"{len(self.leaf_paths)}"
            )
        return [_to_raw(x) if hasattr(x, "dtype") else host_scalar(x) for x in leaves]

    def _unflatten(self, leaves):
        return jax.tree.unflatten(self.treedef, self._wrap_keys(leaves))

    def pure(self, leaves, inputs):
        out = self._call([self._unflatten(leaves)], inputs)
        self._state_only = jax.tree.structure(out) == self.treedef
        if self._state_only:  # ``return state`` (the Flax dropout guide's step)
            out = (out, None)
        elif not (isinstance(out, tuple) and len(out) == 2):
            raise UnsupportedStateError(
                f"a pure step returns (state, out) or the state; it returned "
                f"{type(out).__name__}, with another structure than the state's"
            )
        new_state, metrics = out
        new = jax.tree.leaves(new_state)
        if jax.tree.structure(new_state) != self.treedef:
            raise UnsupportedStateError(
                "the step returned a state with another structure than its input: "
                f"{jax.tree.structure(new_state)} != {self.treedef}"
            )
        return [_to_raw(jnp.asarray(x)) for x in new], metrics

    def result(self, state_args, leaves, out):
        state = self.last_state = self._unflatten(leaves)
        return state if self._state_only else (state, out)

    def restored(self, state_args, leaves, step):
        self.last_state = self._unflatten(leaves)
        return self.last_state, step

    def write_back(self, leaves):
        self.last_state = self._unflatten(leaves)


def _arraylike(x) -> bool:
    return (hasattr(x, "shape") and hasattr(x, "dtype")) or type(x) in _PY_NUMBERS


def form_for(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
             convention: Convention | None = None, *, restoring: bool = False) -> StepForm:
    """Picks the step form from a call's arguments (or `ResilientStep.restore`'s): the pure
    form if the first argument is an `nnx.State` (``nnx.split``'s), else NNX if any
    argument holds an NNX object, else the pure form with the first argument as state.

    Raises:
        UnsupportedStateError: a pure call without arguments, or a state that is not a
            pytree of arrays.
    """
    convention = convention or Convention(fn)
    kwargs = kwargs or {}
    form = _form_for(fn, args, kwargs, convention)
    if not restoring:
        convention.check_call(args, kwargs)
    return form


def consume_flax_static_cache() -> None:
    """`nnx.cached_partial(train_step, model, optimizer)` calls the step with a cache of
    the cached objects' traversal for the next NNX transform to take, and Flax raises when
    none took it. A resilient step carries those objects (clones sharing their Variables)
    itself: it takes the cache and leaves it unused."""
    context = getattr(nnx.graph, "GRAPH_CONTEXT", None)
    if context is not None and getattr(context, "tmp_static_cache", None) is not None:
        context.tmp_static_cache = None


def _pure_state_of(convention: Convention, dyn: Sequence[Any],
                   dyn_kwargs: dict[str, Any]) -> tuple[Any, int | str] | None:
    """The call's first argument and where it is, when it is an `nnx.State` or holds some
    (Flax's functional idiom: their Variables are a pure state's data, not objects changed
    in place); None otherwise.

    Raises:
        UnsupportedStateError: NNX objects are in the call beside such a state (a step
            carries a pure state or objects changed in place, not both).
    """
    if dyn and 0 not in convention.static_argnums:
        first, where = dyn[0], 0
    elif (name := convention.arg_name(0) if convention.positional_names else None) \
            and name in dyn_kwargs:
        first, where = dyn_kwargs[name], name
    else:
        return None

    def state_or_graph(x) -> bool:
        return isinstance(x, nnx.State) or _is_graph(x)

    if not isinstance(first, nnx.State) and (_is_graph(first) or not any(
            isinstance(x, nnx.State) for x in jax.tree.leaves(first, is_leaf=state_or_graph))):
        return None
    beside = sorted({type(x).__name__ for x in jax.tree.leaves((dyn, dyn_kwargs),
                                                                is_leaf=state_or_graph)
                     if _is_graph(x) and not isinstance(x, nnx.State)})
    if beside:
        raise UnsupportedStateError(
            "this step's first argument is a pure state (it holds nnx.State, Flax's "
            f"functional idiom), and the call also passes NNX objects ({', '.join(beside)}) "
            "to change in place: a resilient step carries one or the other. Put their "
            "state in the pure state (nnx.split), or pass the objects themselves instead")
    return first, where


def _form_for(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any],
              convention: Convention) -> StepForm:
    dyn, dyn_kwargs, _ = convention.split_statics(args, kwargs)
    if (pure := _pure_state_of(convention, dyn, dyn_kwargs)) is not None:
        # Flax's functional idiom, ``graphdef, state = nnx.split(...)`` then
        # ``step(state, batch) -> (state, metrics)``: a pure step whose state is an
        # `nnx.State`, or a pytree of them (a TrainState whose params are one: Flax's
        # 03_train_state), not NNX objects changed in place (its Variables were taken for
        # objects: the input State changed under the caller, the loss went unchecked).
        return PytreeForm(fn, pure[0], where=pure[1], convention=convention)
    flat = jax.tree_util.tree_flatten_with_path((dyn, dyn_kwargs), is_leaf=_is_graph)[0]
    objects: list[Any] = []
    names: list[str] = []
    donated: list[bool] = []
    for path, x in flat:
        if not _is_graph(x) or any(x is o for o in objects):
            continue
        where = path[1].idx if path[0].idx == 0 else _key_part(path[1])
        top = convention.arg_name(where) if isinstance(where, int) else where
        objects.append(x)
        names.append(_path_name(top, path[2:]))
        donated.append(convention.donated(where))
    if objects:
        return NnxForm(fn, *objects, names=names, convention=convention, donated=donated)
    if dyn and 0 not in convention.static_argnums:
        return PytreeForm(fn, dyn[0], where=0, convention=convention)
    first = convention.arg_name(0) if convention.positional_names else None
    if first is not None and first in dyn_kwargs:
        return PytreeForm(fn, dyn_kwargs[first], where=first, convention=convention)
    raise UnsupportedStateError(
        "a resilient step takes NNX objects (a model, an optimizer, ...) anywhere in its "
        "arguments, or, for a pure step, its state as first argument: step(state, batch) "
        f"-> (state, out); got {len(args)} positional arguments "
        f"({', '.join(type(a).__name__ for a in args)}) and keywords {sorted(kwargs)}")
