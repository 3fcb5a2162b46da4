"""Stop rules and backoff (mnemojax._src.retry): composition, validation, schedules."""

import dataclasses

import pytest

import mnemojax
from mnemojax._src.retry import (
    Attempts,
    StopAll,
    StopAny,
    exponential_backoff,
    is_stop_rule,
    stop_after_attempt,
    stop_after_delay,
    stop_never,
)
from mnemojax.errors import InvalidOptionError


def _at(count, elapsed_s=0.0):
    return Attempts(count=count, elapsed_s=elapsed_s)


def test_stop_after_attempt_counts_attempts_only():
    rule = stop_after_attempt(3)
    assert [rule(_at(n, 1e9 if n == 0 else 0.0)) for n in range(5)] == [
        False, False, False, True, True]
    assert stop_after_attempt(0)(_at(0))  # a budget of nothing stops at once


def test_stop_after_delay_looks_at_elapsed_time_only():
    rule = stop_after_delay(600.0)
    assert not rule(_at(10**6, 599.9))
    assert rule(_at(1, 600.0)) and rule(_at(1, 601.0))


def test_stop_never_never_stops():
    assert not stop_never()(_at(10**9, 1e12))


@pytest.mark.parametrize("attempts,elapsed_s,either,both", [
    (0, 0.0, False, False),
    (3, 0.0, True, False),     # attempts exceeded only
    (1, 600.0, True, False),   # time exceeded only
    (3, 600.0, True, True),    # both
])
def test_or_stops_on_either_and_on_both(attempts, elapsed_s, either, both):
    at = _at(attempts, elapsed_s)
    assert (stop_after_attempt(3) | stop_after_delay(600.0))(at) is either
    assert (stop_after_attempt(3) & stop_after_delay(600.0))(at) is both


def test_composition_builds_flat_inspectable_values_and_nests():
    either = stop_after_attempt(3) | stop_after_delay(1.0)
    assert isinstance(either, StopAny)
    assert either.rules == (stop_after_attempt(3), stop_after_delay(1.0))
    both = stop_after_attempt(3) & stop_after_delay(1.0)
    assert isinstance(both, StopAll)
    # (a & b) | c: c alone stops; a alone does not.
    nested = both | stop_after_attempt(10)
    assert nested(_at(10))
    assert not nested(_at(3, 0.5))
    assert nested(_at(3, 1.0))
    # Composite rules compose again and stay stop rules.
    assert is_stop_rule(nested) and is_stop_rule(nested & stop_never())
    assert not (nested & stop_never())(_at(100, 100.0))


def test_rules_are_frozen_hashable_values():
    rule = stop_after_attempt(3) | stop_after_delay(600.0)
    assert rule == stop_after_attempt(3) | stop_after_delay(600.0)
    assert hash(rule) == hash(stop_after_attempt(3) | stop_after_delay(600.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.rules = ()  # type: ignore[misc]


def test_only_combinable_rules_count_as_stop_rules():
    assert is_stop_rule(stop_after_attempt(1))
    assert not is_stop_rule(lambda attempts: True)  # a bare callable is not a rule
    assert not is_stop_rule(3)


@pytest.mark.parametrize("make,shown", [
    (lambda: stop_after_attempt(-1), "max_attempts=-1"),
    (lambda: stop_after_attempt(2.5), "max_attempts=2.5"),
    (lambda: stop_after_delay(-0.5), "max_delay_s=-0.5"),
    (lambda: stop_after_delay(float("nan")), "max_delay_s=nan"),
    (lambda: exponential_backoff(initial_s=-1.0), "initial_s=-1.0"),
    (lambda: exponential_backoff(factor=0.5), "factor=0.5"),
    (lambda: exponential_backoff(initial_s=2.0, max_s=1.0), "max_s=1.0"),
])
def test_invalid_values_are_typed_errors_that_show_the_value(make, shown):
    with pytest.raises(InvalidOptionError, match=shown) as info:
        make()
    assert isinstance(info.value, ValueError) and "expected" in str(info.value)


def test_exponential_backoff_schedule_and_cap():
    backoff = exponential_backoff(initial_s=0.5, factor=3.0, max_s=10.0)
    assert [backoff(n) for n in range(1, 6)] == [0.5, 1.5, 4.5, 10.0, 10.0]
    assert backoff(0) == 0.5  # attempt numbers start at 1; 0 is treated like 1
    assert [exponential_backoff(1.0, 1.0, 1.0)(n) for n in (1, 5, 50)] == [1.0, 1.0, 1.0]
    assert exponential_backoff(0.0, 2.0, 0.0)(7) == 0.0


def test_a_retry_loop_with_injected_clock_and_sleep_never_sleeps():
    """The way the runtime drives these rules: count attempts and elapsed time on an
    injected clock, sleep the backoff through an injected sleep."""
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    rule = stop_after_attempt(10) | stop_after_delay(3.0)
    backoff = exponential_backoff(initial_s=0.5, factor=2.0, max_s=5.0)
    t_first, attempts = now[0], 0
    while True:
        attempts += 1  # the attempt fails
        if rule(Attempts(attempts, now[0] - t_first)):
            break
        sleep(backoff(attempts))
    assert slept == [0.5, 1.0, 2.0]  # 3.5 s waited: the time budget stopped it, not the count
    assert attempts == 4


def test_public_module_exports_the_rules_and_options_accept_them():
    rule = mnemojax.retry.stop_after_attempt(2) | mnemojax.retry.stop_after_delay(5.0)
    opts = mnemojax.RecoveryOptions(stop=rule, retry_stop=mnemojax.retry.stop_never(),
                                    retry_backoff=mnemojax.retry.exponential_backoff(0.0))
    assert opts.stop is rule
    with pytest.raises(InvalidOptionError, match="stop="):
        mnemojax.RecoveryOptions(stop=lambda attempts: True)
