"""One facade for metrics: every figure goes to `jax.monitoring` under ``/mnemojax/...``."""

from __future__ import annotations

import jax

from mnemojax._src.statistics import RecoveryRecord


def record_recovery(record: RecoveryRecord) -> None:
    for phase, seconds in record.phases_s.items():
        jax.monitoring.record_event_duration_secs(f"/mnemojax/recovery/{phase}", seconds)
    jax.monitoring.record_event_duration_secs("/mnemojax/recovery/total", record.total_s)
    jax.monitoring.record_event("/mnemojax/recovery/count")
