"""Plans and specs to jax.sharding (mnemojax._src.sharding): meshes, validation, batch specs."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mnemojax._src import sharding as shd
from mnemojax._src.topology import MeshPlan
from mnemojax.errors import ShardingMismatchError
from tests import helpers as h

pytestmark = pytest.mark.needs8

MESH = {"data": 4, "model": 2}


def _plan(ids, names=("data", "model")):
    return MeshPlan(np.asarray(ids), tuple(names), "unchanged")


def test_mesh_from_plan_keeps_device_order_and_axis_names():
    ids = [[7, 2], [5, 0], [3, 6]]  # a reduced mesh in no particular order
    mesh = shd.mesh_from_plan(_plan(ids))
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 3, "model": 2}
    np.testing.assert_array_equal(shd.device_ids(mesh), ids)
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2


def test_device_ids_of_a_jax_mesh():
    mesh = h.mesh_of((4, 2))
    ids = shd.device_ids(mesh)
    assert ids.dtype == np.int64 and ids.shape == (4, 2)
    np.testing.assert_array_equal(ids.ravel(), [d.id for d in jax.devices()[:8]])


def test_spec_axes_lists_only_sharded_dimensions():
    assert shd.spec_axes(P()) == []
    assert shd.spec_axes(P(None, "model")) == [(1, ("model",))]
    assert shd.spec_axes(P(("data", "model"), None, "data")) == [
        (0, ("data", "model")), (2, ("data",))]


def test_valid_specs_pass():
    shd.validate_specs([P(None, "model"), P("data"), P(), P(("data", "model"))],
                       [(3, 4), (8,), (5, 7), (16, 3)], ["a", "b", "c", "d"], MESH)


@pytest.mark.parametrize("spec,shape,message", [
    (P(None, None, "model"), (4, 4), r"more entries than the array has dimensions \(shape"),
    (P("modle"), (4,), r"names mesh axis 'modle', but the mesh has axes \('data', 'model'\)"),
    (P(None, "model"), (4, 3), r"dimension 1 of size 3 is sharded over \('model',\) \(width 2\)"),
    (P(("data", "model")), (12,), r"sharded over \('data', 'model'\) \(width 8\)"),
])
def test_invalid_spec_error_names_the_leaf_and_the_problem(spec, shape, message):
    specs = [P(), spec, P("data")]
    shapes = [(2,), shape, (8,)]
    paths = ["model/l1/bias", "model/l2/kernel", "optimizer/mu"]
    with pytest.raises(ShardingMismatchError, match=message) as info:
        shd.validate_specs(specs, shapes, paths, MESH)
    assert str(info.value).startswith("model/l2/kernel: ")
    assert isinstance(info.value, ValueError)
    assert "adafactor" not in str(info.value)


def test_an_optimizer_state_that_keeps_its_parameters_annotation_is_explained():
    # (Flax gives adafactor's (1,)-shaped placeholders their parameter's annotation)
    with pytest.raises(ShardingMismatchError, match=r"of size 1 .*adafactor's \(1,\) "
                                                    r"placeholders.*plain nnx.jit fails"):
        shd.validate_specs([P("model")], [(1,)], ["optimizer/opt_state/0/v_col/l1/bias"],
                           MESH)


def test_first_bad_leaf_is_reported():
    with pytest.raises(ShardingMismatchError, match="^second: "):
        shd.validate_specs([P("data"), P("data"), P("nope")], [(8,), (6,), (8,)],
                           ["first", "second", "third"], MESH)


def test_sharded_dims_collects_sizes_per_axis():
    got = shd.sharded_dims([P(None, "model"), P("model"), P(("data", "model")), P()],
                           [(16, 64), (64,), (24, 2), (5,)])
    assert got == {"model": {64, 24}, "data": {24}}


def test_batch_spec_splits_along_the_data_axis_only_when_it_can():
    mesh = h.mesh_of((4, 2))
    assert shd.batch_spec(mesh, ("data",), 2) == P("data")
    assert shd.batch_spec(mesh, ("data",), 0) == P()  # a scalar is replicated
    assert shd.batch_spec(mesh, ("batch",), 1) == P()  # no such axis: replicated
    assert shd.batch_spec(mesh, ("data", "model"), 2) == P(("data", "model"))


def test_named_shardings_follow_the_specs():
    mesh = h.mesh_of((4, 2))
    got = shd.named(mesh, [P("data"), P()])
    assert got == [NamedSharding(mesh, P("data")), NamedSharding(mesh, P())]
