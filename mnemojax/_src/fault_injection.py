"""Fault injection that behaves like real hardware (public as `mnemojax.testing`).

A `FaultInjector` interposes on the device layer, as an interception library sits between
a program and its driver. It never calls into the recovery code: the runtime learns about
a fault only the way it would learn about a real one, from a failing operation and from
its own health probes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, Literal

import jax
import numpy as np

from mnemojax._src.device_layer import Device, DeviceLayer
from mnemojax._src.errors import InvalidOptionError

Surface = Literal["dispatch", "block"]

log = logging.getLogger("mnemojax")


@dataclasses.dataclass
class _Event:
    kind: Literal["lose_devices", "lose_during_recovery", "lose_beside", "transient",
                  "memory_pressure", "hang", "corrupt_snapshot", "oom"]
    at_step: int
    device_ids: tuple[int, ...] = ()
    surface: Surface = "dispatch"
    times: int = 1
    fraction: float = 0.0
    fired_at: float | None = None


@dataclasses.dataclass(frozen=True)
class InjectedFault:
    """What the injector did, for tests and reports (the runtime never reads this)."""

    kind: str
    step: int
    device_ids: tuple[int, ...]
    time: float


def _device_error(ids: Iterable[int], what: str) -> RuntimeError:
    """A `jax.errors.JaxRuntimeError` (a `RuntimeError`; jaxlib has no stubs for it)."""
    return jax.errors.JaxRuntimeError(
        f"INTERNAL: {what} failed: device(s) {sorted(ids)} are lost (hardware error reported "
        "by the device runtime; injected by mnemojax.testing.FaultInjector)"
    )


class FaultInjector:
    """Schedules faults that surface the way real device faults do.

    Example::

        faults = mnemojax.testing.FaultInjector().lose_devices(5, [3]).lose_devices(9, [6])
        step = mnemojax.resilient(train_step, mesh=mesh, fault_injector=faults)

    A lost device stays dead for the rest of the run: every execution, transfer or probe
    that touches it fails from then on.
    """

    def __init__(self) -> None:
        self._events: list[_Event] = []
        self._dead: set[int] = set()
        self._hung: set[int] = set()
        self._failure_surfaced = False
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.injected: list[InjectedFault] = []

    def lose_devices(self, at_step: int, device_ids: Collection[int], *,
                     surface: Surface = "dispatch") -> FaultInjector:
        """Devices `device_ids` die while step `at_step` runs.

        Args:
            at_step: the 1-based step during which the devices die.
            device_ids: ids of the devices to kill.
            surface: where the failure shows: ``"dispatch"`` (the launch fails) or
                ``"block"`` (the launch returns, waiting on its results fails; any donated
                inputs are gone by then).

        Returns:
            self, so calls chain.
        """
        if at_step < 1:
            raise InvalidOptionError(f"at_step={at_step!r} is invalid: expected >= 1")
        if not device_ids:
            raise InvalidOptionError(f"device_ids={device_ids!r} is invalid: expected >= 1 id")
        if surface not in ("dispatch", "block"):
            raise InvalidOptionError(
                f"surface={surface!r} is invalid: expected 'dispatch' or 'block'")
        self._events.append(_Event("lose_devices", at_step, tuple(int(d) for d in device_ids),
                                   surface))
        return self

    def lose_devices_beside(self, after_step: int,
                            device_ids: Collection[int]) -> FaultInjector:
        """Devices `device_ids` die while work beside the steps runs after step
        `after_step` (a function run through `ResilientStep.guard`, such as an eval): the
        wait for its results fails, and so does everything that touches them later."""
        if after_step < 1:
            raise InvalidOptionError(f"after_step={after_step!r} is invalid: expected >= 1")
        self.lose_devices(after_step, device_ids)
        self._events[-1].kind = "lose_beside"
        return self

    def lose_devices_during_recovery(self, at_step: int,
                                     device_ids: Collection[int]) -> FaultInjector:
        """Devices die at the first host-to-device transfer after a device failure has
        surfaced at or after step `at_step`: in the middle of the recovery's reshard."""
        self.lose_devices(at_step, device_ids)
        self._events[-1].kind = "lose_during_recovery"
        return self

    def hang(self, at_step: int, device_ids: Collection[int]) -> FaultInjector:
        """Devices stop answering during step `at_step`: the step never completes, probes
        time out. Nothing is raised; only a watchdog can notice."""
        self.lose_devices(at_step, device_ids)
        self._events[-1].kind = "hang"
        return self

    def corrupt_snapshot(self, at_step: int) -> FaultInjector:
        """When step `at_step` launches, one bit flips in every host buffer the latest
        snapshot copy wrote (memory corruption after the copy was checksummed)."""
        if at_step < 1:
            raise InvalidOptionError(f"at_step={at_step!r} is invalid: expected >= 1")
        self._events.append(_Event("corrupt_snapshot", at_step))
        return self

    def transient_error(self, at_step: int, *, times: int = 1) -> FaultInjector:
        """Step `at_step` fails `times` times with a transient UNAVAILABLE error."""
        if at_step < 1 or times < 1:
            raise InvalidOptionError(
                f"at_step={at_step!r}, times={times!r} are invalid: expected both >= 1")
        self._events.append(_Event("transient", at_step, times=times))
        return self

    def out_of_memory(self, at_step: int) -> FaultInjector:
        """Step `at_step` fails at launch with a ``RESOURCE_EXHAUSTED`` error, as XLA
        raises when this process's devices cannot hold the step: an error of the process
        itself, raised to the caller (never recovered, also under several processes)."""
        if at_step < 1:
            raise InvalidOptionError(f"at_step={at_step!r} is invalid: expected >= 1")
        self._events.append(_Event("oom", at_step))
        return self

    def memory_pressure(self, at_step: int, *, fraction: float = 0.97,
                        ramp_steps: int = 3) -> FaultInjector:
        """From step `at_step - ramp_steps` host memory use climbs to `fraction` of its
        limit at `at_step`, and stays there (as a leak that precedes an OOM would)."""
        if at_step < 1 or not 0 < fraction <= 1 or ramp_steps < 1:
            raise InvalidOptionError(
                f"at_step={at_step!r}, fraction={fraction!r}, ramp_steps={ramp_steps!r} are "
                "invalid: expected at_step >= 1, 0 < fraction <= 1, ramp_steps >= 1")
        self._events.append(_Event("memory_pressure", at_step, times=ramp_steps,
                                   fraction=fraction))
        return self

    def _memory_override(self, step: int) -> float | None:
        for ev in self._events:
            if ev.kind == "memory_pressure" and step >= ev.at_step - ev.times:
                ramp = min(1.0, (step - (ev.at_step - ev.times)) / ev.times)
                return ev.fraction * (0.5 + 0.5 * ramp)
        return None

    @property
    def dead_devices(self) -> frozenset[int]:
        return frozenset(self._dead)

    def wrap(self, layer: DeviceLayer) -> DeviceLayer:
        """Returns `layer` with this injector interposed."""
        return _InterposedLayer(layer, self)

    # -- called by the interposed layer only ------------------------------------------
    def release_hung(self) -> None:
        """Lets waits on hung devices return (call at the end of a test)."""
        self._released.set()

    def _fire(self, ev: _Event, step: int) -> None:
        ev.fired_at = time.perf_counter()
        if ev.kind in ("lose_devices", "lose_during_recovery", "lose_beside"):
            self._dead.update(ev.device_ids)
        elif ev.kind == "hang":
            self._dead.update(ev.device_ids)
            self._hung.update(ev.device_ids)
        self.injected.append(InjectedFault(ev.kind, step, ev.device_ids, ev.fired_at))

    def _fire_due(self, step: int, kinds: tuple[str, ...]) -> list[_Event]:
        fired: list[_Event] = []
        with self._lock:
            for ev in self._events:
                if ev.fired_at is None and ev.at_step <= step and ev.kind in kinds:
                    self._fire(ev, step)
                    fired.append(ev)
        return fired

    def _take_transient(self, step: int) -> bool:
        with self._lock:
            for ev in self._events:
                if ev.kind == "transient" and ev.at_step == step and ev.times > 0:
                    ev.times -= 1
                    return True
        return False

    def _surface_for(self, devices: Collection[int]) -> Surface:
        hit = set(devices)
        for ev in reversed(self._events):
            if ev.kind == "lose_devices" and ev.fired_at is not None and hit & set(ev.device_ids):
                return ev.surface
        return "dispatch"


