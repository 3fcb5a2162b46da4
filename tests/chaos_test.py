"""The chaos soak: random fault schedules end exact, with every fault in the event log."""

import pytest

from mnemojax._src.chaos import run_chaos
from mnemojax.errors import InvalidOptionError

pytestmark = pytest.mark.needs8


@pytest.mark.parametrize("seed", [0, 3])
def test_short_chaos_run_is_exact_and_accounted(seed, tmp_path):
    report = run_chaos(steps=60, seed=seed, fault_rate=0.15, workdir=str(tmp_path))
    assert report["faults_planned"] >= 3, report
    assert report["unaccounted"] == [], report
    assert report["state_matches_reference"], report


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_chaos_soak_300_steps(seed, tmp_path):
    report = run_chaos(steps=300, seed=seed, workdir=str(tmp_path))
    assert report["ok"], report
    assert report["faults_planned"] >= 5


def test_bad_chaos_parameters_are_named():
    with pytest.raises(InvalidOptionError, match="fault_rate=2"):
        run_chaos(steps=10, seed=0, fault_rate=2)
