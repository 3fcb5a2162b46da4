"""Demo / benchmark job configurations: TOML files validated on load."""

from __future__ import annotations

import dataclasses
import importlib.resources
import logging
import math
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from mnemojax._src.errors import InvalidOptionError

log = logging.getLogger("mnemojax")


def shipped_config(name: str) -> Path:
    """The path of a job config shipped with mnemojax (``configs/`` in the repository).

    The TOML files are package data of ``mnemojax.configs``: the same call finds them in
    a checkout (editable install) and in an installed wheel.

    Args:
        name: the file name, e.g. ``"tiny.toml"`` or ``"bench_tiny.toml"``.
    """
    # pip unpacks wheels onto the file system, so the resource is a real file.
    return Path(str(importlib.resources.files("mnemojax.configs") / name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultSpec:
    step: int
    devices: tuple[int, ...]
    surface: Literal["dispatch", "block"] = "dispatch"  # validated in check_job_fields


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

        for name in ("overhead_steps", "overhead_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                bad(name, value, "an int >= 1")
        check_job_fields(self, bad, first_fault_step=1)


def check_job_fields(cfg, bad, *, first_fault_step: int) -> None:
    """Checks the fields every job config has (devices, steps, mesh, batch, learning rate,
    faults); `bad(name, value, legal)` raises."""
    for name in ("devices", "steps", "batch_size"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            bad(name, value, "an int >= 1")
    if len(cfg.mesh) != 2 or any(not isinstance(n, int) or n < 1 for n in cfg.mesh):
        bad("mesh", list(cfg.mesh), "[data, model], two ints >= 1")
    if math.prod(cfg.mesh) > cfg.devices:
        bad("mesh", list(cfg.mesh), f"at most devices={cfg.devices} devices in all")
    if cfg.batch_size % cfg.mesh[0]:
        bad("batch_size", cfg.batch_size, f"a multiple of the data axis {cfg.mesh[0]}")
    if not cfg.learning_rate > 0:
        bad("learning_rate", cfg.learning_rate, "> 0")
    for f in cfg.faults:
        if not first_fault_step <= f.step <= cfg.steps:
            bad("faults.step", f.step, f"in [{first_fault_step}, steps={cfg.steps}]")
        if not f.devices or any(d < 0 or d >= cfg.devices for d in f.devices):
            bad("faults.devices", list(f.devices), f"ids in [0, {cfg.devices})")
        if f.surface not in ("dispatch", "block"):
            bad("faults.surface", f.surface, "'dispatch' or 'block'")


def configure_devices(n: int, *, who: str) -> None:
    """Asks JAX for `n` CPU devices (before the backend starts) and checks there are `n`."""
    import jax

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError as exc:  # a backend already exists (e.g. in a test session)
            log.info("%s: keeping the existing backend (%s)", who, exc)
    if len(jax.devices()) < n:
        raise SystemExit(f"{who} needs {n} devices, found {len(jax.devices())}")


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
    """Reads and validates a job config (the demo's).

    Args:
        path: a TOML file; when there is no such file, the shipped config of the same
            name (so ``configs/tiny.toml`` works from any directory).
        **overrides: top-level fields to replace (None values are ignored).

    Raises:
        InvalidOptionError: no such file, an unknown key or an invalid value.
    """
    path = Path(path)
    if not path.is_file():
        candidate = shipped_config(path.name)
        if not candidate.is_file():
            raise InvalidOptionError(f"config file {str(path)!r} does not exist")
        path = candidate
    return JobConfig(**read_job_toml(path, JobConfig, what="config", overrides=overrides))
