"""`ResilientStep.place` across processes: each process puts only its own devices' rows,
with no collective (guarded work places its batches with it, where a collective would
block on a dead peer)."""

from __future__ import annotations

import json

import pytest

from tests import helpers

pytestmark = pytest.mark.multiprocess


def test_place_across_processes_needs_no_other_process(tmp_path):
    """Two processes × 2 CPU devices (`tests.jobs.place_alone`), one resilient step over all
    4 devices: process 0 places the eval batch alone, before and after the step was built,
    while process 1 only waits for it to say it is done. Both end, and process 0's devices
    hold their rows of the batch."""
    helpers.run_two_processes("tests.jobs.place_alone", str(tmp_path), timeout_s=90)
    p0 = json.loads((tmp_path / "p0.json").read_text())
    assert p0 == {f"{i}/{name}": 2 for i in range(2) for name in helpers.EVAL_BATCH}
    assert json.loads((tmp_path / "p1.json").read_text()) == {}
