"""`device_layer.JaxDeviceLayer`: what it reads from the devices."""

from __future__ import annotations

from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax.testing import FaultInjector


def test_memory_headroom_is_the_limit_over_the_peak_where_a_device_says():
    """Also through a fault injector's layer, which passes it on."""

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    for headroom in (JaxDeviceLayer().memory_headroom,
                     FaultInjector().wrap(JaxDeviceLayer()).memory_headroom):
        _check(headroom, Device)


def _check(headroom, Device) -> None:
    assert headroom(Device({"bytes_limit": 80, "peak_bytes_in_use": 40,
                            "bytes_in_use": 10})) == 2.0
    assert headroom(Device({"bytes_limit": 80, "bytes_in_use": 20})) == 4.0
    assert headroom(Device(None)) is None  # CPU
    assert headroom(Device({"bytes_limit": 80})) is None
    assert headroom(Device(RuntimeError("device lost"))) is None
