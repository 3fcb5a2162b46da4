"""The fault injector behaves like hardware: it fails operations, never calls recovery."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax.errors import InvalidOptionError
from mnemojax.testing import FaultInjector
from tests import helpers as h

pytestmark = pytest.mark.needs8


def _exe():
    return jax.jit(lambda x: x * 2)


def test_dispatch_surface_fails_at_launch_and_device_stays_dead():
    faults = FaultInjector().lose_devices(2, [3])
    layer = faults.wrap(JaxDeviceLayer())
    x = np.ones(4, np.float32)
    assert layer.execute(_exe(), (x,), step=1, devices={3})[0] == 2
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"\[3\] are lost"):
        layer.execute(_exe(), (x,), step=2, devices={0, 3})
    with pytest.raises(jax.errors.JaxRuntimeError):
        layer.execute(_exe(), (x,), step=9, devices={3})
    assert layer.execute(_exe(), (x,), step=9, devices={0, 1})[0] == 2  # others still work
    assert not layer.probe(jax.devices()[3], 1.0) and layer.probe(jax.devices()[2], 5.0)
    assert faults.dead_devices == {3} and [f.step for f in faults.injected] == [2]


def test_block_surface_fails_when_waiting():
    faults = FaultInjector().lose_devices(1, [1], surface="block")
    layer = faults.wrap(JaxDeviceLayer())
    out = layer.execute(_exe(), (np.ones(2, np.float32),), step=1, devices={0, 1})
    with pytest.raises(jax.errors.JaxRuntimeError, match="waiting for step 1"):
        layer.block(out, step=1, devices={0, 1})


def test_transfers_touching_dead_devices_fail():
    faults = FaultInjector().lose_devices(1, [5])
    layer = faults.wrap(JaxDeviceLayer())
    mesh = h.mesh_of((4, 2))
    arr = layer.put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(jax.errors.JaxRuntimeError):
        layer.execute(_exe(), (arr,), step=1, devices=range(8))
    with pytest.raises(jax.errors.JaxRuntimeError, match="host-to-device"):
        layer.put(np.zeros(8, np.float32), NamedSharding(mesh, P("data")))
    shard5 = next(s for s in arr.addressable_shards if s.device.id == 5)
    with pytest.raises(jax.errors.JaxRuntimeError, match="device-to-host"):
        layer.fetch(shard5)
    shard0 = next(s for s in arr.addressable_shards if s.device.id == 0)
    np.testing.assert_array_equal(layer.fetch(shard0), [0, 1])


def test_out_of_memory_fails_that_launch_once_and_is_no_device_loss():
    faults = FaultInjector().out_of_memory(2)
    layer = faults.wrap(JaxDeviceLayer())
    x = np.ones(4, np.float32)
    assert layer.execute(_exe(), (x,), step=1, devices={0})[0] == 2
    with pytest.raises(jax.errors.JaxRuntimeError, match="^RESOURCE_EXHAUSTED"):
        layer.execute(_exe(), (x,), step=2, devices={0})
    assert layer.execute(_exe(), (x,), step=2, devices={0})[0] == 2  # once
    assert faults.dead_devices == frozenset() and [f.kind for f in faults.injected] == ["oom"]
    with pytest.raises(InvalidOptionError, match="at_step=0"):
        FaultInjector().out_of_memory(0)


def test_bad_schedule_is_rejected():
    with pytest.raises(InvalidOptionError, match="at_step=0"):
        FaultInjector().lose_devices(0, [1])
    with pytest.raises(InvalidOptionError, match="surface='later'"):
        FaultInjector().lose_devices(1, [1], surface="later")
    with pytest.raises(InvalidOptionError, match="device_ids"):
        FaultInjector().lose_devices(1, [])
