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


def test_a_calls_inputs_are_kept_as_copies_with_their_statics():
    """A step's inputs (CallInputs: batch, numbers, statics in the tree structure): the
    buffer holds its own copy of every input, in fresh arrays."""
    from mnemojax._src.proxy import host_batch
    from mnemojax._src.step_forms import Convention, form_for

    def step(state, batch, scale, pad_id):
        return state, {}

    conv = Convention(step, static_argnames=("pad_id",))
    state = {"w": np.zeros(2, np.float32)}
    form = form_for(step, (state, None, 1.0, 0), convention=conv)
    buf = ReplayBuffer(2)
    x = np.ones((4, 3), np.float32)
    kept = []
    for step_no, pad in ((1, 0), (2, 0), (3, 5)):
        _, inputs = form.split_call((state, {"x": x}, 0.5 * step_no, pad))
        kept.append(buf.append(step_no, host_batch(inputs)))
        x[:] = step_no  # the loader refills its buffer in place
    assert kept[2] is not kept[0] and kept[2].leaves[0] is not kept[0].leaves[0]
    first = buf.batch(2)
    np.testing.assert_array_equal(first.leaves[0], np.ones((4, 3)))  # step 2's own copy
    assert float(first.leaves[1]) == 1.0 and first.layout.statics == ((3, 0),)
    assert buf.batch(3).layout.statics == ((3, 5),) and first.leaves[0] is not x
    assert batch_struct(buf.batch(3), 2).leaves[0].shape == (2, 3)


@pytest.mark.needs8
def test_every_kept_batch_reaches_the_devices_as_it_is_while_older_ones_are_placed():
    """The buffer's copies are what the step places (`DeviceProxy.place_batch`), and the
    device arrays of earlier steps may still be alive (a replay, a pending recovery). On
    jaxlib 0.10.2 CPU, a second ``device_put`` of the same float64 array, refilled in
    place, onto a multi-device sharding returns the first put's values while that result
    lives (float32 arrays placed this way were not affected in the same probe): a buffer
    that reused its slots in place fed a recovered job a stale batch every ``capacity``
    steps. Each kept batch must place as itself."""
    import jax

    from mnemojax._src.device_layer import JaxDeviceLayer

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
    layer, buf, alive = JaxDeviceLayer(), ReplayBuffer(3), []
    for step in range(1, 13):
        kept = buf.append(step, {"y": np.full((8, 1), step, np.float64)})
        placed = layer.put(kept["y"], sharding)
        alive.append(placed)  # every placement stays alive
        assert float(np.asarray(placed).sum()) == 8.0 * step, f"step {step}"
