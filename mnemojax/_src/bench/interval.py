"""The baseline's checkpoint interval: Young's rule τ = √(2·δ·M).

δ is the blocking cost of one checkpoint save (measured in the same bench run), M the
stated mean time between failures. Young (1974) minimises the expected waste δ/τ + τ/2M
to first order; Daly (2006) refines it for δ not small against M, and both agree while
δ << M, which holds here. τ is converted to steps with the measured step time and
clamped to [1, steps].
"""

from __future__ import annotations

import dataclasses
import math

from mnemojax._src.errors import InvalidOptionError


@dataclasses.dataclass(frozen=True)
class CheckpointInterval:
    """A chosen checkpoint interval and its inputs.

    Attributes:
        save_cost_s: δ, the blocking seconds of one save.
        mtbf_s: M, the stated mean time between failures.
        step_time_s: seconds per training step, to convert τ into steps.
        interval_s: τ = √(2·δ·M).
        steps: τ in whole steps, clamped to [1, max_steps].
        clamped: the clamp changed the rounded value.
    """

    save_cost_s: float
    mtbf_s: float
    step_time_s: float
    interval_s: float
    steps: int
    clamped: bool
    rule: str = "young_daly: tau = sqrt(2 * save_cost_s * mtbf_s)"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """τ = √(2·δ·M), seconds of work between two checkpoints.

    Raises:
        InvalidOptionError: δ < 0 or M <= 0 (or not finite).
    """
    if not (math.isfinite(save_cost_s) and save_cost_s >= 0):
        raise InvalidOptionError(f"save_cost_s={save_cost_s!r} is invalid: expected >= 0")
    if not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise InvalidOptionError(f"mtbf_s={mtbf_s!r} is invalid: expected > 0")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def checkpoint_interval(save_cost_s: float, mtbf_s: float, step_time_s: float,
                        max_steps: int) -> CheckpointInterval:
    """The Young/Daly interval in steps: round(τ / step time), clamped to [1, max_steps].

    Raises:
        InvalidOptionError: an input out of range (the message names it).
    """
    if not (math.isfinite(step_time_s) and step_time_s > 0):
        raise InvalidOptionError(f"step_time_s={step_time_s!r} is invalid: expected > 0")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise InvalidOptionError(f"max_steps={max_steps!r} is invalid: expected an int >= 1")
    tau = young_daly_interval_s(save_cost_s, mtbf_s)
    raw = round(tau / step_time_s)
    steps = min(max(raw, 1), max_steps)
    return CheckpointInterval(save_cost_s=save_cost_s, mtbf_s=mtbf_s, step_time_s=step_time_s,
                              interval_s=tau, steps=steps, clamped=steps != raw)