class _InterposedLayer:
    def __init__(self, inner: DeviceLayer, injector: FaultInjector) -> None:
        self._inner = inner
        self._inj = injector
        self._poisoned: set[int] = set()  # id() of outputs whose wait must fail
        self._step = 0
        self._generation = 0  # +1 per launch: which snapshot copy a buffer belongs to
        # (generation, host buffer) written by snapshot copies
        self._filled: list[tuple[int, np.ndarray]] = []

    def _dead_among(self, devices: Iterable[int]) -> set[int]:
        return self._inj._dead & {int(d) for d in devices}

    def execute(self, executable: Callable[..., Any], args: tuple[Any, ...], *, step: int,
                devices: Collection[int]) -> Any:
        self._step = step
        self._generation += 1
        for ev in self._inj._fire_due(step, ("lose_devices", "hang", "corrupt_snapshot")):
            if ev.kind == "corrupt_snapshot":
                self._corrupt_latest_copy()
            elif not set(ev.device_ids) & {int(d) for d in devices}:
                log.warning("mnemojax.testing: step %d: the injected %s of devices %s "
                            "touches no device of the current mesh (%d devices): nothing "
                            "to recover", step, ev.kind.replace("_", " "),
                            list(ev.device_ids), len(devices))
        if self._inj._fire_due(step, ("oom",)):
            raise jax.errors.JaxRuntimeError(
                f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate the buffers of "
                f"step {step} (injected by mnemojax.testing.FaultInjector)")
        if self._inj._take_transient(step):
            raise jax.errors.JaxRuntimeError(
                "UNAVAILABLE: collective timed out waiting for peers (transient; injected by "
                "mnemojax.testing.FaultInjector)")
        dead = self._dead_among(devices) - self._inj._hung
        if dead and self._inj._surface_for(dead) == "dispatch":
            self._inj._failure_surfaced = True
            raise _device_error(dead, f"launching step {step}")
        outputs = self._inner.execute(executable, args, step=step, devices=devices)
        if dead or self._inj._hung & {int(d) for d in devices}:
            self._poisoned.add(id(outputs))
        return outputs

    def block(self, outputs: Any, *, step: int, devices: Collection[int]) -> Any:
        if id(outputs) in self._poisoned:
            self._poisoned.discard(id(outputs))
            if self._inj._hung & {int(d) for d in devices}:
                self._inj._released.wait()  # a hung device never answers
            self._inj._failure_surfaced = True
            raise _device_error(self._dead_among(devices), f"waiting for step {step}")
        return self._inner.block(outputs, step=step, devices=devices)

    def wait_beside(self, outputs: Any, *, after_step: int, devices: Collection[int]) -> Any:
        self._inj._fire_due(after_step, ("lose_beside",))
        dead = self._dead_among(devices)
        if dead:
            self._inj._failure_surfaced = True
            raise _device_error(dead, f"waiting for work beside step {after_step}")
        return self._inner.wait_beside(outputs, after_step=after_step, devices=devices)

    def put(self, value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
        if self._inj._failure_surfaced:
            self._inj._fire_due(self._step, ("lose_during_recovery",))
        dead = self._dead_among(d.id for d in sharding.device_set)
        if dead:
            raise _device_error(dead, "host-to-device transfer")
        if isinstance(value, jax.Array) and not value.is_deleted():  # a device-side source
            gone = self._dead_among(d.id for d in value.sharding.device_set)
            if gone:
                raise _device_error(gone, "device-to-device transfer")
        return self._inner.put(value, sharding)

    def fetch(self, shard: jax.Shard) -> np.ndarray:
        if shard.device.id in self._inj._dead:
            raise _device_error([shard.device.id], "device-to-host transfer")
        return self._inner.fetch(shard)

    def fetch_into(self, piece: jax.Array, device_id: int, out: np.ndarray) -> None:
        if device_id in self._inj._dead:
            raise _device_error([device_id], "device-to-host transfer")
        self._inner.fetch_into(piece, device_id, out)
        self._filled.append((self._generation, out))
        del self._filled[:-4096]

    def _corrupt_latest_copy(self) -> None:
        older = [g for g, _ in self._filled if g < self._generation]
        if not older:
            return
        latest = max(older)
        flipped = 0
        for g, buf in self._filled:
            if g == latest and buf.size:
                buf.reshape(-1).view(np.uint8)[0] ^= 0x01
                flipped += 1
        self._inj.injected.append(InjectedFault("corrupted_buffers", self._step, (flipped,),
                                                time.perf_counter()))

    def memory_fractions(self, devices: Collection[Device], *, step: int) -> dict[str, float]:
        out = self._inner.memory_fractions(devices, step=step)
        forced = self._inj._memory_override(step)
        if forced is not None:
            out["host"] = forced
        return out

    def memory_headroom(self, device: Device) -> float | None:
        return self._inner.memory_headroom(device)

    def probe(self, device: Device, timeout_s: float) -> bool:
        if device.id in self._inj._dead:
            return False
        return self._inner.probe(device, timeout_s)
