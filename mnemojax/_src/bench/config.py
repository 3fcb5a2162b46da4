"""Bench presets: TOML files under ``configs/bench_<name>.toml``, validated on load."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mnemojax._src.config import FaultSpec, check_job_fields, read_job_toml, shipped_config
from mnemojax._src.errors import InvalidOptionError

PRESETS = ("tiny", "gpt10m")
_MODEL_KEYS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One bench job: model, mesh, data, faults and measurement settings.

    Attributes:
        name: preset name (the file stem without ``bench_``).
        devices: virtual CPU devices (the worker configures the same number).
        mesh: ``(data, model)`` axis sizes.
        steps: training steps of every run.
        batch_size: global batch; a multiple of every data width a recovery may keep.
        learning_rate, seed: as in `models.tasks.build_gpt` and `models.data.BigramCorpus`.
        model: `models.gpt.GPTConfig` fields.
        faults: device losses for the mnemojax run; the baseline's process is killed at
            the same steps.
        block_steps: steps per block when measuring the steady-state overhead.
        max_precompiled: `CompileOptions.max_precompiled` of the mnemojax runs.
        wait_precompile_after_recovery: also wait for the background compiles after each
            recovery (not only after step 1), as a run whose faults are hours apart would.
        checkpoint_max_to_keep: Orbax ``max_to_keep`` of the baseline.
        calibration_saves: checkpoint saves timed to measure the save cost (>= 2; the
            first save of a process is reported apart).
        mtbf_s: the stated MTBF for the Young/Daly interval; None: the failure-free run's
            wall time divided by the number of faults.
        worker_timeout_s: hard limit for the whole baseline (all its processes); also
            for each multi-process run, (e) and (f).
        processes: worker processes of the multi-process runs (e) and (f), with
            ``devices // processes`` CPU devices each; the preset's mesh over their devices.
        process_victim: the worker SIGKILLed from outside in (e) and (f), once it has
            completed the step before the first fault's step (that step is the one lost).
        collective_timeout_s: (e)'s launcher option of that name; None: the launcher's
            default, what a user of ``mnemojax launch`` gets (tests set a lower one).
        process_pairs: how many times (e) and (f) run, alternating (e, f, e, f, ...): the
            figures are the medians (one run of each is one sample on a shared machine).
    """

    name: str
    devices: int = 8
    mesh: tuple[int, int] = (4, 2)
    steps: int = 50
    batch_size: int = 24
    learning_rate: float = 3e-3
    seed: int = 0
    model: dict[str, int] = dataclasses.field(default_factory=dict)
    faults: tuple[FaultSpec, ...] = ()
    block_steps: int = 8
    max_precompiled: int = 8
    wait_precompile_after_recovery: bool = True
    checkpoint_max_to_keep: int = 2
    calibration_saves: int = 4
    mtbf_s: float | None = None
    worker_timeout_s: float = 600.0
    processes: int = 4
    process_victim: int = 1
    collective_timeout_s: int | None = None
    process_pairs: int = 1

    def __post_init__(self):
        def bad(name: str, value: Any, legal: str):
            raise InvalidOptionError(
                f"bench preset {self.name!r}: {name}={value!r} is invalid: expected {legal}")

        for name in ("block_steps", "checkpoint_max_to_keep", "process_pairs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(name, value, "an int >= 1")
        if not isinstance(self.max_precompiled, int) or self.max_precompiled < 0:
            bad("max_precompiled", self.max_precompiled, "an int >= 0")
        if not isinstance(self.calibration_saves, int) or self.calibration_saves < 2:
            bad("calibration_saves", self.calibration_saves, "an int >= 2")
        check_job_fields(self, bad, first_fault_step=2)  # step 1 compiles
        if self.mtbf_s is not None and not self.mtbf_s > 0:
            bad("mtbf_s", self.mtbf_s, "> 0 seconds")
        if not self.worker_timeout_s > 0:
            bad("worker_timeout_s", self.worker_timeout_s, "> 0 seconds")
        if not isinstance(self.processes, int) or not 2 <= self.processes <= self.devices \
                or self.devices % self.processes:
            bad("processes", self.processes, f"an int >= 2 dividing devices={self.devices}")
        if not isinstance(self.process_victim, int) or \
                not 0 <= self.process_victim < self.processes:
            bad("process_victim", self.process_victim, f"in [0, processes={self.processes})")
        if self.collective_timeout_s is not None and not (
                isinstance(self.collective_timeout_s, int) and self.collective_timeout_s >= 1):
            bad("collective_timeout_s", self.collective_timeout_s, "None or an int >= 1")
        missing = sorted(set(_MODEL_KEYS) - set(self.model))
        extra = sorted(set(self.model) - set(_MODEL_KEYS))
        if missing or extra:
            bad("model", dict(self.model), f"exactly the keys {list(_MODEL_KEYS)}")
        if not self.faults:
            bad("faults", [], "at least one fault")
        steps = [f.step for f in self.faults]
        if len(set(steps)) != len(steps):
            bad("faults.step", sorted(steps), "one fault per step")

    @property
    def fault_steps(self) -> tuple[int, ...]:
        return tuple(sorted(f.step for f in self.faults))

    @property
    def devices_per_process(self) -> int:
        return self.devices // self.processes

    @property
    def process_kill_after_step(self) -> int:
        """(e) and (f) kill the victim once it has completed this step: the step before
        the first fault's, so the first fault's step is the one lost."""
        return self.fault_steps[0] - 1


def preset_path(preset: str | Path) -> Path:
    """The TOML file of a preset name (``tiny``) or a path to a bench TOML file.

    Raises:
        InvalidOptionError: neither a known preset nor an existing file.
    """
    path = Path(preset)
    if path.suffix == ".toml" and path.is_file():
        return path
    candidate = shipped_config(f"bench_{preset}.toml")
    if str(preset) in PRESETS and candidate.is_file():
        return candidate
    raise InvalidOptionError(
        f"preset={str(preset)!r} is invalid: expected one of {list(PRESETS)} or the path "
        "of a bench TOML file")


def load_preset(preset: str | Path, **overrides: Any) -> BenchConfig:
    """Reads and validates a preset; unknown keys are errors (typos must not pass).

    Args:
        preset: a preset name (see `PRESETS`) or a TOML path.
        **overrides: top-level fields to replace (None values are ignored).
    """
    path = preset_path(preset)
    kwargs = read_job_toml(path, BenchConfig, what="bench preset", overrides=overrides,
                           exclude=("name",))
    return BenchConfig(name=path.stem.removeprefix("bench_"), **kwargs)
