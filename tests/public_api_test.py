"""The public surface: nothing leaks, nothing vanishes by accident."""

import pytest

import mnemojax
import mnemojax.errors
import mnemojax.testing

EXPECTED = {
    "CompileOptions", "JoinRecord", "MeshPlan", "PersistentOptions", "RecoveryOptions",
    "RecoveryRecord",
    "ResilienceOptions", "ResilientStep", "SnapshotOptions", "Statistics", "checkpoint_barrier",
    "data", "errors", "initialize",
    "plan_reduced_mesh", "resilient", "retry", "testing",
}

# The demo's models and the shipped job configs: attributes once something imports them
# (the demo, the bench), never re-exported.
SUBPACKAGES = {"models", "configs"}


def test_top_level_names():
    assert set(mnemojax.__all__) == EXPECTED
    # Some names are imported on first use (mnemojax/__init__.py): dir() lists them all.
    public = {n for n in dir(mnemojax) if not n.startswith("_")}
    assert public - SUBPACKAGES == EXPECTED
    for name in EXPECTED:
        assert getattr(mnemojax, name) is not None, name


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'resilent'"):
        mnemojax.resilent  # noqa: B018


ERRORS = {
    "AgreementError", "BaselineError", "BatchSplitError", "CheckpointMismatchError",
    "CheckpointCorruptError", "CheckpointLostError", "CheckpointSaveError",
    "DeviceFailureError", "SimulationConfigError",
    "DistributedError", "GuardSkippedError", "InvalidOptionError", "LeftJobExit", "LossCheckWarning", "MathChangedWarning",
    "MeshTooSmallError",
    "MnemojaxError", "MnemojaxWarning", "NonFiniteLossError", "NonFiniteSkipWarning",
    "PreemptionExit", "ProtocolError", "RecoveryExhaustedError", "ShardingMismatchError",
    "SnapshotBudgetWarning", "SnapshotCorruptError", "StateUnavailableError", "StepCompileError", "StepHangError",
    "UnsupportedJaxVersionError", "UnsupportedStateError", "WorldConfigError",
}


def test_error_names():
    assert set(mnemojax.errors.__all__) == ERRORS
    public = {n for n in vars(mnemojax.errors) if not n.startswith("_")}
    assert public == ERRORS


def test_errors_are_rooted():
    """Every exception a user can meet is a `MnemojaxError` (every warning a
    `MnemojaxWarning`), so one ``except`` catches them all."""
    for name in mnemojax.errors.__all__:
        obj = getattr(mnemojax.errors, name)
        assert isinstance(obj, type) and issubclass(obj, BaseException), name
        if obj in (mnemojax.errors.PreemptionExit, mnemojax.errors.LeftJobExit):  # exits
            assert issubclass(obj, SystemExit)
            continue
        root = mnemojax.errors.MnemojaxWarning if issubclass(obj, Warning) else (
            mnemojax.errors.MnemojaxError)
        assert issubclass(obj, root), name


def test_every_error_defined_in_the_core_is_public():
    """A new error in `mnemojax._src.errors` cannot stay out of `mnemojax.errors` (a
    private base class, never raised itself, can)."""
    from mnemojax._src import errors as core

    defined = {n for n, obj in vars(core).items()
               if isinstance(obj, type) and issubclass(obj, BaseException)
               and obj.__module__ == core.__name__ and not n.startswith("_")}
    assert defined <= set(mnemojax.errors.__all__), defined - set(mnemojax.errors.__all__)


def test_testing_module():
    assert mnemojax.testing.__all__ == ["FaultInjector", "InjectedFault", "ProcessFault",
                                        "corrupt_agent_copies", "run_scenario"]
