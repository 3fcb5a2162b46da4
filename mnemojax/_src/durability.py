"""What outlives the process: the persistent tier, its just-in-time triggers, the event log.

`Durability` is the resilient step's one handle on them:

* periodic asynchronous Orbax checkpoints (`PersistentOptions.every_steps`);
* a preemption notice (SIGTERM by default): after the running step, the last complete
  step is checkpointed synchronously and `PreemptionExit` is raised;
* memory pressure rising toward the limit: checkpoint at once, keep training;
* the JSONL event log (`ResilienceOptions.event_log`).

A failed save (disk full, ...) never changes the training state, and is never silent. It
is raised as `CheckpointSaveError`, naming the steps not checkpointed, at the start of the
first call after it is known (`check_preemption`, which the step calls before it does
anything) or by `close()`: raised there, the step counter, the model and the checkpoints
agree, and calling again with the same arguments continues the failure-free run; each
failure is raised once. Raising it from the call whose save failed would leave that call
committed but its result (the NNX model's write-back, the pure form's return value)
undelivered. An asynchronous save is waited for on a watcher thread, so its failure is
known as soon as the write ends at no cost to the training thread. The next scheduled
save is the retry; a failed preemption checkpoint is retried at every call until it is
written. Restoring tries the checkpoints newest first and falls back past unreadable ones
(`CheckpointCorruptError` when none can be read).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import jax

from mnemojax._src.device_layer import DeviceLayer
from mnemojax._src.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointSaveError,
    MnemojaxError,
    PreemptionExit,
)
from mnemojax._src.events import EventLog
from mnemojax._src.options import ResilienceOptions
from mnemojax._src.persistent import PersistentTier, SaveFailure, lost_to_a_peer
from mnemojax._src.triggers import MemoryWatch, PreemptionWatch

log = logging.getLogger("mnemojax")

# The live handles with a preemption watch, in the order they were made (the same in
# every process of a job): one exiting for a notice checkpoints the others first.
_preemptible: list[weakref.ref[Durability]] = []


class Durability:
    """The resilient step's handle on the persistent tier, its triggers and the event log.

    Args:
        options: the options in force.
        keys: per state leaf, its key in a checkpoint.
        layer: the device layer memory use is sampled through (set again whenever the
            runtime changes).
    """

    def __init__(self, options: ResilienceOptions, *, keys: Sequence[tuple[str, ...]],
                 layer: DeviceLayer | None = None,
                 agree_stop: Callable[[int], int] | None = None):
        popts = options.persistent
        self._popts = popts
        self.layer = layer
        self.events = EventLog(options.event_log, options.run_name) if options.event_log \
            else None
        self._keys = keys
        self._failed: list[SaveFailure] = []  # known, not yet raised
        # The newest step an earlier run left in the directory, until this run restores
        # (`restore_latest`): Orbax writes no step at or below it (`PersistentTier.save`).
        self._earlier: int | None = None
        self.tier = self._open_tier(clean_tmp=True) if popts.directory else None
        self._earlier = self.tier.latest_step() if self.tier is not None else None
        self._preemption = PreemptionWatch(popts.preemption_signals) \
            if self.tier is not None and popts.preemption_signals else None
        self._memory = MemoryWatch(popts.memory_pressure_fraction) \
            if self.tier is not None and popts.memory_pressure_fraction else None
        self.jit_checkpoints = 0
        self._agree_stop = agree_stop
        self._stop_after: int | None = None  # the agreed last step (several processes)
        self._preemption_saved: int | None = None  # the step a preemption checkpointed
        self._exited: PreemptionExit | None = None  # raised once: raised again if called
        # (step, leaves) of the last complete step, for a preemption another step noticed.
        self.committed: Callable[[], tuple[int, Sequence | None]] | None = None
        if self._preemption is not None:
            _preemptible.append(weakref.ref(self))

    def emit(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)

    def check_preemption(self, step: int, leaves: Sequence | None) -> None:
        """Called at the start of a call, before it does anything (`step` is the last
        complete step, `leaves` its state or None when not on the devices).

        Raises:
            PreemptionExit: after a preemption notice, once `step` is checkpointed.
            CheckpointSaveError: checkpoints that failed since the last call, or the
                preemption checkpoint itself (tried again at the next call).
        """
        if self._exited is not None:  # called again after the exit (which was caught)
            raise PreemptionExit(str(self._exited), step=self._exited.step,
                                 directory=self._exited.directory)
        self._preempt_if_noticed(step, leaves, at_call_start=True)
        self._raise_failed_saves()

    def _preempt_if_noticed(self, step: int, leaves: Sequence | None, *,
                            at_call_start: bool) -> None:
        """Checkpoints the last complete step and raises `PreemptionExit` after a notice.

        Several processes first agree on the step to stop after (the step after the first
        proposer's last complete one; see `coordination.agree_stop_step`), so that all of
        them checkpoint the same step; until then they keep training. The other resilient
        steps of this process are checkpointed too, before the exit."""
        tier = self.tier
        if self._preemption is None or tier is None or not self._preemption.notice.is_set():
            return
        if self._agree_stop is not None:
            if self._stop_after is None:
                self._stop_after = self._agreed_stop(step + 1)
            if step < self._stop_after:
                return
        sig = self._preemption.signal_received
        if not self._checkpoint_for_preemption(tier, step, leaves, sig, at_call_start):
            return  # after a commit: raised, and the save tried again, at the next call
        for ref in list(_preemptible):
            other = ref()
            if other is not None and other is not self:
                other.checkpoint_for_peer_preemption()
        directory = str(tier.directory)
        log.warning("mnemojax: preemption notice (signal %s): step %d checkpointed to %s; "
                    "exiting", sig, step, directory)
        self._close(report=False)
        self._exited = PreemptionExit(
            f"preempted (signal {sig}); step {step} is checkpointed in {directory}",
            step=step, directory=directory)
        raise self._exited

    def _agreed_stop(self, proposal: int) -> int:
        assert self._agree_stop is not None
        try:
            stop = self._agree_stop(proposal)
        except Exception as e:  # the world is failing: the step's collective says so next
            log.warning("mnemojax: preemption: no agreement on the step to stop after (%s); "
                        "stopping after step %d", e, proposal)
            return proposal
        log.warning("mnemojax: preemption notice: every process stops after step %d", stop)
        return stop

    def _checkpoint_for_preemption(self, tier: PersistentTier, step: int,
                                   leaves: Sequence | None, sig: int | None,
                                   at_call_start: bool) -> bool:
        """Saves `step` for a preemption (once); False when the save failed."""
        if self._preemption_saved == step:
            return True
        self.emit("preemption", step=step, trigger=f"signal {sig}")
        if leaves is None or step <= 0:
            return True
        blocked = self._save_now(tier, step, leaves)
        if blocked is None:
            if at_call_start:
                self._raise_failed_saves(
                    during=f"the preemption checkpoint of step {step} (signal {sig})")
            return False
        self._preemption_saved = step
        self.emit("checkpoint_save", step=step, duration_s=blocked, just_in_time=True)
        for failure in self._failed:  # superseded by the checkpoint of `step`
            log.warning("mnemojax: the checkpoint of step %d had failed (%s); step %d "
                        "is checkpointed", failure.step, failure.error, step)
        self._failed.clear()
        return True

    def checkpoint_for_peer_preemption(self) -> None:
        """Another resilient step of this process is exiting for a preemption notice:
        checkpoint this one's last complete step now, and stop after it (its next call,
        if any, exits without saving again; every process of a job does the same here,
        in build order). A failure is logged: the process is exiting."""
        tier = self.tier
        if tier is None or self._preemption is None or self.committed is None:
            return
        step, leaves = self.committed()
        if leaves is None or step <= 0 or self._preemption_saved == step:
            return
        self._preemption.notice.set()
        self._stop_after = step
        if self._checkpoint_for_preemption(tier, step, leaves,
                                           self._preemption.signal_received,
                                           at_call_start=False):
            log.warning("mnemojax: preemption: step %d of another resilient step "
                        "checkpointed to %s", step, tier.directory)
        else:
            log.error("mnemojax: preemption: the checkpoint of step %d to %s failed",
                      step, tier.directory)

    def after_commit(self, step: int, leaves: Sequence, devices) -> None:
        """Checkpoints and triggers after `step` is committed. A failed save is recorded,
        not raised (see the module docstring)."""
        tier = self.tier
        if tier is None:
            return
        if self._popts.every_steps and step % self._popts.every_steps == 0:
            blocked = tier.save(step, leaves)
            self.emit("checkpoint_save", step=step, duration_s=blocked, just_in_time=False)
        if self._memory is not None and self.layer is not None \
                and step % self._popts.memory_check_every_steps == 0:
            source = self._memory.observe(self.layer.memory_fractions(devices, step=step))
            if source is not None:
                self.jit_checkpoints += 1
                blocked = self._save_now(tier, step, leaves)
                self.emit("preemption", step=step, trigger=f"memory pressure ({source})")
                if blocked is not None:
                    log.warning("mnemojax: %s memory above %.0f%% of its limit and rising: "
                                "step %d checkpointed to %s", source,
                                100 * self._memory.fraction, step, tier.directory)
                    self.emit("checkpoint_save", step=step, duration_s=blocked,
                              just_in_time=True)
        self._preempt_if_noticed(step, leaves, at_call_start=False)
        self._collect()

    def _save_now(self, tier: PersistentTier, step: int, leaves: Sequence) -> float | None:
        """A synchronous save: the seconds it blocked, or None when it failed (recorded)."""
        try:
            return tier.save(step, leaves, wait=True)
        except CheckpointSaveError as e:
            self._collect()
            cause = e.__cause__ if e.__cause__ is not None else e
            self._failed.append(SaveFailure(step, cause))
            self.emit("fault", step=step, classification="checkpoint_failed",
                      detail=str(cause)[:200])
            return None

    def _collect(self) -> None:
        """Takes the failures the tier knows of (never blocks); one event each."""
        if self.tier is None:
            return
        for failure in self.tier.take_failures():
            self._failed.append(failure)
            self.emit("fault", step=failure.step, classification="checkpoint_failed",
                      detail=str(failure.error)[:200])

    def _raise_failed_saves(self, during: str | None = None) -> None:
        self._collect()
        failures, self._failed = self._failed, []
        raised = []
        for failure in failures:
            if lost_to_a_peer(failure.error):
                # A peer process lost inside the save's collective or barrier (multi-
                # process): the step's own collective fails next and recovers the world.
                log.warning("mnemojax: the checkpoint of step %d was lost with a peer "
                            "process (%s); not raised", failure.step,
                            str(failure.error)[:200])
            else:
                raised.append(failure)
        if not raised:
            return
        steps = [f.step for f in raised]
        directory = str(self._popts.directory)
        what = during or ("the checkpoint of step " if len(steps) == 1 else
                          "the checkpoints of steps ") + ", ".join(map(str, steps))
        raise CheckpointSaveError(
            f"{what} to {directory} failed: {raised[-1].error}. The training state is "
            "unaffected (call again to continue); those steps are not checkpointed",
            steps=steps, directory=directory) from raised[-1].error

    def _open_tier(self, *, clean_tmp: bool) -> PersistentTier:
        assert self._popts.directory is not None  # only called with a directory
        return PersistentTier(os.fspath(self._popts.directory), keys=self._keys,
                              max_to_keep=self._popts.max_to_keep, clean_tmp=clean_tmp,
                              earlier=lambda: self._earlier)

    def reopen_tier(self, layer: DeviceLayer) -> None:
        """A new Orbax manager for a new multi-process world (the old one's processes and
        barriers belong to the world that failed), whose devices `layer` reaches. The old
        manager may be stuck in a save whose collective lost a peer: it is closed on a
        daemon thread, never waited for."""
        self.layer = layer
        if self.tier is None:
            return
        if self._stop_after is not None and self._agree_stop is not None:
            # The new world's coordination service starts empty: put the step agreed in
            # the old one back first, so a process that gets its notice now adopts it.
            self._stop_after = self._agreed_stop(self._stop_after)
        old = self.tier
        self.tier = self._open_tier(clean_tmp=False)  # the new world's peers may be saving

        def close_quietly():
            try:
                old.close()
            except Exception as e:  # the save that lost its peer: the step is not committed
                log.info("mnemojax: the old world's checkpoint manager closed with %s", e)
        threading.Thread(target=close_quietly, daemon=True).start()

    def continues_the_directory(self) -> None:
        """This run continues what the checkpoint directory holds (`restore()`, from it or
        from the agents' copies of the same job): its steps are not an earlier run's."""
        self._earlier = None

    def restore_latest(self, shardings, structs):
        """(step, leaves on `shardings`) of the newest readable checkpoint, or None when
        there is none. An unreadable checkpoint (truncated, garbled) is skipped for the
        one before it, with a warning and a ``fault`` event.

        Raises:
            CheckpointMismatchError: the newest checkpoint belongs to another model.
            CheckpointCorruptError: there are checkpoints, and none can be read.
        """
        if self.tier is None:
            return None
        self.continues_the_directory()
        steps = self.tier.steps()
        errors: list[BaseException] = []
        for step in steps:
            t0 = time.perf_counter()
            try:
                leaves = self.tier.restore(step, shardings, structs)
            except (CheckpointMismatchError, jax.errors.JaxRuntimeError):
                raise  # another model; a device lost while placing the state
            except Exception as e:
                if isinstance(e, MnemojaxError):
                    raise
                errors.append(e)
                log.warning("mnemojax: checkpoint %s/%d cannot be read (%s: %s); trying the "
                            "one before it", self.tier.directory, step, type(e).__name__,
                            str(e)[:200])
                self.emit("fault", step=step, classification="checkpoint_corrupt",
                          detail=f"{type(e).__name__}: {str(e)[:200]}")
                continue
            self.emit("checkpoint_restore", step=step, duration_s=time.perf_counter() - t0)
            return step, leaves
        if not errors:
            return None
        directory = str(self.tier.directory)
        raise CheckpointCorruptError(
            f"no checkpoint in {directory} can be read (tried steps {steps}); the newest "
            f"failed with {type(errors[0]).__name__}: {str(errors[0])[:300]}",
            directory=directory, steps=steps, errors=errors) from errors[0]

    def close(self) -> None:
        """Waits for the save in flight, closes the tier and the event log.

        Raises:
            CheckpointSaveError: a checkpoint failed and was not raised yet (after
                everything is closed; a second `close` does not raise it again).
        """
        self._close(report=True)

    def _close(self, *, report: bool) -> None:
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
            _preemptible[:] = [r for r in _preemptible if r() not in (None, self)]
        if self.tier is not None:
            self.tier.close()
            self._collect()
            self.tier = None
        if self.events is not None:
            self.events.close()
            self.events = None
        if report:
            self._raise_failed_saves()
        else:
            self._failed.clear()
