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

An asynchronous save that fails (disk full, permissions, ...) never raises here: the tier
records it as a `SaveFailure`, removes the temporary directory the save left, and hands it
to its owner through `take_failures` (`Durability` raises it at a point where the step
counter, the model and the checkpoints agree). A synchronous save (``wait=True``) raises
`CheckpointSaveError` itself. A background watcher waits for each asynchronous save,
so a failure is known as soon as the write ends, without blocking the training thread.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from mnemojax._src.distributed import jax_private
from mnemojax._src.distributed.worker import peer_watch
from mnemojax._src.errors import (
    CheckpointLostError,
    CheckpointMismatchError,
    CheckpointSaveError,
    InvalidOptionError,
)

log = logging.getLogger("mnemojax")

Key = tuple[str, ...]

# Orbax writes a step into ``<step>.orbax-checkpoint-tmp...`` and renames it on commit.
_TMP_MARK = ".orbax-checkpoint-tmp"
_DRAIN_WAITS = 4
# How often a wait for the save in flight asks whether a peer's death is known (`settle`).
_SETTLE_POLL_S = 0.05
# The longest pause between a checkpoint barrier's looks for its outcome, and whether a
# peer's death is known (`checkpoint_barrier`; the pauses grow to it from 2 ms).
_BARRIER_POLL_S = 0.05
# Barrier keys whose call counts a barrier function keeps (the newest used).
_BARRIER_KEYS = 1024


