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


def test_the_users_code_between_calls_of_the_step_is_no_hang_while_the_worker_speaks():
    """Between calls of the step (an eval, a save) nothing is judged by step times, however
    long: a worker saying it is alive (every second or so) is never hung there, one silent
    for ``min_s`` is (a frozen process). That time is no part of a step's interval."""
    wd = HangWatchdog(factor=5, min_s=3.0)
    wd.set_phase("train", 0.0)
    t = 0.0
    for i in range(1, 6):  # steps of 0.1 s, each followed by 0.4 s of the user's code
        wd.step_bounds(True, t)
        wd.progress(i, t + 0.1)
        wd.step_bounds(False, t + 0.1)
        t += 0.5
    assert wd.median_s() == pytest.approx(0.1)  # the calls only (the first one skipped)
    for s in range(1, 601):  # ten minutes of an eval, the worker alive
        wd.step_bounds(False, t + s)
        assert wd.hung(t + s + 0.9) is None
    t += 600
    assert wd.hung(t + 2.9) is None and wd.hung(t + 3.5) == pytest.approx(3.5)  # silent
    wd.step_bounds(True, t + 3.6)  # back in a call: judged by the step time again
    assert wd.hung(t + 3.6 + 2.9) is None and wd.hung(t + 3.6 + 3.1) == pytest.approx(3.1)


def test_a_worker_that_never_says_where_it_is_is_judged_as_before():
    wd = HangWatchdog(factor=5, min_s=1.0)
    wd.set_phase("train", 0.0)
    for i, t in enumerate([1.0, 1.5, 2.0, 2.5]):
        wd.progress(i + 1, t)
    assert wd.hung(4.0) is None and wd.hung(5.1) == pytest.approx(2.6)
