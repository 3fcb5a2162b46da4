"""The device proxy, in-process half: owns the mesh and device health, runs the step and
classifies every error.

The proxy is the only code that dispatches steps. It sees errors first and sorts them:

* ``device_failure``: a JAX runtime error, and a health probe finds dead devices in the
  mesh. Triggers recovery.
* ``transient``: a JAX runtime error with a retryable status (UNAVAILABLE,
  DEADLINE_EXCEEDED, ABORTED, CANCELLED, connection reset) and every device healthy.
  Retried in place with backoff; the mesh does not change.
* ``user``: everything else (shape and type errors, user exceptions, INVALID_ARGUMENT,
  out of memory). Re-raised unchanged; never starts a recovery.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import queue
import re
import threading
import time
from collections.abc import Collection, Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import Mesh

from mnemojax._src.data import HostRows
from mnemojax._src.device_layer import DeviceLayer
from mnemojax._src.distributed.worker import peer_watch
from mnemojax._src.errors import BatchSplitError, StepHangError
from mnemojax._src.step_forms import batch_splits, example_axes
from mnemojax._src.topology import MeshPlan

VerdictKind = Literal["device_failure", "transient", "user"]

_TRANSIENT = re.compile(
    r"UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED|CANCELLED|Connection reset|timed out", re.I)


@dataclasses.dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    failed: tuple[int, ...] = ()
    detect_s: float = 0.0


class DeviceProxy:
    """Owns the current mesh, the set of dead devices and the spare pool."""

    def __init__(self, layer: DeviceLayer, plan: MeshPlan, mesh: Mesh, spares: Sequence[int],
                 *, batch_axes: Sequence[str], probe_timeout_s: float,
                 dead: Collection[int] = ()):
        self.layer = layer
        self._batch_axes = tuple(batch_axes)
        self.plan = plan
        self.mesh = mesh
        self.dead: set[int] = {int(d) for d in dead}
        self.spares: list[int] = [int(s) for s in spares if int(s) not in self.dead]
        self._probe_timeout_s = probe_timeout_s
        self._by_id = {d.id: d for d in jax.devices()}
        self._devices = frozenset(int(i) for i in plan.device_ids.flat)
        self._waiter = _Waiter()

    def close(self) -> None:
        """Stops the thread that waits for step results."""
        self._waiter.close()

    def spares_after(self, plan: MeshPlan) -> list[int]:
        """The spare pool once `plan` is adopted: spares it leaves out, then its idle
        devices."""
        devices = {int(i) for i in plan.device_ids.flat}
        pool = [s for s in self.spares if s not in devices] + list(plan.idle)
        return [d for d in dict.fromkeys(pool) if d not in self.dead and d not in devices]

    def device_places(self) -> dict[int, tuple[int, int]]:
        """Per device of the world: (process index, rank among that process's devices).

        A new multi-process world renumbers devices; the planner maps these places to the
        new ids (`topology.renumber_devices`).
        """
        by_process: dict[int, list[int]] = {}
        for d in sorted(self._by_id.values(), key=lambda d: d.id):
            by_process.setdefault(d.process_index, []).append(d.id)
        return {i: (p, rank) for p, ids in by_process.items() for rank, i in enumerate(ids)}

    def place_batch(self, host_batch, shardings, examples: int | None):
        """Splits the global host batch over the mesh along the data axis."""
        width = self.data_width()

        def place(path, x, sharding, split, axis):
            if split and examples is not None and x.shape[axis] != examples:
                x = x.head(examples) if isinstance(x, HostRows) else (
                    x[(slice(None),) * axis + (slice(examples),)])
            if split and sharding.spec and x.shape[axis] % width:
                raise BatchSplitError(
                    f"batch leaf {jax.tree_util.keystr(path)} has {x.shape[axis]} examples, "
                    f"which the data axis of width {width} cannot split evenly")
            return self.layer.put(x, sharding)  # (`put_host`: rows of `HostRows` too)

        return jax.tree_util.tree_map_with_path(place, host_batch, shardings,
                                                batch_splits(host_batch),
                                                example_axes(host_batch))

    def data_width(self) -> int:
        return math.prod(int(self.mesh.shape.get(a, 1)) for a in self._batch_axes)

    def run(self, executable, leaves, device_batch, step: int, *,
            timeout_s: float | None = None):
        """Runs one step and waits for it, at most `timeout_s` (then `StepHangError`);
        whatever fails propagates to `classify`. Under `mnemojax launch`, a peer's death
        already heard of fails the step before it starts (`peer_watch.known_death`)."""
        if (error := peer_watch.known_death()) is not None:
            raise error
        out = self.layer.execute(executable, (leaves, device_batch), step=step,
                                 devices=self._devices)
        if timeout_s is None:
            return self.layer.block(out, step=step, devices=self._devices)
        return self._waiter.wait(self.layer.block, out, step, self._devices, timeout_s)

    def await_outputs(self, outputs, *, timeout_s: float, step: int):
        """Waits for the outputs of work run beside the steps (a warm-up,
        `StepCompiler.warm_one`) as for a step's: at most ``timeout_s``, then
        `StepHangError`; the device layer's own wait (and its injected faults) is not
        used, so the step's faults fire where they were set."""
        return self._waiter.wait(lambda out, step, devices: jax.block_until_ready(out),
                                 outputs, step, self._devices, timeout_s)

    def await_beside(self, outputs, *, after_step: int):
        """Waits for the outputs of guarded work run after step `after_step`
        (`ResilientStep.guard`) through the device layer's `wait_beside`, abortable like a
        step's wait, unbounded (an eval may take many step-times)."""
        return self._waiter.wait(
            lambda out, step, devices: self.layer.wait_beside(out, after_step=step,
                                                              devices=devices),
            outputs, after_step, self._devices, None)

    def classify(self, exc: BaseException) -> Verdict:
        """Sorts an exception raised by `run` or a transfer (see module docstring)."""
        t0 = time.perf_counter()
        if not isinstance(exc, jax.errors.JaxRuntimeError | StepHangError):
            return Verdict("user")
        newly_dead = self.probe_all()
        failed_in_mesh = tuple(sorted(d for d in newly_dead if d in self._devices))
        if failed_in_mesh:
            return Verdict("device_failure", failed_in_mesh, time.perf_counter() - t0)
        if newly_dead or isinstance(exc, StepHangError) or _TRANSIENT.search(str(exc)):
            return Verdict("transient", (), time.perf_counter() - t0)
        return Verdict("user")

    def probe_all(self) -> set[int]:
        """Probes every mesh device and spare this process can reach; returns (and records)
        the newly dead ones. (Other processes' devices are theirs to probe; their loss
        shows up as a peer failure.)"""
        newly = set()
        me = jax.process_index()
        for dev_id in sorted(self._devices | set(self.spares)):
            if dev_id in self.dead or self._by_id[dev_id].process_index != me:
                continue
            if not self.layer.probe(self._by_id[dev_id], self._probe_timeout_s):
                newly.add(dev_id)
        self.dead |= newly
        self.spares = [s for s in self.spares if s not in self.dead]
        return newly


class _Waiter:
    """Waits for step results on a daemon thread, so a hung device cannot hang the caller.

    One long-lived thread serves every step (a thread per step would cost more). When a
    wait times out, that thread is abandoned (it stays blocked on the hung device; as a
    daemon it never blocks interpreter exit) and a fresh one serves the next steps.
    """

    def __init__(self):
        self._thread = None
        self._requests: queue.SimpleQueue | None = None

    def _start(self) -> queue.SimpleQueue:
        self._requests = requests = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(requests,),
                                        daemon=True, name="mnemojax-wait")
        self._thread.start()
        return requests

    @staticmethod
    def _serve(requests):
        while True:
            request = requests.get()
            if request is None:  # closed
                return
            fn, args, future = request
            try:
                result = fn(*args[:1], step=args[1], devices=args[2])
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_result(result)  # unless a peer's death failed it first
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(exc)
            # Hold nothing of an abandoned step: its arrays keep the old world's client.
            request = fn = args = future = result = None

    def close(self) -> None:
        """Ends the serving thread once it is idle (an abandoned one stays blocked)."""
        if self._requests is not None:
            self._requests.put(None)
        self._thread = self._requests = None

    def wait(self, block, outputs, step, devices, timeout_s):
        requests = self._requests
        if self._thread is None or requests is None:
            requests = self._start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        requests.put((block, (outputs, step, devices), future))
        # Under `mnemojax launch`, a peer's death known to the launcher fails the wait at
        # once (`peer_watch`), where gloo on CPU would block until its collective timeout.
        with peer_watch.abortable(future) as handle:
            try:
                return future.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                self._thread = None  # abandoned with the hung wait
                raise StepHangError(
                    f"step {step}: results not ready after {timeout_s:.1f} s (hang timeout)",
                    step=step, timeout_s=timeout_s) from None
            except BaseException:
                if handle.aborted:  # its serving thread is stuck in the old collective
                    handle.leave_behind(self._thread)
                    self.close()  # that thread ends once the collective returns
                raise


# Statuses that no peer's death causes: this process's own error (out of memory, a bad
# argument), raised as it is under a session too, never taken for a peer failure.
_LOCAL = re.compile(r"^\s*(RESOURCE_EXHAUSTED|INVALID_ARGUMENT|UNIMPLEMENTED)\b")


def looks_local(exc: BaseException) -> bool:
    """An error of this process itself (out of memory, an invalid argument): under a
    session it must not start a world recovery, which would plan the same mesh again and
    fail the same way until the budget ends (a gloo error is never local)."""
    text = str(exc)
    return "gloo" not in text.lower() and bool(_LOCAL.match(text))


def looks_transient(exc: BaseException) -> bool:
    """A retryable status that is not a CPU collective failing on a peer (gloo reports a
    dead peer as a connection reset or a timeout, which must not be retried in place)."""
    text = str(exc)
    return "gloo" not in text.lower() and bool(_TRANSIENT.search(text))


def host_batch(batch):
    """The batch as a pytree of numpy arrays (host memory), validated. `HostRows` leaves
    stay unread: placing the batch reads the rows this process's devices hold."""
    return jax.tree.map(lambda x: x if isinstance(x, HostRows) else np.asarray(x), batch)
