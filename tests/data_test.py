"""Per-host batches (`mnemojax.data`): lazily read rows, each device's rows only, the
iterator's state, and a resilient run fed by a Grain loader that equals the plain run."""

import grain
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mnemojax
from mnemojax.data import HostBatches, HostRows
from mnemojax.errors import BatchSplitError, InvalidOptionError
from tests import helpers as h


def _records(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`h.make_batches(steps)` one example per record: step k's batch is records
    [(k-1)B, kB)."""
    return [{"x": b["x"][i], "y": b["y"][i]}
            for b in h.make_batches(steps, seed) for i in range(h.BATCH)]


def test_rows_read_keeps_the_newest_steps_only(monkeypatch):
    """A long run does not grow the per-step count without bound."""
    from mnemojax._src import data

    monkeypatch.setattr(data, "ROWS_READ_KEPT", 3)
    loader = HostBatches(_records(5), h.BATCH)
    for k, batch in enumerate(loader, start=1):
        assert batch["x"][:2].shape == (2, h.DIN)
        assert max(loader.rows_read) == k
    assert loader.rows_read == {3: 2, 4: 2, 5: 2}


def test_a_batch_is_its_records_stacked_and_read_only_when_indexed():
    loader = HostBatches(_records(3), h.BATCH)
    batch = next(loader)
    assert isinstance(batch["x"], HostRows) and batch["x"].shape == (h.BATCH, h.DIN)
    assert batch["y"].dtype == np.int32 and batch["x"].step == 1
    assert loader.rows_read == {}  # nothing read yet
    want = h.make_batches(3)[0]
    np.testing.assert_array_equal(batch["x"][4:10], want["x"][4:10])
    np.testing.assert_array_equal(batch["y"][4:10, ...], want["y"][4:10])  # same rows: kept
    assert loader.rows_read == {1: 6}
    np.testing.assert_array_equal(batch["x"][-1], want["x"][-1])
    np.testing.assert_array_equal(np.asarray(batch["x"]), want["x"])
    np.testing.assert_array_equal(batch["x"][::2], want["x"][::2])
    np.testing.assert_array_equal(batch["x"].head(5)[:], want["x"][:5])
    with pytest.raises(IndexError, match="row 24 of a batch of 24"):
        batch["x"][24]
    np.testing.assert_array_equal(batch["x"][None], want["x"][None])  # a new axis
    kept = batch["x"][4:10]
    assert not kept.flags.writeable  # the rows are kept for a replay: read-only
    fresh = np.array(batch["x"])
    fresh[0] = 0  # a copy: the kept rows are untouched
    np.testing.assert_array_equal(batch["x"][0], want["x"][0])


def test_each_device_reads_only_the_rows_it_holds_on_the_current_mesh():
    """What ``jax.make_array_from_callback`` asks a process for: the index of each of its
    devices. Devices of data row 1 of a (4, 2) mesh read rows 6..12 once; on a (2, 2)
    mesh (a process's share after a loss) the same process reads rows 0..12."""
    loader = HostBatches(_records(2), h.BATCH)
    x = next(loader)["x"]
    want = h.make_batches(2)[0]["x"]
    for shape, row, rows in (((4, 2), 1, (6, 12)), ((2, 2), 0, (0, 12))):
        mesh = h.mesh_of(shape)
        index_of = NamedSharding(mesh, P("data")).devices_indices_map(x.shape)
        for d in mesh.devices[row]:
            np.testing.assert_array_equal(x[index_of[d]], want[rows[0]:rows[1]])
    assert loader.rows_read == {1: 6 + 12}


def test_the_state_is_the_batches_handed_out():
    loader = HostBatches(_records(5), h.BATCH, start=2)
    assert next(loader)["x"].step == 3
    assert loader.get_state() == {"step": 3, "global_batch_size": h.BATCH}
    other = HostBatches(_records(5), h.BATCH)
    other.set_state(loader.get_state())
    assert [b["x"].step for b in other] == [4, 5]  # a finite source ends with its records
    with pytest.raises(BatchSplitError, match="global_batch_size=12"):
        other.set_state({"step": 1, "global_batch_size": 12})
    short = HostBatches(_records(2)[:-1], h.BATCH)  # a last batch it cannot fill: dropped
    assert [b["x"].step for b in short] == [1]
    assert [b["x"].step for b in HostBatches(_records(5), h.BATCH, steps=2)] == [1, 2]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"global_batch_size": 0}, "global_batch_size must be an int >= 1, got 0"),
    ({"global_batch_size": 2.5}, "got 2.5"),
    ({"global_batch_size": 4, "start": -1}, "start must be an int >= 0, got -1"),
    ({"global_batch_size": 4, "steps": True}, "steps must be an int >= 0, got True"),
])
def test_bad_arguments_are_typed_errors_naming_the_value(kwargs, match):
    with pytest.raises(InvalidOptionError, match=match):
        HostBatches([{"x": 1}] * 8, **kwargs)


