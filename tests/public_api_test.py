"""The public surface: nothing leaks, nothing vanishes by accident."""

import mnemojax
import mnemojax.errors
import mnemojax.testing

EXPECTED = {
    "CompileOptions", "MeshPlan", "PersistentOptions", "RecoveryOptions",
    "RecoveryRecord",
    "ResilienceOptions", "ResilientStep", "SnapshotOptions", "Statistics", "errors",
    "initialize",
    "plan_reduced_mesh", "resilient", "retry", "testing",
}


def test_top_level_names():
    assert set(mnemojax.__all__) == EXPECTED
    public = {n for n in vars(mnemojax) if not n.startswith("_")}
    assert public - {"__version__"} == EXPECTED


def test_errors_are_rooted():
    for name in mnemojax.errors.__all__:
        obj = getattr(mnemojax.errors, name)
        if obj is mnemojax.errors.PreemptionExit:  # an exit, not an error
            assert issubclass(obj, SystemExit)
            continue
        root = mnemojax.errors.MnemojaxWarning if issubclass(obj, Warning) else (
            mnemojax.errors.MnemojaxError)
        assert issubclass(obj, root), name


def test_testing_module():
    assert mnemojax.testing.__all__ == ["FaultInjector", "InjectedFault", "ProcessFault",
                                        "corrupt_agent_copies", "run_scenario"]
