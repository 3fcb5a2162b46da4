"""Reads the costs measured by ``mnemojax bench`` and maps them onto simulator options.

Schema (every key optional; missing keys keep the flag or built-in default)::

    {
      "step_time_s": 0.03,              # the benchmark's own step (recorded, not used)
      "snapshot_overhead_frac": 0.012,  # steady-state snapshot cost / step time
      "recovery": {
        "phases_s": {"detect": 6.9, "agree": 0.2, "source": 0.1, "plan": 0.01,
                     "reshard": 0.03, "compile": 1.7, "replay": 0.03}
      },
      "baseline": {"detect_s": 10, "restart_s": 25.0, "compile_s": 10.0,
                   "checkpoint_save_s": 3.0, "checkpoint_restore_s": 5.0}
    }

Scaling rules (why the measured seconds are used this way at 1k-128k accelerators):
  * detect, agree (+ source), plan, compile: used as measured. Detection is set by the
    heartbeat / collective timeout, not by size; agreement is one barrier; the compile phase
    fetches an executable compiled ahead of time, per host and in parallel.
  * reshard: the measured value is kept as the fixed latency; moving one host's state at
    scale (``state_bytes_per_host / host_bandwidth``) is added by the simulator.
  * replay: not a cost. Re-running the failed step redoes the lost work, which the
    simulator already books as lost work (< one step).
  * snapshot_overhead_frac: used as measured (a ratio, so it transfers better than seconds).
  * baseline: the classical restart measured on a small job. ``restart_s`` (relaunch to the
    first step, without detection and restore) is booked as program startup. These are
    lower bounds at scale, where scheduling and initialising thousands of processes take
    minutes; prefer the ``--classical-*`` flags for projections.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from mnemojax._src.simulator.config import SimulationConfigError

# bench JSON key -> simulator override key
_PHASES = {
    "detect": "mnemojax.detect_s",
    "plan": "mnemojax.plan_s",
    "reshard": "mnemojax.reshard_fixed_s",
    "compile": "mnemojax.compile_s",
}
_BASELINE = {
    "detect_s": "restart.detect_s",
    "restart_s": "restart.startup_s",
    "startup_s": "restart.startup_s",
    "compile_s": "restart.compile_s",
    "checkpoint_save_s": "classical.checkpoint_save_s",
    "checkpoint_restore_s": "classical.checkpoint_restore_s",
}


def _number(path: str, where: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise SimulationConfigError(
            f"{where}: {path}={value!r} is invalid: expected a finite number >= 0"
        )
    return float(value)


def load_bench_costs(path: str | pathlib.Path) -> dict[str, float]:
    """Reads a bench JSON and returns overrides keyed ``"<group>.<field>"``.

    Groups: ``mnemojax`` (`MnemojaxOptions`), ``restart`` (`RestartCosts` of both
    full-restart strategies) and ``classical`` (`ClassicalOptions`).

    Raises:
        SimulationConfigError: unreadable file, invalid JSON, or a negative / non-numeric
            value (the message names the key).
    """
    where = f"bench_json={str(path)!r}"
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SimulationConfigError(f"{where} is invalid: {e}") from e
    if not isinstance(data, dict):
        raise SimulationConfigError(f"{where} is invalid: expected a JSON object")
    out: dict[str, float] = {}
    if "snapshot_overhead_frac" in data:
        frac = _number("snapshot_overhead_frac", where, data["snapshot_overhead_frac"])
        if frac >= 1:
            raise SimulationConfigError(
                f"{where}: snapshot_overhead_frac={frac!r} is invalid: expected [0, 1)"
            )
        out["mnemojax.snapshot_overhead_frac"] = frac
    phases = (data.get("recovery") or {}).get("phases_s") or {}
    for key, target in _PHASES.items():
        if key in phases:
            out[target] = _number(f"recovery.phases_s.{key}", where, phases[key])
    agree = [phases[k] for k in ("agree", "source") if k in phases]
    if agree:
        out["mnemojax.agree_s"] = sum(_number("recovery.phases_s.agree", where, v) for v in agree)
    for key, target in _BASELINE.items():
        if key in (data.get("baseline") or {}):
            out[target] = _number(f"baseline.{key}", where, data["baseline"][key])
    return out
