"""Options are frozen, keyword-only and validated: a bad value names itself and the range."""

import dataclasses

import pytest

import mnemojax
from mnemojax.errors import InvalidOptionError


@pytest.mark.parametrize("cls,field,value,legal", [
    (mnemojax.SnapshotOptions, "every_steps", -1, ">= 0"),
    (mnemojax.SnapshotOptions, "grads_every_steps", -2, ">= 0"),
    (mnemojax.SnapshotOptions, "host_memory_budget_bytes", 0, "> 0"),
    (mnemojax.RecoveryOptions, "batch_policy", "pad", "'keep_math'"),
    (mnemojax.RecoveryOptions, "stop", 3, "a stop rule"),
    (mnemojax.RecoveryOptions, "retry_backoff", 0.1, "callable"),
    (mnemojax.RecoveryOptions, "hang_timeout_s", 0, "> 0 or None"),
    (mnemojax.PersistentOptions, "max_to_keep", 0, ">= 1"),
    (mnemojax.PersistentOptions, "memory_pressure_fraction", 1.5, "(0, 1]"),
    (mnemojax.RecoveryOptions, "min_devices", 0, ">= 1"),
    (mnemojax.RecoveryOptions, "probe_timeout_s", 0, "> 0"),
    (mnemojax.CompileOptions, "max_precompiled", -1, ">= 0"),
    (mnemojax.CompileOptions, "ahead_compilers", 0, "None or >= 1"),
    (mnemojax.CompileOptions, "ahead_losses", 3, "1 or 2"),
    (mnemojax.CompileOptions, "ahead_layouts", 0, ">= 1"),
    (mnemojax.ResilienceOptions, "nonfinite", "skip", "'skip_batch'"),
    (mnemojax.ResilienceOptions, "data_axis", "", "non-empty"),
    (mnemojax.ResilienceOptions, "snapshot", 5, "SnapshotOptions"),
])
def test_invalid_value_is_named(cls, field, value, legal):
    with pytest.raises(InvalidOptionError) as info:
        cls(**{field: value})
    assert f"{field}={value!r}" in str(info.value) and legal in str(info.value)
    assert isinstance(info.value, ValueError)


def test_options_are_frozen_and_keyword_only():
    opts = mnemojax.ResilienceOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.data_axis = "batch"
    with pytest.raises(TypeError):
        mnemojax.SnapshotOptions(3)


def test_nested_defaults():
    opts = mnemojax.ResilienceOptions(snapshot=mnemojax.SnapshotOptions(every_steps=5))
    assert opts.snapshot.every_steps == 5
    assert opts.recovery.batch_policy == "keep_math" and opts.compile.precompile


def test_donated_state_cannot_skip_batches():
    """Regression: skip_batch kept the donated (deleted) state and the next step crashed."""
    with pytest.raises(mnemojax.errors.InvalidOptionError, match="donate_state"):
        mnemojax.ResilienceOptions(nonfinite="skip_batch",
                                   compile=mnemojax.CompileOptions(donate_state=True))


def test_model_shrink_headroom_is_at_least_one():
    with pytest.raises(InvalidOptionError, match="model_shrink_headroom=0.5"):
        mnemojax.RecoveryOptions(model_shrink_headroom=0.5)
    assert mnemojax.RecoveryOptions(model_shrink_headroom=1.0).model_shrink_headroom == 1.0


def test_a_copy_in_series_cannot_overlap_the_step():
    with pytest.raises(InvalidOptionError, match="replicate_in_series=True.*overlap_publish"):
        mnemojax.SnapshotOptions(replicate_in_series=True, overlap_publish=True)
    assert mnemojax.SnapshotOptions(replicate_in_series=True).replicate_in_series


@pytest.mark.parametrize("cls,field,value,legal", [
    (mnemojax.SnapshotOptions, "every_steps", 2.5, "an int"),
    (mnemojax.SnapshotOptions, "every_steps", True, "an int"),
    (mnemojax.SnapshotOptions, "verify_checksums", "no", "a bool"),
    (mnemojax.PersistentOptions, "directory", 123, "a str or a path or None"),
    (mnemojax.PersistentOptions, "preemption_signals", [15], "a tuple of an int"),
    (mnemojax.ResilienceOptions, "event_log", 123, "a str or a path or None"),
    (mnemojax.ResilienceOptions, "data_axis", 5, "a str"),
    (mnemojax.ResilienceOptions, "loss_key", None, "a str"),
    (mnemojax.RecoveryOptions, "probe_timeout_s", "10", "a number"),
    (mnemojax.RecoveryOptions, "clock", 0.0, "a callable"),
    (mnemojax.CompileOptions, "cache_dir", 7, "a str or a path or None"),
])
def test_wrong_types_are_named_not_a_bare_type_error(cls, field, value, legal):
    with pytest.raises(InvalidOptionError) as info:
        cls(**{field: value})
    assert f"{field}={value!r}" in str(info.value) and legal in str(info.value)


def test_paths_and_ints_are_accepted_where_a_float_or_path_is_expected(tmp_path):
    opts = mnemojax.ResilienceOptions(
        event_log=tmp_path / "events.jsonl",
        persistent=mnemojax.PersistentOptions(directory=tmp_path / "ckpt"),
        recovery=mnemojax.RecoveryOptions(probe_timeout_s=5, hang_floor_s=30))
    assert opts.recovery.probe_timeout_s == 5


def test_persistent_none_means_no_persistent_tier():
    """``persistent=opts if cond else None`` (a user trial: it was refused)."""
    options = mnemojax.ResilienceOptions(persistent=None)
    assert options.persistent == mnemojax.PersistentOptions()
    assert options.persistent.directory is None
