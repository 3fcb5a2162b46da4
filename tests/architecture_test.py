"""The import rules of docs/architecture.md, checked on the sources (every import, also
those inside functions)."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "mnemojax" / "_src"

CORE = ["api", "runtime", "recovery", "replay", "step_forms", "proxy", "device_layer",
        "compiler", "sharding", "snapshot", "state_source", "durability", "persistent",
        "triggers", "events", "monitoring", "statistics", "options", "retry", "errors",
        "fault_injection", "topology", "ownership"]
ROLES = ("mnemojax._src.distributed.launcher", "mnemojax._src.distributed.agent")
TOOLS = ("mnemojax._src.bench", "mnemojax._src.simulator", "mnemojax._src.demo",
         "mnemojax._src.chaos", "matplotlib", "tqdm")


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def _hits(imports: set[str], prefixes) -> list[str]:
    return sorted(i for i in imports if any(i == p or i.startswith(p + ".") for p in prefixes))


@pytest.mark.parametrize("module", CORE)
def test_the_runtime_core_imports_no_process_role_nor_tool(module):
    assert _hits(_imports(SRC / f"{module}.py"), ROLES + TOOLS) == []


def test_the_planner_imports_no_jax():
    assert _hits(_imports(SRC / "topology.py"), ("jax", "jaxlib", "flax")) == []


@pytest.mark.parametrize("path", sorted((SRC / "simulator").glob("*.py")), ids=lambda p: p.name)
def test_the_simulator_is_pure_python(path):
    imports = _imports(path)
    assert _hits(imports, ("jax", "jaxlib", "flax", "orbax", "optax")) == []
    runtime = [i for i in _hits(imports, ("mnemojax._src",))
               if not i.startswith(("mnemojax._src.simulator", "mnemojax._src.errors"))]
    assert runtime == []


@pytest.mark.parametrize(
    "path", sorted([*(SRC / "distributed" / "launcher").glob("*.py"),
                    *(SRC / "distributed" / "agent").glob("*.py")]),
    ids=lambda p: f"{p.parent.name}/{p.name}")
def test_launcher_and_agent_stay_out_of_the_runtime(path):
    """The process roles never load the training runtime, Flax or Orbax: they must outlive
    a worker's failure and start fast."""
    core = tuple(f"mnemojax._src.{m}" for m in CORE if m not in ("errors", "retry"))
    assert _hits(_imports(path), (*core, "flax", "orbax", "mnemojax._src.distributed.worker")) \
        == []
