"""`distributed.agent.watchdog`: the hang rule on step times."""

from __future__ import annotations

import pytest

from mnemojax._src.distributed.agent.watchdog import HangWatchdog


def test_watchdog_uses_median_and_exempts_non_train_phases():
    wd = HangWatchdog(factor=5, min_s=1.0)
    wd.set_phase("compile", 0.0)
    assert wd.hung(1000.0) is None  # compiling is never a hang
    wd.set_phase("train", 100.0)
    for i, t in enumerate([105.0, 105.5, 106.0, 106.4, 106.9]):  # first interval skipped
        wd.progress(i + 1, t)
    assert wd.median_s() == pytest.approx(0.5)
    assert wd.threshold_s() == pytest.approx(2.5)
    assert wd.hung(108.0) is None
    assert wd.hung(110.0) == pytest.approx(3.1)
    wd.set_phase("recover", 110.0)
    assert wd.hung(500.0) is None


def test_watchdog_floor():
    wd = HangWatchdog(factor=10, min_s=30.0)
    wd.set_phase("train", 0.0)
    for i in range(4):
        wd.progress(i, 0.1 * i)
    assert wd.threshold_s() == 30.0


def test_reset_forgets_the_previous_worker():
    wd = HangWatchdog(factor=5, min_s=1.0)
    wd.set_phase("train", 0.0)
    for i in range(4):
        wd.progress(i, 1.0 + i)
    assert wd.median_s() == 1.0 and wd.step == 3
    wd.reset()
    assert (wd.phase, wd.step, wd.median_s(), wd.hung(1000.0)) == ("start", None, None, None)
