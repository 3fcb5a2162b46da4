"""The wheel: what it ships, and that it runs outside the repository.

The wheel is built offline (no build isolation: the `test` extra brings setuptools) from
a copy of the sources, so the checkout is left untouched. The end-to-end check (a fresh
venv in a temp directory runs `mnemojax demo` and `mnemojax bench` with two pairs of the
real-kill runs) takes about four minutes (3 min 56 s on 2026-12-06), so it is marked
`wheel` and runs as `make wheel-test` in CI, not in `make test`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from tests.report_checks import check_demo_report, check_tiny_bench

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCES = ("pyproject.toml", "README.md", "mnemojax", "models", "configs")


def test_every_package_is_listed():
    # pyproject.toml lists packages by hand (remapped folders rule out `find`): a new
    # subpackage that is not listed would silently be left out of the wheel.
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.relative_to(ROOT).parts)
               for p in (ROOT / "mnemojax").rglob("*") if p.is_dir()
               and p.name != "__pycache__" and any(p.glob("*.py"))}
    missing = sorted(on_disk - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "-w", str(dist), str(src)],
                   check=True, timeout=300)
    (path,) = dist.glob("mnemojax-*.whl")
    return path


def test_wheel_ships_models_and_configs_inside_mnemojax(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"mnemojax"}, tops  # no top-level `models` (or anything else)
    for name in ("mnemojax/models/gpt.py", "mnemojax/models/tasks.py",
                 "mnemojax/configs/tiny.toml", "mnemojax/configs/bench_tiny.toml"):
        assert name in names, name
    shipped = {n for n in names if n.endswith(".py")}
    in_repo = {str(p.relative_to(ROOT)) for p in (ROOT / "mnemojax").rglob("*.py")}
    assert in_repo <= shipped, sorted(in_repo - shipped)


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.wheel
@pytest.mark.timeout(1500)
def test_wheel_runs_demo_and_bench_outside_the_repo(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python, script = env_dir / "bin" / "python", env_dir / "bin" / "mnemojax"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
          "--no-deps", "--no-index", str(wheel)], cwd=tmp_path, env=dict(os.environ),
         timeout=300)
    # The dependencies (JAX, Flax, ...) come from this venv's site-packages, appended to
    # the new venv's path: offline and fast. Only plain paths, so this venv's editable
    # hook (a .pth file there) is not run: mnemojax itself can only come from the wheel.
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"], cwd=tmp_path, env=dict(os.environ), timeout=60).strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_deps_from_dev_venv.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "work"  # cwd: no repo, no configs/, no models/
    work.mkdir()
    where = json.loads(_run([str(python), "-c", (
        "import importlib.util, json, mnemojax, mnemojax.models\n"
        "from mnemojax._src.config import shipped_config\n"
        "print(json.dumps([mnemojax.__file__, mnemojax.models.__file__,"
        " str(shipped_config('tiny.toml')), importlib.util.find_spec('models') is None]))")],
        cwd=work, env=env, timeout=120))
    for path in where[:3]:
        assert Path(path).is_relative_to(site), path
    assert where[3], "a top-level `models` package is importable"

    # The shipped tiny config by name: there is no tiny.toml in the cwd.
    _run([str(script), "demo", "--config", "tiny.toml", "--quiet", "--json", "demo.json"],
         cwd=work, env=env, timeout=400)
    check_demo_report(json.loads((work / "demo.json").read_text()))
    # Two pairs of (e) and (f), not the preset's three: the medians' path, in CI's time.
    _run([str(script), "bench", "--preset", "tiny", "--out", "bench", "--quiet",
          "--pairs", "2"], cwd=work, env=env, timeout=1000)
    assert check_tiny_bench(work / "bench")["processes"] is not None  # (e), (f) ran too