class SaveFailure(NamedTuple):
    """A checkpoint that was not written: its step and the exception the save ended with."""

    step: int
    error: BaseException


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
    """Orbax checkpoints of the flat state leaves (see module docstring).

    Args:
        directory: the checkpoint directory.
        keys: per state leaf, its key in a checkpoint.
        max_to_keep: the newest checkpoints kept.
        clean_tmp: remove the temporary directories of saves that never committed (an
            earlier run that crashed mid-save) when opening. Off when reopening for a new
            multi-process world, whose peers may already be saving.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keys: Sequence[Key],
                 max_to_keep: int, clean_tmp: bool = True,
                 earlier: Callable[[], int | None] = lambda: None):
        import orbax.checkpoint as ocp  # lazily: only jobs with a persistent tier need it

        self._ocp = ocp
        self.directory = Path(directory).expanduser().resolve()
        self._keys = [tuple(k) for k in keys]
        self._earlier = earlier
        self._refused_earlier = False  # a step at or below `earlier` was refused
        with syncs_through_the_store():  # (it waits for every process: a death ends it)
            self._manager = self._make_manager(ocp, max_to_keep)
        self.last_saved_step: int | None = None
        self._attempts = 0  # saves started; a failure is recorded once per attempt
        self._in_flight: tuple[int, int] | None = None  # (step, attempt) not yet settled
        self._watcher: threading.Thread | None = None
        self._failures: list[tuple[int, SaveFailure]] = []  # (attempt, failure)
        self._failed_attempts: set[int] = set()
        self._dirty_up_to: int | None = None  # temporary directories of failed saves
        self._lock = threading.Lock()
        if clean_tmp:
            self._clean_tmp(None)

    def _make_manager(self, ocp: Any, max_to_keep: int) -> Any:
        return ocp.CheckpointManager(
            self.directory, item_names=("state", "mnemojax"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=True,
                async_options=ocp.AsyncOptions(barrier_sync_fn=checkpoint_barrier()),
                # (its barriers' names apart from a user's own manager's in the same job)
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    barrier_sync_key_prefix="mnemojax")))

    def _describe(self, leaves: Sequence[Any]) -> list[dict[str, Any]]:
        return [{"path": "/".join(k), "shape": list(np.shape(x)), "dtype": str(x.dtype)}
                for k, x in zip(self._keys, leaves, strict=True)]

    def save(self, step: int, leaves: Sequence[Any], *, wait: bool = False) -> float:
        """Starts saving the state after `step`; returns the seconds the caller was blocked.

        Without `wait`, a failure is recorded (see `take_failures`), never raised. With
        `wait`, returns only once the checkpoint is committed on disk.

        Raises:
            CheckpointSaveError: with `wait`, this checkpoint failed (not recorded then).
            jax.errors.JaxRuntimeError: from the synchronous part (a device or a peer
                process lost during the copy), which the step loop classifies.
        """
        t0 = time.perf_counter()
        self.settle()  # Orbax would wait for the previous save anyway
        self._clean_dirty()
        if step == self.last_saved_step:
            return time.perf_counter() - t0
        ocp = self._ocp
        self._attempts += 1
        attempt = self._attempts
        try:
            if (death := peer_watch.known_death()) is not None:
                # Its barriers would wait for the dead peer (Orbax's own timeout, 20 min)
                # and this manager's last save never ends: the recovery opens a new one.
                raise CheckpointLostError(f"a peer process of this world died: {death}")
            if (earlier := self._earlier()) is not None and step <= earlier:
                # Orbax writes no step at or below the newest it holds, and says so only
                # by returning False (a user trial: a fresh run in an earlier run's
                # directory wrote nothing, and a preemption said "checkpointed"). Raised
                # once (at the next call, or here with `wait`); later ones only skipped.
                if self._refused_earlier and not wait:
                    return time.perf_counter() - t0
                self._refused_earlier = True
                raise CheckpointSaveError(
                    f"the checkpoint of step {step} was not written: {self.directory} "
                    f"holds step {earlier} of an earlier run, which this run did not "
                    "restore; Orbax writes no step at or below it. Call step.restore(...) "
                    "before the first step to continue that run, or give this run its "
                    "own PersistentOptions(directory=...)", steps=[step],
                    directory=str(self.directory))
            with syncs_through_the_store():  # (a death ends its barriers at once)
                self._manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(nest(self._keys, leaves)),
                    mnemojax=ocp.args.JsonSave({"step": step,
                                                "leaves": self._describe(leaves)})))
        except jax.errors.JaxRuntimeError:
            raise
        except Exception as e:
            self._record(step, attempt, e)
            self._mark_dirty(step)
        else:
            self.last_saved_step = step
            self._in_flight = (step, attempt)
            if not wait:
                self._watcher = threading.Thread(target=self._watch, args=(step, attempt),
                                                 daemon=True,
                                                 name=f"mnemojax-checkpoint-{step}")
                self._watcher.start()
                return time.perf_counter() - t0
            self.settle()
        if wait:
            with self._lock:
                mine = [f for a, f in self._failures if a == attempt]
                self._failures = [(a, f) for a, f in self._failures if a != attempt]
            if mine:
                raise CheckpointSaveError(
                    f"the checkpoint of step {step} to {self.directory} failed: "
                    f"{mine[0].error}", steps=[step], directory=str(self.directory)
                ) from mine[0].error
        return time.perf_counter() - t0

    def _watch(self, step: int, attempt: int) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._record(step, attempt, e)

    def _record(self, step: int, attempt: int, error: BaseException) -> None:
        with self._lock:
            if attempt in self._failed_attempts:
                return  # Orbax raises a failed save's error again at the next waits
            self._failed_attempts.add(attempt)
            self._failures.append((attempt, SaveFailure(step, error)))
            if self.last_saved_step == step:
                self.last_saved_step = None  # so a just-in-time save retries this step
        log.warning("mnemojax: the checkpoint of step %d to %s failed: %s", step,
                    self.directory, str(error)[:300])

    def settle(self) -> None:
        """Waits for the save in flight, records its failure and removes what it left.

        Under `mnemojax launch` a peer's death heard of ends the wait: the save's commit
        barrier waits for the dead peer (for Orbax's own timeout, 20 min), so the save is
        recorded as failed and left to its thread; the step that follows recovers (it is
        not started in that world), with a new manager."""
        watcher, self._watcher = self._watcher, None
        while watcher is not None and watcher.is_alive():
            watcher.join(_SETTLE_POLL_S)
            if watcher.is_alive() and (death := peer_watch.known_death()) is not None:
                in_flight, self._in_flight = self._in_flight, None
                if in_flight is not None:
                    self._record(*in_flight, CheckpointLostError(
                        f"a peer process died before it was committed: {death}"))
                    self._mark_dirty(in_flight[0])
                return
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        step, attempt = in_flight
        # The save has ended; Orbax raises its error at more than one wait after that, so
        # drain them here rather than at the next save (which would seem to fail too).
        for _ in range(_DRAIN_WAITS):
            try:
                self._manager.wait_until_finished()
                break
            except Exception as e:
                self._record(step, attempt, e)
        if attempt in self._failed_attempts:
            self._mark_dirty(step)

    def take_failures(self) -> list[SaveFailure]:
        """The saves known to have failed since the last call (oldest first); never
        blocks."""
        with self._lock:
            failures, self._failures = self._failures, []
        return [f for _, f in failures]

    def _mark_dirty(self, step: int) -> None:
        self._dirty_up_to = max(step, self._dirty_up_to or step)
        self._clean_dirty()

    def _clean_dirty(self) -> None:
        """Removes the temporary directories of the failed saves, again at each later save
        and at close: when its commit fails, Orbax may still have array writes of that
        step running, which recreate the directory."""
        if self._dirty_up_to is not None:
            self._clean_tmp(self._dirty_up_to)

    def _clean_tmp(self, step: int | None) -> None:
        """Removes the temporary directories of failed saves up to `step` (None: all), on
        the primary process only (the directory is shared)."""
        if jax.process_index() != 0 or not self.directory.is_dir():
            return
        for path in self.directory.iterdir():
            head, mark, _ = path.name.partition(_TMP_MARK)
            if mark and head.isdigit() and (step is None or int(head) <= step):
                shutil.rmtree(path, ignore_errors=True)

    def steps(self) -> list[int]:
        """The committed checkpoints' steps, newest first."""
        self.settle()
        self._manager.reload()
        return sorted(self._manager.all_steps(), reverse=True)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[0] if steps else None

    def restore(self, step: int, shardings: Sequence[jax.sharding.Sharding],
                structs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[jax.Array]:
        """Restores checkpoint `step` onto `shardings` (any mesh); checks it is ours.

        Raises:
            CheckpointMismatchError: the checkpoint belongs to another model.
            Exception: whatever Orbax raises for an unreadable checkpoint (`Durability`
                turns it into a fallback to an older one).
        """
        ocp = self._ocp
        meta = self._manager.restore(step, args=ocp.args.Composite(
            mnemojax=ocp.args.JsonRestore()))["mnemojax"]
        want = [{"path": "/".join(k), "shape": list(shape), "dtype": str(np.dtype(dtype))}
                for k, (shape, dtype) in zip(self._keys, structs, strict=True)]
        if not isinstance(meta, dict) or meta.get("step") != step \
                or not isinstance(meta.get("leaves"), list):
            raise ValueError(f"checkpoint {self.directory}/{step}: malformed mnemojax "
                             f"metadata {str(meta)[:200]}")
        if meta["leaves"] != want:
            raise CheckpointMismatchError(_mismatch(meta["leaves"], want, self.directory, step))
        abstract = nest(self._keys, [
            jax.ShapeDtypeStruct(shape, dtype, sharding=s)
            for (shape, dtype), s in zip(structs, shardings, strict=True)])
        state = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
        return unnest(self._keys, state)

    def close(self) -> None:
        """Waits for the save in flight (its failure is recorded) and closes the manager."""
        self.settle()
        try:
            self._manager.close()
        except Exception as e:  # Orbax may raise the recorded failure once more
            log.info("mnemojax: closing the checkpoint manager: %s", str(e)[:200])
        self._clean_dirty()


def lost_to_a_peer(error: BaseException) -> bool:
    """Whether a save failed because a peer process was lost: its error, or one it was
    raised from or during, is a `CheckpointLostError` or a collective's ``JaxRuntimeError``."""
    return _in_chain(error, CheckpointLostError | jax.errors.JaxRuntimeError) is not None


def _in_chain(error: BaseException | None, kind: Any) -> BaseException | None:
    """The first of ``error`` and the errors it was raised from or during that is a
    ``kind``."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class _LostCheckpointsInOneLine(logging.Filter):
    """Orbax's threads log a commit that `checkpoint_barrier` gave up (a peer died) as an
    error with its whole traceback, once per thread it passes through: such a record of
    Orbax's keeps its message and says, in one line, what was raised and the lost
    checkpoint it came from, without the traceback (mnemojax warns of the lost checkpoint
    itself). A record is one only if it comes from Orbax's code and its error is the
    `CheckpointLostError` or was raised from or during it; every other record passes
    unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        lost = _in_chain(error, CheckpointLostError)
        if lost is not None and f"{os.sep}orbax{os.sep}" in record.pathname:
            raised = "" if error is lost else f"{type(error).__name__}: {error}; from "
            record.msg = f"{record.getMessage()} ({raised}CheckpointLostError: {lost})"
            record.args = None
            record.exc_info = record.exc_text = None
        return True


_ONE_LINE = _LostCheckpointsInOneLine()


def checkpoint_barrier() -> Callable[..., None]:
    """A barrier for Orbax's asynchronous commits across the processes of the current
    world, for ``orbax.checkpoint.AsyncOptions(barrier_sync_fn=...)`` (mnemojax's own
    checkpoints use it; so should a `CheckpointManager` of yours under ``mnemojax
    launch``, made again in each new world).

    It gives up (the commit fails with `CheckpointLostError`, the checkpoint is lost) as
    soon as a peer's death in the world it was made in is heard of, or that world is left.
    Each process counts its arrival in the coordination service's key-value store, the
    last one writes the barrier's outcome, and every process looks for it with
    non-blocking reads on its own thread (`store_barrier`), so none is left blocked in
    jaxlib:
    JAX's ``wait_at_barrier`` cannot be cancelled, and a process whose peer died after the
    last save then waited at exit for the abandoned barrier (up to the collective timeout)
    and aborted if it was still blocked when the interpreter finalised. Orbax's own barrier
    waits until its timeout (20 min) on a non-daemon thread when a peer died before
    arriving: the survivors' commits never end and their exit waits for that thread (a
    user trial: a job checkpointing every step, worker 0 killed, hung). The last process
    to see a barrier complete deletes its keys. Without a distributed client (one process)
    it does nothing, as Orbax asks no barrier then.

    Raises (from the barrier, to Orbax's commit):
        CheckpointLostError: a peer died (or the world re-forms, or ended) before every
            process arrived.
        jax.errors.JaxRuntimeError: ``DEADLINE_EXCEEDED`` in every process once one of
            them waited ``timeout_ms``, naming the processes that did not arrive (the
            type JAX's barrier raises).
    """
    client = jax_private.global_state().client
    if client is None:  # (one process: Orbax does not ask)
        return lambda *, key, timeout_ms: None
    from absl import logging as absl_logging  # (absl's own logger: a filter added once)
    absl_logging.get_absl_logger().addFilter(_ONE_LINE)

    def given_up() -> tuple[str, bool] | None:
        if (death := peer_watch.known_death()) is not None:
            regrow = bool(getattr(death, "mnemojax_regrow", False))
            return (f"{'the world re-forms' if regrow else 'a peer process died'}: {death}",
                    regrow)
        if jax_private.global_state().client is not client:
            return "the world it was in has ended", False
        return None

    return store_barrier(client, jax.process_index(), jax.process_count(), given_up)


# How long a process that finds a barrier given up by a peer waits to hear of the death
# itself (its error is then a peer failure's, recovered as one).
_GIVEN_UP_WAIT_S = 5.0
# `syncs_through_the_store`: this thread's barrier, while in such a block.
_synced = threading.local()
_sync_lock = threading.Lock()
_sync_barrier: tuple[Any, Callable[..., None]] | None = None  # (client, its barrier)
_sync_installed = False
# How long a process waits at such a barrier for the others, when no death is heard of
# (Orbax's own default for its barriers).
_SYNC_TIMEOUT_S = 300.0


@contextlib.contextmanager
def syncs_through_the_store() -> Iterator[None]:
    """In this block, on this thread, ``jax.experimental.multihost_utils.
    sync_global_devices`` (the barrier between processes that Orbax takes in a save and
    when a `CheckpointManager` is made, and that a user may call) waits through the
    coordination service's key-value store (`checkpoint_barrier`'s, one per world, each
    name counted per call) rather than in a collective over every device: a peer's death
    heard of ends it at once with `CheckpointLostError`, where the collective waited for
    gloo's timeout (a user trial: 20 s, a worker killed just before a guarded save of the
    README's own manager). Used where every process runs the same code at once (guarded
    calls, a spare's before its first step too, and mnemojax's own saves), so a name is
    waited for the same way in every process; other threads (Orbax's commit threads)
    keep JAX's. A block nested in one of another world (a recovery inside) waits in its
    own world's store. Nothing without a distributed client or without the peer watch
    (``MNEMOJAX_PEER_WATCH=0``: a death would end the store's wait only at its timeout,
    where gloo's collective timeout ends JAX's)."""
    global _sync_barrier
    from mnemojax._src.distributed.worker import session as dist_session

    client = jax_private.global_state().client
    outer = getattr(_synced, "barrier", None)
    session = dist_session.current()
    if (client is None or session is None or session.peer_watch is None
            or (outer is not None and _synced.client is client)):
        # (one process; no peer watch, which alone ends the store's wait at a death, where
        # gloo's timeout ends the collective; or nested in the same world)
        yield
        return
    _install_sync()
    with _sync_lock:
        if _sync_barrier is None or _sync_barrier[0] is not client:  # (a new world)
            _sync_barrier = (client, checkpoint_barrier())
        barrier = _sync_barrier[1]
    outer_client = getattr(_synced, "client", None)
    _synced.barrier, _synced.client = barrier, client
    try:
        yield
    finally:
        _synced.barrier, _synced.client = outer, outer_client


def _install_sync() -> None:
    """Puts `syncs_through_the_store`'s dispatch in front of JAX's
    ``sync_global_devices`` (Orbax calls it through the module: the name is looked up at
    each call), once."""
    global _sync_installed
    from jax.experimental import multihost_utils

    with _sync_lock:
        if _sync_installed:
            return
        original = multihost_utils.sync_global_devices

        @functools.wraps(original)
        def sync_global_devices(name: str) -> None:
            barrier = getattr(_synced, "barrier", None)
            if barrier is None:
                return original(name)
            barrier(key=f"sync/{name}", timeout_ms=int(_SYNC_TIMEOUT_S * 1000))
            return None

        multihost_utils.sync_global_devices = sync_global_devices
        _sync_installed = True


def store_barrier(client: Any, me: int, count: int,
                  given_up: Callable[[], tuple[str, bool] | None]) -> Callable[..., None]:
    """`checkpoint_barrier`'s barrier for process ``me`` of ``count``, through ``client``'s
    key-value store: Orbax's ``barrier_sync_fn(*, key, timeout_ms)``. ``given_up()``
    returns why to stop waiting and whether that is a regrow (raised as
    `CheckpointLostError`, its ``mnemojax_regrow`` set: a recovery in guarded work is not
    charged for a regrow), or None.

    One outcome per barrier, written once (``root/outcome``: the last arrival writes
    ``done``, a process that gives up ``failed``; the store refuses a second write), so
    every process passes or fails alike: with each process judging its own deadline, one
    that gave up left its arrival counted, a later one passed alone, and each barrier of
    that name after it was one arrival off. Each process looks for the outcome with
    non-blocking reads, at most every ``_BARRIER_POLL_S`` (a timed-out blocking read held
    ~36 KB in the client and the service until its key was set)."""
    calls: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> its barriers
    lock = threading.Lock()

    def outcome(root: str, value: str) -> str:
        """Writes ``value`` as the outcome unless one is written; returns the outcome."""
        try:
            client.key_value_set(f"{root}/outcome", value)
            return value
        except jax.errors.JaxRuntimeError as e:
            if "ALREADY_EXISTS" not in str(e):
                raise
            return client.key_value_try_get(f"{root}/outcome")

    def barrier(*, key: str, timeout_ms: int) -> None:
        with lock:  # (Orbax reuses some keys at every save: a barrier per call)
            calls[key] = n = calls.pop(key, 0) + 1
            while len(calls) > _BARRIER_KEYS:  # (others carry the step: once each)
                calls.popitem(last=False)
        root = f"mnemojax/checkpoint-barrier/{key}/{n}"
        deadline = time.monotonic() + timeout_ms / 1000
        poll_s = 0.002
        try:
            _arrive(client, f"{root}/in/{me}", key)
            result = (outcome(root, "done")
                      if client.key_value_increment(f"{root}/arrived", 1) >= count else None)
            while result is None:
                if (result := _read(client, f"{root}/outcome")) is not None:
                    break
                if (why := given_up()) is not None:
                    outcome(root, "failed:given up")
                    raise _lost(key, *why)
                if time.monotonic() > deadline:
                    result = outcome(root, "failed:deadline")  # (unless done meanwhile)
                    break
                time.sleep(poll_s)
                poll_s = min(poll_s * 1.5, _BARRIER_POLL_S)
            if result != "done":
                if result != "failed:deadline":
                    # A peer gave up (a death, the world re-forming): the news reaches this
                    # process within moments, and the error then is a peer failure's.
                    wait_until = time.monotonic() + _GIVEN_UP_WAIT_S
                    while (why := given_up()) is None and time.monotonic() < wait_until:
                        time.sleep(0.01)
                    raise _lost(key, *(why or ("a peer process gave up the barrier (a "
                                               "death it heard of)", False)))
                if (why := given_up()) is not None:
                    raise _lost(key, *why)
                there = {int(k.rsplit("/", 1)[-1])
                         for k, _ in client.key_value_dir_get(f"{root}/in")}
                raise jax.errors.JaxRuntimeError(
                    f"DEADLINE_EXCEEDED: mnemojax: barrier {key}: processes "
                    f"{sorted(set(range(count)) - there)} of {count} did not arrive "
                    f"within {timeout_ms / 1000:g} s (in some process)")
            if client.key_value_increment(f"{root}/seen", 1) == count:
                client.key_value_delete(root)  # every process has seen it complete
        except jax.errors.JaxRuntimeError as e:  # the service went with the world
            if (why := given_up()) is None:
                raise
            raise _lost(key, *why) from e

    return barrier


def _arrive(client: Any, key: str, name: str) -> None:
    """Sets this process's arrival ``key`` at barrier ``name``.

    Raises:
        InvalidOptionError: it is set already: two barrier functions of one world (two
            Orbax managers) use the same barrier names.
    """
    try:
        client.key_value_set(key, "")
    except jax.errors.JaxRuntimeError as e:
        if "ALREADY_EXISTS" not in str(e):
            raise
        raise InvalidOptionError(
            f"checkpoint barrier {name!r}: this process is at it twice: two Orbax checkpoint "
            "managers of one job use the same barrier names. Give all but one of them "
            "ocp.CheckpointManagerOptions(multiprocessing_options=ocp.options."
            "MultiprocessingOptions(barrier_sync_key_prefix='...'))") from None


def _read(client: Any, key: str) -> str | None:
    """``key``'s value in the coordination service's store, None while it is not set."""
    try:
        return client.key_value_try_get(key)
    except jax.errors.JaxRuntimeError as e:
        if "NOT_FOUND" not in str(e):
            raise
        return None


def _lost(key: str, why: str, regrow: bool) -> CheckpointLostError:
    error = CheckpointLostError(f"barrier {key}: {why}")
    error.mnemojax_regrow = regrow  # type: ignore[attr-defined]  # (`_recover_after`)
    return error


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
