"""Light import: `import mnemojax` and the JAX-free commands load only what they need.

Each check runs in a fresh interpreter (this one already holds JAX and the rest).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Never loaded by `import mnemojax`: the process roles, the tools, plotting, JAX itself
# (so that `mnemojax simulate` / `report`, which import the package first, stay JAX-free).
# Plain prefixes, so that role subpackages (launcher/, agent/, ...) are covered too.
HEAVY_PREFIXES = (
    "mnemojax._src.distributed.launch",  # launcher, launcher/, launch_cli
    "mnemojax._src.distributed.agent",  # agent, agent/, agent_client
    "mnemojax._src.bench",
    "mnemojax._src.simulator",
    "mnemojax._src.chaos",
    "mnemojax._src.demo",
    "mnemojax.testing",
    "matplotlib",
    "tqdm",
    "jax",
    "flax",
    "optax",
    "orbax",
)

JAX_PREFIXES = ("jax", "flax", "optax", "orbax")  # "jax" covers jaxlib

# Runs in the child: refuses JAX outright (a clear traceback at the import that pulled
# it in), runs the code, then reports the loaded modules on the last line of stdout.
_CHILD = """
import json, sys

class _RefuseJax:
    def find_spec(self, name, path=None, target=None):
        if name.startswith({jax_prefixes!r}):
            raise ImportError(f"{{name}} imported by code that must not need JAX")
        return None

if {refuse_jax!r}:
    sys.meta_path.insert(0, _RefuseJax())
{body}
print(json.dumps(sorted(sys.modules)))
"""


def _loaded_after(body: str, *, refuse_jax: bool) -> list[str]:
    code = _CHILD.format(jax_prefixes=JAX_PREFIXES, refuse_jax=refuse_jax,
                         body=textwrap.dedent(body))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _matching(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if m.startswith(prefixes)]


def test_import_mnemojax_is_light():
    loaded = _loaded_after("import mnemojax", refuse_jax=False)
    assert _matching(loaded, HEAVY_PREFIXES) == []


def test_the_jax_guard_refuses_jax():
    with pytest.raises(AssertionError, match="jax imported by code that must not need JAX"):
        _loaded_after("import numpy, jax", refuse_jax=True)


def test_public_names_still_import_on_use():
    loaded = _loaded_after("""
        import mnemojax
        assert callable(mnemojax.resilient) and mnemojax.testing.FaultInjector
    """, refuse_jax=False)
    assert "jax" in loaded and "mnemojax.testing" in loaded


def test_simulate_runs_without_jax(tmp_path):
    loaded = _loaded_after(f"""
        from mnemojax._src.cli import main
        code = main(["simulate", "--scales", "1k", "--mtbf-hours", "50677", "--days", "2",
                     "--runs", "1", "--out", {str(tmp_path)!r}])
        assert code == 0, code
    """, refuse_jax=True)
    assert _matching(loaded, JAX_PREFIXES) == []
    assert (tmp_path / "simulate.json").is_file()


def _write_log(tmp_path) -> str:
    log = tmp_path / "events.jsonl"
    events = [{"time": 100.0, "run": "job", "kind": "run_start"},
              {"time": 101.0, "run": "job", "kind": "step", "step": 1, "duration_s": 1.0},
              {"time": 102.0, "run": "job", "kind": "step", "step": 2, "duration_s": 1.0},
              {"time": 102.5, "run": "job", "kind": "run_end", "step": 2}]
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(log)


def test_report_runs_without_jax(tmp_path):
    log = _write_log(tmp_path)
    loaded = _loaded_after(f"""
        from mnemojax._src.cli import main
        assert main(["report", {log!r}]) == 0
    """, refuse_jax=True)
    assert _matching(loaded, JAX_PREFIXES) == []
    assert (tmp_path / "report.png").is_file()


@pytest.mark.parametrize("command", ["report", "simulate"])
def test_a_missing_tools_extra_is_named(command, tmp_path):
    argv = {"report": ["report", _write_log(tmp_path)],
            "simulate": ["simulate", "--scales", "1k", "--days", "1", "--runs", "1"]}[command]
    # Hide matplotlib the way an install without the extra lacks it.
    body = f"""
        import sys
        sys.modules["matplotlib"] = None
        from mnemojax._src.cli import main
        print("exit", main({argv!r} + ["--out", {str(tmp_path)!r}]))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "exit 1" in proc.stdout, proc.stdout + proc.stderr
    assert "needs matplotlib" in proc.stderr, proc.stderr
    assert "pip install 'mnemojax[tools]'" in proc.stderr
