"""ReplayBuffer: batches by step, bounded, and replayability checks."""

import numpy as np
import pytest

from mnemojax._src.errors import StateUnavailableError
from mnemojax._src.replay import ReplayBuffer, batch_struct


def test_keeps_the_newest_batches_by_step():
    buf = ReplayBuffer(3)
    for step in range(1, 6):
        buf.append(step, {"x": np.full((2,), step)})
    assert [s for s, _ in buf] == [3, 4, 5] and len(buf) == 3
    assert buf.first_step == 3 and int(buf.last["x"][0]) == 5
    assert int(buf.batch(4)["x"][0]) == 4
    with pytest.raises(StateUnavailableError, match="step 2"):
        buf.batch(2)
    buf.pop()
    assert buf.first_step == 3 and int(buf.last["x"][0]) == 4


def test_check_replayable_names_the_missing_steps():
    buf = ReplayBuffer(2)
    for step in (5, 6):
        buf.append(step, None)
    buf.check_replayable(4, 7, "the snapshot")  # needs 5, 6: kept
    with pytest.raises(StateUnavailableError, match=r"step 2, .* steps 3\.\.4"):
        buf.check_replayable(2, 7, "the snapshot")


def test_batch_struct_cuts_examples():
    batch = {"x": np.zeros((24, 3), np.float32), "scale": np.float32(1.0)}
    struct = batch_struct(batch, 16)
    assert struct["x"].shape == (16, 3) and struct["scale"].shape == ()
    assert batch_struct(batch, None)["x"].shape == (24, 3)
