"""Budgets for recoveries and retries: composable stop rules and backoff."""

from mnemojax._src.retry import Attempts as Attempts
from mnemojax._src.retry import StopRule as StopRule
from mnemojax._src.retry import exponential_backoff as exponential_backoff
from mnemojax._src.retry import stop_after_attempt as stop_after_attempt
from mnemojax._src.retry import stop_after_delay as stop_after_delay
from mnemojax._src.retry import stop_never as stop_never

__all__ = [
    "Attempts",
    "StopRule",
    "exponential_backoff",
    "stop_after_attempt",
    "stop_after_delay",
    "stop_never",
]
