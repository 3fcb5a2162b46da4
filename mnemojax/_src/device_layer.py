"""The device layer: the narrow interface through which the runtime touches devices.

Every execution, transfer and health probe goes through a `DeviceLayer`. In production it
is `JaxDeviceLayer`, a thin pass-through to JAX. Interposers (such as
`mnemojax.testing.FaultInjector`) wrap it the way an interception library wraps a driver:
they see every operation with the devices it touches and can make it fail as real hardware
would, without the runtime knowing they are there.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Collection
from typing import Any, Protocol

import jax
import numpy as np

from mnemojax._src.data import HostRows
from mnemojax._src.distributed.snapshot_codec import HostBlocks
from mnemojax._src.triggers import host_memory_fraction

# `jax.Device` is a runtime alias of jaxlib's compiled (unstubbed) `Device` class, so
# type checkers cannot use it in annotations; this alias keeps the intent readable.
Device = Any


class DeviceLayer(Protocol):
    """What the runtime needs from devices; `JaxDeviceLayer` and the fault injector's
    interposed layer implement it."""

    def execute(self, executable: Callable[..., Any], args: tuple[Any, ...], *, step: int,
                devices: Collection[int]) -> Any:
        """Dispatches `executable(*args)` on `devices`; returns its (future) outputs."""
        ...

    def block(self, outputs: Any, *, step: int, devices: Collection[int]) -> Any:
        """Waits for `outputs`; raises what the device raised."""
        ...

    def wait_beside(self, outputs: Any, *, after_step: int, devices: Collection[int]) -> Any:
        """Waits for the outputs of work run beside the steps, after step `after_step`
        (`ResilientStep.guard`: the user's eval on the training state); raises what the
        device raised."""
        ...

    def put(self, value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
        """Places a host value on devices."""
        ...

    def fetch(self, shard: jax.Shard) -> np.ndarray:
        """Reads one addressable shard to a fresh host array (a copy, never a view)."""
        ...

    def fetch_into(self, piece: jax.Array, device_id: int, out: np.ndarray) -> None:
        """Reads a single-device array (one shard, on `device_id`) into a preallocated
        host buffer."""
        ...

    def probe(self, device: Device, timeout_s: float) -> bool:
        """True if the device answers a tiny round trip within `timeout_s`."""
        ...

    def memory_fractions(self, devices: Collection[Device], *, step: int) -> dict[str, float]:
        """Memory in use over its limit: ``{"host": f, "device:<id>": f, ...}``."""
        ...

    def memory_headroom(self, device: Device) -> float | None:
        """How many times its peak use so far the device's memory could hold, or None
        where it does not say (CPU) or cannot be asked (a dead device)."""
        ...


def _from_callback(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``value``'s pieces on this process's devices of ``sharding``. A process with no
    device of ``sharding`` holds none and reads nothing (``make_array_from_callback``
    would read the whole of a replicated value, and needs a local shard for the dtype)."""
    if not sharding.addressable_devices:
        return jax.make_array_from_single_device_arrays(value.shape, sharding, [],
                                                        dtype=value.dtype)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def put_host(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host value (numpy, or `HostRows`) placed by `sharding`. Across processes every
    process holds the same global value (or `HostRows`, which read rows when indexed) and
    puts only the pieces its own devices hold: no collective, where ``jax.device_put``
    checks across the processes that they hold the same value (one, which a dead peer
    blocks)."""
    if sharding.is_fully_addressable:
        return jax.device_put(np.asarray(value) if isinstance(value, HostRows) else value,
                              sharding)
    if not isinstance(value, HostRows):
        value = np.asarray(value)
    return _from_callback(value, sharding)


class JaxDeviceLayer:
    """The real device layer: plain JAX calls."""

    def __init__(self) -> None:
        self._probe_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="mnemojax-probe")

    def execute(self, executable: Callable[..., Any], args: tuple[Any, ...], *, step: int,
                devices: Collection[int]) -> Any:
        del step, devices
        return executable(*args)

    def block(self, outputs: Any, *, step: int, devices: Collection[int]) -> Any:
        del step, devices
        return jax.block_until_ready(outputs)

    def wait_beside(self, outputs: Any, *, after_step: int, devices: Collection[int]) -> Any:
        del after_step, devices
        return jax.block_until_ready(outputs)

    def put(self, value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
        if isinstance(value, HostBlocks):  # builds only the blocks the devices hold
            return _from_callback(value, sharding)
        return put_host(value, sharding)

    def fetch(self, shard: jax.Shard) -> np.ndarray:
        return np.array(shard.data, copy=True)

    def fetch_into(self, piece: jax.Array, device_id: int, out: np.ndarray) -> None:
        del device_id
        # On CPU `np.asarray` is a zero-copy view of the device buffer: copy it out now.
        np.copyto(out, np.asarray(piece))

    def memory_fractions(self, devices: Collection[Device], *, step: int) -> dict[str, float]:
        del step
        out: dict[str, float] = {}
        host = host_memory_fraction()
        if host is not None:
            out["host"] = host
        me = jax.process_index()
        for d in devices:
            if d.process_index != me:  # another process's device: it samples its own
                continue
            stats = d.memory_stats() if hasattr(d, "memory_stats") else None
            if stats and stats.get("bytes_limit"):
                out[f"device:{d.id}"] = stats["bytes_in_use"] / stats["bytes_limit"]
        return out

    def memory_headroom(self, device: Device) -> float | None:
        try:
            stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        except Exception:  # noqa: BLE001 - a device that cannot answer says nothing here
            return None
        if not stats:
            return None
        limit = stats.get("bytes_limit")
        used = stats.get("peak_bytes_in_use") or stats.get("bytes_in_use")
        return limit / used if limit and used else None

    def probe(self, device: Device, timeout_s: float) -> bool:
        def round_trip() -> float:
            return float(np.asarray(jax.device_put(np.ones((), np.float32), device)))

        future = self._probe_pool.submit(round_trip)
        try:
            return future.result(timeout=timeout_s) == 1.0
        except concurrent.futures.TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - any error on a probe means the device is unusable
            return False
