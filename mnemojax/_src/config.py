"""Demo / benchmark job configurations: TOML files validated on load."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

from mnemojax._src.errors import InvalidOptionError

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultSpec:
    step: int
    devices: tuple[int, ...]
    surface: str = "dispatch"


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    devices: int = 8
    mesh: tuple[int, int] = (4, 2)
    steps: int = 60
    batch_size: int = 24
    learning_rate: float = 3e-3
    seed: int = 0
    wait_for_precompile: bool = True
    overhead_steps: int = 20
    overhead_rounds: int = 3
    model: dict[str, int] = dataclasses.field(default_factory=dict)
    snapshot: dict[str, Any] = dataclasses.field(default_factory=dict)
    faults: tuple[FaultSpec, ...] = ()

    def __post_init__(self):
        def bad(name, value, legal):
            raise InvalidOptionError(f"config {name}={value!r} is invalid: expected {legal}")

        for name in ("devices", "steps", "batch_size", "overhead_steps", "overhead_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                bad(name, value, "an int >= 1")
        if len(self.mesh) != 2 or any(not isinstance(n, int) or n < 1 for n in self.mesh):
            bad("mesh", list(self.mesh), "[data, model], two ints >= 1")
        if math.prod(self.mesh) > self.devices:
            bad("mesh", list(self.mesh), f"at most devices={self.devices} devices in all")
        if self.batch_size % self.mesh[0]:
            bad("batch_size", self.batch_size, f"a multiple of the data axis {self.mesh[0]}")
        if not self.learning_rate > 0:
            bad("learning_rate", self.learning_rate, "> 0")
        for f in self.faults:
            if not 1 <= f.step <= self.steps:
                bad("faults.step", f.step, f"in [1, steps={self.steps}]")
            if not f.devices or any(d < 0 or d >= self.devices for d in f.devices):
                bad("faults.devices", list(f.devices), f"ids in [0, {self.devices})")
            if f.surface not in ("dispatch", "block"):
                bad("faults.surface", f.surface, "'dispatch' or 'block'")


def read_job_toml(path: Path, cls, *, what: str, overrides: dict, exclude=()) -> dict:
    """The validated keyword arguments of `cls` from a job TOML file: unknown keys are
    errors (typos must not pass), `[[faults]]` become `FaultSpec`s, the mesh a tuple."""
    with path.open("rb") as f:
        raw = tomllib.load(f)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidOptionError(f"{what} {str(path)!r}: unknown key(s) {unknown}")
    faults = []
    for f in raw.pop("faults", []):
        extra = sorted(set(f) - {"step", "devices", "surface"})
        if extra:
            raise InvalidOptionError(f"{what} {str(path)!r}: unknown fault key(s) {extra}")
        faults.append(FaultSpec(step=f.get("step", 0), devices=tuple(f.get("devices", ())),
                                surface=f.get("surface", "dispatch")))
    if "mesh" in raw:
        raw["mesh"] = tuple(raw["mesh"])
    return {**raw, "faults": tuple(faults)}


def load_config(path: str | Path, **overrides) -> JobConfig:
    """Reads and validates a job config (the demo's)."""
    path = Path(path)
    if not path.is_file():
        candidate = REPO_CONFIGS / path.name
        if not candidate.is_file():
            raise InvalidOptionError(f"config file {str(path)!r} does not exist")
        path = candidate
    return JobConfig(**read_job_toml(path, JobConfig, what="config", overrides=overrides))