def test_records_of_another_shape_are_refused():
    loader = HostBatches([{"x": np.zeros(3)}] * 3 + [{"x": np.zeros(4)}], 2)
    next(loader)["x"][:]
    with pytest.raises(BatchSplitError,
                       match=r"record 3 has a leaf of shape \(4,\) and dtype float64, "
                             r"record 0 \(3,\)"):
        next(loader)["x"][:]


def test_records_of_another_dtype_are_refused():
    loader = HostBatches([{"v": 1}, {"v": 2}, {"v": 2.7}, {"v": 3}], 2)
    next(loader)["v"][:]
    with pytest.raises(BatchSplitError, match="record 2 .* dtype float64, record 0 .* int64"):
        next(loader)["v"][:]


def test_a_grain_filter_and_a_streaming_dataset_are_refused_saying_why():
    """Grain's filter() leaves None where it drops a record: the batch was None (record
    0) or "record 1 has the structure PyTreeDef(None)" (a user trial); an IterDataset has
    no index: a raw TypeError at the first batch. Both now name the cause."""
    records = grain.MapDataset.source([{"x": np.full(2, i)} for i in range(8)])
    for odd in (0, 1):
        loader = HostBatches(records.filter(lambda r, odd=odd: r["x"][0] % 2 != odd), 4)
        with pytest.raises(BatchSplitError, match=rf"record {odd} of the source is None "
                                                  r"\(a Grain MapDataset's filter\(\)"):
            np.asarray(next(loader)["x"])
    with pytest.raises(InvalidOptionError, match=r"HostBatches reads records by index, and "
                                                 r"source is a \w+, which has none"):
        HostBatches(records.to_iter_dataset(), 4)


def test_a_batch_of_another_step_and_skip_batch_are_refused_by_the_resilient_step():
    """Records are indexed by step: a loader not started at the step ``restore()``
    returned, or a skipped batch (which moves the loader, not the step), would make
    processes read rows of different steps into one global batch."""
    loader = HostBatches(_records(3), h.BATCH)
    model, optimizer = h.make_mlp()
    step = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)), options=h.no_precompile())
    try:
        with pytest.raises(BatchSplitError, match=r"of step \[2\], the step about to run is 1"):
            step(model, optimizer, loader.batch(2))
    finally:
        step.close()
    model, optimizer = h.make_mlp()
    skipping = mnemojax.resilient(h.train_step, mesh=h.mesh_of((4, 2)),
                                  options=h.no_precompile(nonfinite="skip_batch"))
    try:
        with pytest.raises(InvalidOptionError, match="skip_batch.*per-host batches"):
            skipping(model, optimizer, loader.batch(1))
    finally:
        skipping.close()


def test_a_grain_dataset_is_read_by_global_record_index():
    ds = grain.MapDataset.source(_records(2)).shuffle(seed=7).repeat()
    loader = HostBatches(ds, h.BATCH)
    for step in (1, 2, 3):  # repeat(): a new epoch, reshuffled by Grain
        x = next(loader)["x"]
        want = np.stack([ds[(step - 1) * h.BATCH + i]["x"] for i in range(h.BATCH)])
        np.testing.assert_array_equal(np.asarray(x), want)


def test_a_resilient_run_on_grain_batches_recovers_exact():
    """Fed per-host batches, a run that loses a device (the mesh shrinks, the steps since
    the snapshot are replayed from the kept, still unread, batches) equals the plain run
    on the same examples."""
    steps = 6
    loader = HostBatches(grain.MapDataset.source(_records(steps)), h.BATCH)
    faults = mnemojax.testing.FaultInjector().lose_devices(4, [3])
    got, step = h.resilient_run(loader, mesh=h.mesh_of((4, 2)), faults=faults)
    [rec] = step.statistics.recoveries
    assert rec.new_mesh_shape != rec.old_mesh_shape
    h.assert_same_run(got, h.reference_run(h.make_batches(steps)))
