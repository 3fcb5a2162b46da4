"""Budgets: composable stop rules and backoff, with an injectable clock.

A stop rule looks at an `Attempts` record and says whether to give up::

    stop_after_attempt(3) | stop_after_delay(600.0)   # 3 attempts or 10 minutes
    stop_after_attempt(5) & stop_after_delay(30.0)    # both must be exceeded

Rules and backoffs are frozen dataclasses, so they live inside frozen options.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from mnemojax._src.errors import InvalidOptionError


@dataclasses.dataclass(frozen=True)
class Attempts:
    """How many attempts were made, since when (seconds on the injected clock)."""

    count: int
    elapsed_s: float


class StopRule(Protocol):
    """Says, from the attempts so far, whether to give up. Rules combine with ``|`` (stop
    when either says so) and ``&`` (when both do)."""

    def __call__(self, attempts: Attempts) -> bool: ...

    def __or__(self, other: StopRule) -> StopRule: ...

    def __and__(self, other: StopRule) -> StopRule: ...


class _Combinable:
    def __call__(self, attempts: Attempts) -> bool:
        raise NotImplementedError

    def __or__(self, other: StopRule) -> StopAny:
        return StopAny((self, other))

    def __and__(self, other: StopRule) -> StopAll:
        return StopAll((self, other))


@dataclasses.dataclass(frozen=True)
class stop_after_attempt(_Combinable):  # noqa: N801 - reads like tenacity's rules
    """Stop once `max_attempts` attempts were made."""

    max_attempts: int

    def __post_init__(self):
        if not isinstance(self.max_attempts, int) or self.max_attempts < 0:
            raise InvalidOptionError(
                f"max_attempts={self.max_attempts!r} is invalid: expected an int >= 0")

    def __call__(self, attempts: Attempts) -> bool:
        return attempts.count >= self.max_attempts


@dataclasses.dataclass(frozen=True)
class stop_after_delay(_Combinable):  # noqa: N801
    """Stop once `max_delay_s` seconds have passed since the first attempt."""

    max_delay_s: float

    def __post_init__(self):
        if not self.max_delay_s >= 0:
            raise InvalidOptionError(
                f"max_delay_s={self.max_delay_s!r} is invalid: expected seconds >= 0")

    def __call__(self, attempts: Attempts) -> bool:
        return attempts.elapsed_s >= self.max_delay_s


@dataclasses.dataclass(frozen=True)
class stop_never(_Combinable):  # noqa: N801
    """Never stop."""

    def __call__(self, attempts: Attempts) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class StopAny(_Combinable):
    """Stop when any of `rules` says so."""

    rules: tuple[StopRule, ...]

    def __call__(self, attempts: Attempts) -> bool:
        return any(rule(attempts) for rule in self.rules)


@dataclasses.dataclass(frozen=True)
class StopAll(_Combinable):
    """Stop when every one of `rules` says so."""

    rules: tuple[StopRule, ...]

    def __call__(self, attempts: Attempts) -> bool:
        return all(rule(attempts) for rule in self.rules)


@dataclasses.dataclass(frozen=True)
class exponential_backoff:  # noqa: N801
    """Waits `initial_s * factor**(n-1)` before attempt n+1, at most `max_s`."""

    initial_s: float = 0.05
    factor: float = 2.0
    max_s: float = 5.0

    def __post_init__(self):
        if not (self.initial_s >= 0 and self.factor >= 1 and self.max_s >= self.initial_s):
            raise InvalidOptionError(
                f"exponential_backoff(initial_s={self.initial_s!r}, factor={self.factor!r}, "
                f"max_s={self.max_s!r}) is invalid: expected initial_s >= 0, factor >= 1, "
                "max_s >= initial_s")

    def __call__(self, attempt: int) -> float:
        return min(self.max_s, self.initial_s * self.factor ** max(attempt - 1, 0))


def is_stop_rule(value) -> bool:
    return callable(value) and isinstance(value, _Combinable)
