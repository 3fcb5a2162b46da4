"""What outlives the process: the persistent tier, its just-in-time triggers, the event log.

`Durability` is the resilient step's one handle on them:

* periodic asynchronous Orbax checkpoints (`PersistentOptions.every_steps`);
* a preemption notice (SIGTERM by default): after the running step, the last complete
  step is checkpointed synchronously and `PreemptionExit` is raised;
* memory pressure rising toward the limit: checkpoint at once, keep training;
* the JSONL event log (`ResilienceOptions.event_log`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from mnemojax._src.device_layer import DeviceLayer
from mnemojax._src.errors import PreemptionExit
from mnemojax._src.events import EventLog
from mnemojax._src.options import ResilienceOptions
from mnemojax._src.persistent import PersistentTier
from mnemojax._src.triggers import MemoryWatch, PreemptionWatch

log = logging.getLogger("mnemojax")


class Durability:
    """The resilient step's handle on the persistent tier, its triggers and the event log.

    Args:
        options: the options in force.
        keys: per state leaf, its key in a checkpoint.
        layer: the device layer memory use is sampled through (set again whenever the
            runtime changes).
    """

    def __init__(self, options: ResilienceOptions, *, keys: Sequence[tuple[str, ...]],
                 layer: DeviceLayer | None = None):
        popts = options.persistent
        self._popts = popts
        self.layer = layer
        self.events = EventLog(options.event_log, options.run_name) if options.event_log \
            else None
        self._keys = keys
        self.tier = self._open_tier() if popts.directory else None
        self._preemption = PreemptionWatch(popts.preemption_signals) \
            if self.tier is not None and popts.preemption_signals else None
        self._memory = MemoryWatch(popts.memory_pressure_fraction) \
            if self.tier is not None and popts.memory_pressure_fraction else None
        self.jit_checkpoints = 0

    def emit(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)

    def check_preemption(self, step: int, leaves: Sequence | None) -> None:
        """Checkpoints the last complete step and raises `PreemptionExit` after a notice."""
        tier = self.tier
        if self._preemption is None or tier is None or not self._preemption.notice.is_set():
            return
        sig = self._preemption.signal_received
        self.emit("preemption", step=step, trigger=f"signal {sig}")
        if leaves is not None and step > 0:
            blocked = tier.save(step, leaves, wait=True)
            self.emit("checkpoint_save", step=step, duration_s=blocked, just_in_time=True)
        directory = str(tier.directory)
        log.warning("mnemojax: preemption notice (signal %s): step %d checkpointed to %s; "
                    "exiting", sig, step, directory)
        self.close()
        raise PreemptionExit(
            f"preempted (signal {sig}); step {step} is checkpointed in {directory}",
            step=step, directory=directory)

    def after_commit(self, step: int, leaves: Sequence, devices) -> None:
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
                blocked = tier.save(step, leaves, wait=True)
                log.warning("mnemojax: %s memory above %.0f%% of its limit and rising: step %d "
                            "checkpointed to %s", source, 100 * self._memory.fraction, step,
                            tier.directory)
                self.emit("preemption", step=step, trigger=f"memory pressure ({source})")
                self.emit("checkpoint_save", step=step, duration_s=blocked, just_in_time=True)
        self.check_preemption(step, leaves)

    def _open_tier(self) -> PersistentTier:
        assert self._popts.directory is not None  # only called with a directory
        return PersistentTier(self._popts.directory, keys=self._keys,
                              max_to_keep=self._popts.max_to_keep)

    def reopen_tier(self, layer: DeviceLayer) -> None:
        """A new Orbax manager for a new multi-process world (the old one's processes and
        barriers belong to the world that failed), whose devices `layer` reaches. The old
        manager may be stuck in a save whose collective lost a peer: it is closed on a
        daemon thread, never waited for."""
        self.layer = layer
        if self.tier is None:
            return
        old = self.tier
        self.tier = self._open_tier()

        def close_quietly():
            try:
                old.close()
            except Exception as e:  # the save that lost its peer: the step is not committed
                log.info("mnemojax: the old world's checkpoint manager closed with %s", e)
        threading.Thread(target=close_quietly, daemon=True).start()

    def restore_latest(self, shardings, structs):
        """(step, leaves on `shardings`) of the newest checkpoint, or None."""
        if self.tier is None:
            return None
        step = self.tier.latest_step()
        if step is None:
            return None
        t0 = time.perf_counter()
        leaves = self.tier.restore(step, shardings, structs)
        self.emit("checkpoint_restore", step=step, duration_s=time.perf_counter() - t0)
        return step, leaves

    def close(self) -> None:
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        if self.events is not None:
            self.events.close()
            self.events = None
