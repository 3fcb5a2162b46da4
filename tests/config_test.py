"""Job configs are validated on load: a typo or a bad value is an error naming it."""

import importlib.resources
from pathlib import Path

import pytest

from mnemojax._src.config import load_config, shipped_config
from mnemojax.errors import InvalidOptionError


@pytest.mark.parametrize("name", ["demo.toml", "tiny.toml"])
def test_shipped_configs_load(name):
    cfg = load_config(shipped_config(name))
    assert cfg.mesh == (4, 2) and cfg.faults


def test_shipped_configs_are_package_data():
    package = Path(str(importlib.resources.files("mnemojax.configs")))
    assert shipped_config("tiny.toml") == package / "tiny.toml"
    assert {p.name for p in package.glob("*.toml")} >= {
        "demo.toml", "tiny.toml", "bench_tiny.toml", "bench_gpt10m.toml"}


def test_repo_relative_path_works_from_any_directory(tmp_path, monkeypatch):
    # The README's `--config configs/tiny.toml` must not depend on the cwd.
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/tiny.toml") == load_config(shipped_config("tiny.toml"))


def test_a_user_file_wins_over_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(shipped_config("tiny.toml").read_text()
                                        .replace("steps = 12", "steps = 14"))
    assert load_config("tiny.toml").steps == 14


def _write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,match", [
    ("stepz = 3", r"unknown key\(s\) \['stepz'\]"),
    ("steps = 0", "steps=0"),
    ("mesh = [3, 3]", r"mesh=\[3, 3\]"),
    ("batch_size = 10", "batch_size=10"),
    ("learning_rate = -1.0", "learning_rate=-1.0"),
    ("[[faults]]\nstep = 500\ndevices = [1]", "faults.step=500"),
    ("[[faults]]\nstep = 2\ndevices = [9]", r"faults.devices=\[9\]"),
    ("[[faults]]\nstep = 2\ndevices = [1]\nsurface = 'later'", "faults.surface='later'"),
    ("[[faults]]\nstep = 2\ndevice = [1]", r"unknown fault key\(s\) \['device'\]"),
])
def test_bad_config_is_named(tmp_path, text, match):
    with pytest.raises(InvalidOptionError, match=match):
        load_config(_write(tmp_path, text))


def test_missing_file_is_named():
    with pytest.raises(InvalidOptionError, match="nope.toml"):
        load_config("nope.toml")


def test_overrides_apply():
    assert load_config(shipped_config("tiny.toml"), steps=10).steps == 10
