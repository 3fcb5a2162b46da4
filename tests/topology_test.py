"""The pure planner on fake topologies (plain integer ids), up to 512 devices."""

import itertools

import numpy as np
import pytest

from mnemojax._src.errors import InvalidOptionError, MeshTooSmallError
from mnemojax._src.topology import (
    collective_groups,
    plan_reduced_mesh,
    single_failure_plans,
)

AXES = ("data", "model")


def grid(*shape):
    return np.arange(int(np.prod(shape))).reshape(shape)


@pytest.mark.parametrize("data,model", [(4, 2), (32, 8), (64, 4), (16, 16), (128, 4)])
def test_drop_replica_keeps_model_axis_and_other_groups(data, model):
    ids = grid(data, model)
    dead = int(ids[data // 2, model - 1])
    plan = plan_reduced_mesh(ids, AXES, {dead}, batch_size=None)
    assert plan.kind == "drop_replicas"
    assert plan.shape == {"data": data - 1, "model": model}
    assert dead not in plan.device_ids
    # The model groups of surviving replicas are untouched; only the data groups change.
    assert len(plan.groups["model"].kept) == data - 1
    assert plan.groups["model"].added == ()
    assert len(plan.groups["data"].added) == model
    # The healthy partners of the dead device are idle, not lost.
    assert set(plan.idle) == set(ids[data // 2].tolist()) - {dead}


def test_keep_math_picks_widest_data_axis_dividing_batch():
    ids = grid(8, 2)
    plan = plan_reduced_mesh(ids, AXES, {0}, batch_size=32)  # 7 replicas left; 4 divide 32
    assert plan.shape == {"data": 4, "model": 2}
    assert not plan.math_changed and plan.examples_per_step == 32
    assert len(plan.idle) == 16 - 1 - 8


def test_truncate_batch_uses_all_replicas_and_says_math_changed():
    plan = plan_reduced_mesh(grid(8, 2), AXES, {0}, batch_size=32, batch_policy="truncate_batch")
    assert plan.shape == {"data": 7, "model": 2}
    assert plan.math_changed and plan.examples_per_step == 28


def test_params_sharded_over_data_axis_constrain_its_width():
    plan = plan_reduced_mesh(grid(4, 2), AXES, {3}, batch_size=24,
                             sharded_dims={"data": {16}})  # FSDP-style: 3 does not divide 16
    assert plan.shape == {"data": 2, "model": 2}


def test_regroups_healthy_leftovers_into_new_replicas():
    plan = plan_reduced_mesh(grid(4, 2), AXES, {1, 3}, batch_size=24)
    assert plan.shape == {"data": 3, "model": 2}
    assert plan.device_ids.tolist() == [[4, 5], [6, 7], [0, 2]]
    assert plan.groups["model"].added == ((0, 2),)


def test_spare_swap_changes_only_groups_through_failed_device():
    ids = grid(16, 8)
    plan = plan_reduced_mesh(ids, AXES, {37}, spares=[128, 129], batch_size=64)
    assert plan.kind == "spare_swap" and plan.shape == {"data": 16, "model": 8}
    assert plan.spares_used == (128,)
    assert plan.device_ids[37 // 8, 37 % 8] == 128
    assert plan.changed_group_count() == 2  # one data group, one model group
    assert plan.kept_group_count() == 16 + 8 - 2
    assert 129 in plan.idle


def test_too_few_spares_falls_back_to_dropping_replicas():
    plan = plan_reduced_mesh(grid(4, 2), AXES, {0, 2}, spares=[8])
    assert plan.kind == "drop_replicas"


def test_dead_spares_are_never_used():
    plan = plan_reduced_mesh(grid(2, 2), AXES, {0, 4}, spares=[4, 5])
    assert plan.kind == "spare_swap" and 5 in plan.device_ids and 4 not in plan.device_ids


@pytest.mark.parametrize("model,dims,want", [(8, {64}, 4), (8, {48}, 6), (16, {16, 12}, 4),
                                              (256, {512}, 128)])
def test_shrink_model_axis_to_widest_divisor(model, dims, want):
    ids = grid(1, model)
    plan = plan_reduced_mesh(ids, AXES, {1}, sharded_dims={"model": dims})
    assert plan.kind == "shrink_model"
    assert plan.shape == {"data": 1, "model": want}
    assert 1 not in plan.device_ids


def test_data_only_mesh_256_devices():
    ids = np.arange(256)
    plan = plan_reduced_mesh(ids, ("data",), {17, 200}, batch_size=1024)
    assert plan.shape == {"data": 128}  # 254 survive; 128 is the widest dividing 1024
    assert {17, 200}.isdisjoint(plan.device_ids.tolist())


def test_three_axes_512_devices():
    ids = grid(8, 8, 8)
    plan = plan_reduced_mesh(ids, ("data", "fsdp", "model"), {100}, batch_size=56)
    assert plan.shape == {"data": 7, "fsdp": 8, "model": 8}


def test_no_data_axis_and_two_model_axes_is_too_small():
    with pytest.raises(MeshTooSmallError, match="exactly one is supported"):
        plan_reduced_mesh(grid(2, 2), ("x", "y"), {0}, data_axis=None)


def test_min_devices_is_enforced():
    with pytest.raises(MeshTooSmallError, match="min_devices=8") as info:
        plan_reduced_mesh(grid(4, 2), AXES, {0}, batch_size=24, min_devices=8)
    assert info.value.required == 8


def test_bad_arguments_are_named():
    with pytest.raises(InvalidOptionError, match="axis_names"):
        plan_reduced_mesh(grid(4, 2), ("data",), {0})
    with pytest.raises(InvalidOptionError, match="batch_policy='mean'"):
        plan_reduced_mesh(grid(4, 2), AXES, {0}, batch_policy="mean")


def test_unaffected_failure_is_unchanged():
    plan = plan_reduced_mesh(grid(4, 2), AXES, {99})
    assert plan.kind == "unchanged" and plan.changed_group_count() == 0


def test_collective_groups_cover_every_device_once_per_axis():
    ids = grid(4, 2)
    groups = collective_groups(ids, AXES)
    for name, size in zip(AXES, ids.shape, strict=True):
        flat = list(itertools.chain.from_iterable(groups[name]))
        assert sorted(flat) == list(range(8)) and all(len(g) == size for g in groups[name])


def test_single_failure_plans_are_distinct_per_replica():
    plans = single_failure_plans(grid(4, 2), AXES, batch_size=24)
    assert len(plans) == 4
    assert len({p.key for p in plans}) == 4


def test_plans_are_deterministic():
    a = plan_reduced_mesh(grid(32, 8), AXES, {5, 77}, batch_size=240, spares=[256])
    b = plan_reduced_mesh(grid(32, 8), AXES, {77, 5}, batch_size=240, spares=[256])
    assert a.key == b.key
