"""The pure planner on fake topologies (plain integer ids), up to 512 devices."""

import dataclasses
import itertools

import numpy as np
import pytest

from mnemojax._src.errors import DistributedError, InvalidOptionError, MeshTooSmallError
from mnemojax._src.topology import (
    ShapeRules,
    aligned_with,
    collective_groups,
    plan_after_process_loss,
    plan_reduced_mesh,
    plans_ahead,
    process_loss_plans,
    renumber_devices,
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


def test_no_data_axis_and_two_model_axes_shrinks_the_first_that_keeps_most():
    plan = plan_reduced_mesh(grid(2, 2), ("x", "y"), {0}, data_axis=None)
    assert plan.kind == "shrink_model" and plan.shape == {"x": 1, "y": 2}
    assert plan.device_ids.tolist() == [[2, 3]]


def test_the_axis_that_keeps_most_devices_shrinks():
    """Dropping a data replica keeps 4 of 8 devices; shrinking the model axis to 3 (which
    divides its sharded dimension, 48) keeps 6."""
    plan = plan_reduced_mesh(grid(2, 4), AXES, {1}, batch_size=8, sharded_dims={"model": {48}})
    assert plan.kind == "shrink_model" and plan.shape == {"data": 2, "model": 3}
    assert not plan.math_changed and plan.examples_per_step == 8
    narrow = plan_reduced_mesh(grid(2, 4), AXES, {1}, batch_size=8,
                               sharded_dims={"model": {64}})  # 3 does not divide 64
    assert narrow.kind == "drop_replicas" and narrow.shape == {"data": 1, "model": 4}


def test_a_fixed_axis_keeps_its_width_and_a_plan_without_it_says_so():
    """An axis a shard_map maps over (`fixed_axes`) never narrows: replicas are dropped
    instead (the plan above kept more devices by narrowing 'model'); where nothing else
    fits, the error names it; every axis narrowing at once keeps it whole too."""
    plan = plan_reduced_mesh(grid(2, 4), AXES, {1}, batch_size=8,
                             sharded_dims={"model": {48}}, fixed_axes=("model",))
    assert plan.kind == "drop_replicas" and plan.shape == {"data": 1, "model": 4}
    with pytest.raises(MeshTooSmallError, match="axis 'model' kept whole .*shard_map"):
        plan_reduced_mesh(grid(1, 2), AXES, {1}, batch_size=4, fixed_axes=("model",))
    assert plan_reduced_mesh(grid(1, 2), AXES, {1}, batch_size=4).kind == "shrink_model"
    # deaths in slices of every axis (3 healthy of 12): every axis narrows at once, but
    # 'model' stays at 2 (free, it narrows to 1 to keep 3 devices)
    axes3 = ("data", "model", "x")
    free = plan_reduced_mesh(grid(2, 2, 3), axes3, set(range(9)), batch_size=4)
    assert free.shape == {"data": 1, "model": 1, "x": 3}
    fixed = plan_reduced_mesh(grid(2, 2, 3), axes3, set(range(9)), batch_size=4,
                              fixed_axes=("model",))
    assert fixed.shape == {"data": 1, "model": 2, "x": 1}


def test_a_refused_shape_is_passed_over_for_the_next_widest():
    """A shape the step could not be compiled for is never planned: the next width that
    fits the rules is taken, or the next axis; with none left, no plan."""
    assert plan_reduced_mesh(grid(4, 2), AXES, {3}, batch_size=24).shape == {
        "data": 3, "model": 2}
    plan = plan_reduced_mesh(grid(4, 2), AXES, {3}, batch_size=24, refused_shapes=[(3, 2)])
    assert plan.shape == {"data": 2, "model": 2} and plan.kind == "drop_replicas"
    narrowed = plan_reduced_mesh(grid(2, 4), AXES, {1}, batch_size=8,
                                 sharded_dims={"model": {48}}, refused_shapes=[(2, 3)])
    assert narrowed.shape == {"data": 1, "model": 4}  # (2, 3) kept more devices
    axes3 = ("data", "model", "x")
    every = plan_reduced_mesh(grid(2, 2, 3), axes3, set(range(9)), batch_size=4,
                              refused_shapes=[(1, 1, 3)])
    assert every.shape != {"data": 1, "model": 1, "x": 3} and every.device_ids.size == 2
    with pytest.raises(MeshTooSmallError):
        plan_reduced_mesh(grid(1, 2), AXES, {1}, batch_size=4, refused_shapes=[(1, 1)])


@pytest.mark.parametrize("scale,want", [
    (1, {"data": 2, "fsdp": 3, "tensor": 2}),  # 12 devices, against 8 dropping a replica
    (4, {"data": 6, "fsdp": 4, "tensor": 8}),  # 256 devices: 192 either way; data first
])
def test_batch_split_over_two_axes_shrinks_fsdp_keeping_the_math(scale, want):
    """(data, fsdp, tensor) with the batch over (data, fsdp), MaxText-style: the fsdp axis
    shrinks to 3 (dividing its sharded dimension and the batch over data) where that keeps
    more devices than dropping a whole data replica."""
    data, fsdp, tensor = 2 * scale, 4, 2 * scale
    ids = grid(data, fsdp, tensor)
    batch = 12 * data
    plan = plan_reduced_mesh(ids, ("data", "fsdp", "tensor"), {int(ids[0, 1, 0])},
                             data_axis=("data", "fsdp"), batch_size=batch,
                             sharded_dims={"fsdp": {48}, "tensor": {64}})
    assert plan.kind == "drop_replicas"
    assert plan.shape == want
    assert plan.examples_per_step == batch and not plan.math_changed
    # Under truncate_batch the widths need not divide the batch.
    cut = plan_reduced_mesh(ids, ("data", "fsdp", "tensor"), {int(ids[0, 1, 0])},
                            data_axis=("data", "fsdp"), batch_size=batch + 2,
                            batch_policy="truncate_batch", sharded_dims={"fsdp": {48}})
    widths = cut.shape["data"] * cut.shape["fsdp"]
    assert cut.math_changed and cut.examples_per_step == (batch + 2) // widths * widths


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


# -- process loss: the same planner, renumbered into the new world ---------------------------

def rules(batch_size=None, min_devices=1) -> ShapeRules:
    return ShapeRules(data_axis="data", sharded_dims={}, batch_size=batch_size,
                      batch_policy="keep_math", min_devices=min_devices)


def world(processes: int, per_process: int) -> dict[int, tuple[int, int]]:
    """Places of a world of `processes` x `per_process` devices, ids by process."""
    return {p * per_process + r: (p, r) for p in range(processes) for r in range(per_process)}


def new_world_devices(survivors: int, per_process: int) -> dict[int, list[int]]:
    return {q: list(range(q * per_process, (q + 1) * per_process)) for q in range(survivors)}


def test_renumber_maps_survivors_in_rank_order():
    places = world(4, 2)
    # Workers 10..13 were ranks 0..3; worker 11 (rank 1) died: 10, 12, 13 are ranks 0, 1, 2.
    got = renumber_devices(places, (10, 11, 12, 13), (10, 12, 13), new_world_devices(3, 2))
    assert got == {0: 0, 1: 1, 4: 2, 5: 3, 6: 4, 7: 5}


def test_renumber_rejects_a_process_that_lost_devices():
    with pytest.raises(DistributedError, match="has 1 devices"):
        renumber_devices(world(2, 2), (0, 1), (0, 1), {0: [0, 1], 1: [2]})


@pytest.mark.parametrize("processes,per_process,model", [(4, 2, 2), (64, 8, 8), (128, 4, 2),
                                                         (64, 16, 4)])
def test_process_loss_drops_the_replicas_of_the_lost_process(processes, per_process, model):
    """512+ devices: the lost process's replicas go, every other replica keeps its
    devices (renumbered), and the plan's groups say which collectives lost members."""
    n = processes * per_process
    ids = grid(n // model, model)
    places = world(processes, per_process)
    members = tuple(range(processes))
    lost = processes // 2
    survivors = tuple(w for w in members if w != lost)
    renumbering = renumber_devices(places, members, survivors,
                                   new_world_devices(len(survivors), per_process))
    plan = plan_after_process_loss(ids, AXES, renumbering, rules())
    lost_ids = {i for i, (p, _) in places.items() if p == lost}
    lost_replicas = {r for r in range(ids.shape[0]) if set(ids[r].tolist()) & lost_ids}
    assert plan.kind == "drop_replicas"
    assert plan.shape == {"data": ids.shape[0] - len(lost_replicas), "model": model}
    assert set(plan.device_ids.flat) <= set(range(len(survivors) * per_process))
    kept_old = [r for r in range(ids.shape[0]) if r not in lost_replicas]
    expected = np.vectorize(renumbering.__getitem__)(ids[kept_old])
    np.testing.assert_array_equal(plan.device_ids, expected)
    assert len(plan.groups["model"].removed) == len(lost_replicas)


def test_process_loss_keeps_the_math_and_uses_idle_processes_as_spares():
    """8 processes x 1 device, data=6 (two idle processes): losing one swaps in an idle
    one (same shape); with the batch of 24 and no idle process, width 4 divides it."""
    places = world(8, 1)
    ids = grid(6, 1)
    renumbering = renumber_devices(places, tuple(range(8)), (0, 1, 3, 4, 5, 6, 7),
                                   new_world_devices(7, 1))
    plan = plan_after_process_loss(ids, AXES, renumbering, rules(24), spares=[6, 7])
    assert plan.kind == "spare_swap" and plan.shape == {"data": 6, "model": 1}
    assert plan.spares_used == (renumbering[6],) and plan.idle == (renumbering[7],)
    plan = plan_after_process_loss(grid(8, 1), AXES, renumbering, rules(24))
    assert plan.shape == {"data": 6, "model": 1} and not plan.math_changed
    plan = plan_after_process_loss(grid(8, 1), AXES, renumbering, rules(16))
    assert plan.shape == {"data": 4, "model": 1} and len(plan.idle) == 3


def test_process_loss_shrinks_the_model_axis_when_no_whole_replica_survives():
    """(1, 8) over 4 processes: no whole replica survives the loss of process 1, so the
    model axis shrinks to the widest width that divides its sharded dims (4 of the 6
    devices left), over whole processes in order: the third survivor is left idle (it
    leaves the job). Fewer devices than ``min_devices`` is still a typed error."""
    renumbering = renumber_devices(world(4, 2), (0, 1, 2, 3), (0, 2, 3),
                                   new_world_devices(3, 2))
    model_dims = ShapeRules(data_axis="data", sharded_dims={"model": (64,)}, batch_size=24,
                            batch_policy="keep_math", min_devices=1)
    plan = plan_after_process_loss(grid(1, 8), AXES, renumbering, model_dims)
    assert plan.kind == "shrink_model" and plan.shape == {"data": 1, "model": 4}
    assert plan.device_ids.tolist() == [[0, 1, 2, 3]] and not plan.math_changed
    at_least_6 = dataclasses.replace(model_dims, min_devices=6)
    with pytest.raises(MeshTooSmallError, match="min_devices=6"):
        plan_after_process_loss(grid(1, 8), AXES, renumbering, at_least_6)


def test_a_model_axis_narrows_only_within_the_memory_headroom():
    """``max_model_shrink``: shrinking the model axis 4 -> 3 puts 4/3 of a share on each
    device; under a bound of 1.2 the planner drops a replica instead (4 devices, each
    with its old share), and where nothing else fits (no whole replica left) it is a
    typed error naming the bound."""
    dims = {"model": {48}}
    loose = plan_reduced_mesh(grid(2, 4), AXES, {1}, batch_size=8, sharded_dims=dims,
                              max_model_shrink=4 / 3)
    assert loose.kind == "shrink_model" and loose.shape == {"data": 2, "model": 3}
    tight = plan_reduced_mesh(grid(2, 4), AXES, {1}, batch_size=8, sharded_dims=dims,
                              max_model_shrink=1.2)
    assert tight.kind == "drop_replicas" and tight.shape == {"data": 1, "model": 4}
    with pytest.raises(MeshTooSmallError, match=r"'model' 8 -> 4 \(x2 per device\).*"
                                                r"max_model_shrink=1.5"):
        plan_reduced_mesh(grid(1, 8), AXES, {3}, batch_size=8,
                          sharded_dims={"model": {64}}, max_model_shrink=1.5)
    assert plan_reduced_mesh(grid(1, 8), AXES, {3}, batch_size=8, sharded_dims={
        "model": {64}}, max_model_shrink=2).shape == {"data": 1, "model": 4}


def test_the_shrink_bound_holds_for_any_axis_the_state_is_sharded_along():
    """An FSDP axis is a batch axis, and narrowing it puts more state on each device
    too: it is bounded like a model axis. An axis nothing is sharded along (plain data
    parallelism) is not."""
    fsdp = {"data_axis": ("data", "fsdp"), "batch_size": 8, "sharded_dims": {"fsdp": {64}}}
    axes = ("data", "fsdp")
    assert plan_reduced_mesh(grid(1, 8), axes, {3}, **fsdp).shape == {"data": 1, "fsdp": 4}
    with pytest.raises(MeshTooSmallError, match=r"'fsdp' 8 -> 4 \(x2 per device\)"):
        plan_reduced_mesh(grid(1, 8), axes, {3}, max_model_shrink=1.5, **fsdp)
    plain = plan_reduced_mesh(grid(4, 2), AXES, {1}, batch_size=8, max_model_shrink=1.0)
    assert plain.kind == "drop_replicas" and plain.shape == {"data": 2, "model": 2}


def test_process_loss_applies_min_devices():
    renumbering = renumber_devices(world(4, 2), (0, 1, 2, 3), (0, 1, 2),
                                   new_world_devices(3, 2))
    with pytest.raises(MeshTooSmallError, match="min_devices=8"):
        plan_after_process_loss(grid(4, 2), AXES, renumbering, rules(min_devices=8))


def test_the_planner_never_imports_jax():
    """Pure logic apart from JAX-facing code: topology imports neither jax nor flax."""
    import ast
    import pathlib

    import mnemojax._src.topology as topology

    tree = ast.parse(pathlib.Path(topology.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not imported & {"jax", "jaxlib", "flax"}


def test_truncate_batch_keeps_the_examples_when_a_model_axis_shrinks_next():
    """Under truncate_batch a first loss narrows the data axis (10 -> 9 examples); a
    second that shrinks the model axis keeps the 9 the narrowed data axis can split."""
    first = plan_reduced_mesh(grid(4, 4), AXES, {0}, batch_size=10,
                              batch_policy="truncate_batch", sharded_dims={"model": (12,)})
    assert first.shape == {"data": 3, "model": 4} and first.examples_per_step == 9
    second = plan_reduced_mesh(first.device_ids, AXES, {int(first.device_ids[0, 1])},
                               batch_size=10, batch_policy="truncate_batch",
                               sharded_dims={"model": (12,)})
    assert second.examples_per_step % second.shape["data"] == 0
    assert second.math_changed and second.examples_per_step == 9


@pytest.mark.parametrize("processes,per_process,model", [(4, 2, 2), (64, 8, 8), (32, 4, 1)])
def test_the_worlds_one_process_loss_forms_are_one_plan_over_the_first_processes(
        processes, per_process, model):
    """Whichever process dies, the survivors renumber in order, so the next world's plan
    is the same, over the ids this world's processes 0..n-2 have (compilable now): the
    plan each actual loss gives, renumbered by `renumber_devices`."""
    n = processes * per_process
    ids = grid(n // model, model)
    places = world(processes, per_process)
    [plan] = process_loss_plans(ids, AXES, places, rules())
    assert set(plan.device_ids.flat) == set(range((processes - 1) * per_process)) - set(
        plan.idle)
    members = tuple(range(processes))
    for lost in (0, processes // 2, processes - 1):
        survivors = tuple(w for w in members if w != lost)
        actual = plan_after_process_loss(
            ids, AXES, renumber_devices(places, members, survivors,
                                        new_world_devices(len(survivors), per_process)),
            rules())
        assert actual.key == plan.key


def test_plans_ahead_cover_a_second_loss_after_the_first():
    """A world compiles ahead the world one loss forms, then the one a second loss forms
    from it: each as the actual losses give it (any victims), over the ids of the first
    processes; none when only one process would be left."""
    ids, places, members = grid(4, 2), world(4, 2), (0, 1, 2, 3)
    [only], none = plans_ahead(ids, AXES, places, rules())  # (the default: one loss)
    [first], [second] = plans_ahead(ids, AXES, places, rules(), losses=2)
    assert none == []
    assert only.key == first.key
    assert first.shape == {"data": 3, "model": 2} and second.shape == {"data": 2, "model": 2}
    survivors = (0, 2, 3)
    one = plan_after_process_loss(ids, AXES, renumber_devices(
        places, members, survivors, new_world_devices(3, 2)), rules())
    then = plan_after_process_loss(one.device_ids, AXES, renumber_devices(
        world(3, 2), (0, 1, 2), (0, 2), new_world_devices(2, 2)), rules())
    assert (one.key, then.key) == (first.key, second.key)
    [one_left], [] = plans_ahead(grid(2, 2), AXES, world(2, 2), rules(), losses=2)
    assert one_left.shape == {"data": 1, "model": 2}


def test_plans_ahead_only_when_processes_hold_equal_devices_and_two_or_more_are_left():
    places = {0: (0, 0), 1: (0, 1), 2: (1, 0)}  # 2 + 1 devices: ids would not carry over
    assert process_loss_plans(grid(3, 1), AXES, places, rules()) == []
    assert process_loss_plans(grid(1, 2), AXES, world(1, 2), rules()) == []
    # Every process holds part of the only replica: the model axis shrinks onto the
    # survivor's devices.
    [plan] = process_loss_plans(grid(1, 4), AXES, world(2, 2), rules())
    assert plan.kind == "shrink_model" and plan.device_ids.tolist() == [[0, 1]]


def test_when_no_single_axis_can_shrink_every_axis_narrows():
    """Three of four devices of a (2, 2) mesh dead (a user trial: two processes of a 4 x 1
    job killed 0.35 s apart, a healthy one left in the first recovery): no single axis
    shrinks onto one device, but a (1, 1) mesh keeps the math. It ended the job with
    MeshTooSmallError."""
    ids = np.arange(4).reshape(2, 2)
    plan = plan_reduced_mesh(ids, ("data", "fsdp"), {0, 1, 3}, data_axis="data",
                             sharded_dims={"fsdp": (64,)}, batch_size=16)
    assert plan.device_ids.tolist() == [[2]] and plan.kind == "shrink_model"
    assert plan.examples_per_step == 16 and not plan.math_changed
    # The bound on how far a sharded axis may narrow still holds.
    with pytest.raises(MeshTooSmallError):
        plan_reduced_mesh(np.arange(4).reshape(2, 2), ("data", "fsdp"), {0, 1, 3},
                          data_axis="data", sharded_dims={"fsdp": (64,)}, batch_size=16,
                          max_model_shrink=1.5)


def test_a_plan_takes_the_device_order_of_another_steps_mesh_over_the_same_devices():
    """Two steps of one process meet the same two deaths, one at a time (a drop, then a
    spare swap with an idle device) and both at once (a drop): the same devices in other
    orders, and every array one step passed the other was resharded at every call
    (trial 47: x4 per iteration of a GAN's two pure steps). The later plan takes the
    other's order."""
    one_at_a_time = plan_reduced_mesh(grid(8), ("data",), {3}, batch_size=8)
    one_at_a_time = plan_reduced_mesh(one_at_a_time.device_ids, ("data",), {1, 3},
                                      spares=one_at_a_time.idle, batch_size=8)
    at_once = plan_reduced_mesh(grid(8), ("data",), {1, 3}, batch_size=8)
    assert (one_at_a_time.kind, one_at_a_time.device_ids.tolist()) == ("spare_swap", [0, 5, 2, 4])
    assert (at_once.kind, at_once.device_ids.tolist()) == ("drop_replicas", [0, 2, 4, 5])
    aligned = aligned_with(at_once, grid(8), [one_at_a_time])
    assert aligned.device_ids.tolist() == [0, 5, 2, 4] and aligned.kind == "drop_replicas"
    assert aligned.groups["data"].added == ((0, 5, 2, 4),)
    assert aligned.idle == at_once.idle and aligned.examples_per_step == 8
    # Other devices, another shape or other axis names: the step's own plan.
    other_devices = plan_reduced_mesh(grid(8), ("data",), {3}, batch_size=8)
    wider = plan_reduced_mesh(grid(8), ("data",), {1, 3})  # no batch: 6 wide
    renamed = dataclasses.replace(one_at_a_time, axis_names=("batch",))
    for others in ([], [other_devices], [wider], [renamed], [at_once]):
        assert aligned_with(at_once, grid(8), others) is at_once
    # On a (4, 2) mesh: the first match among the others.
    mesh = plan_reduced_mesh(grid(4, 2), AXES, {2, 4}, batch_size=8)
    flipped = dataclasses.replace(mesh, device_ids=mesh.device_ids[::-1].copy())
    assert aligned_with(mesh, grid(4, 2), [wider, flipped, mesh]).device_ids.tolist() == \
        flipped.device_ids.tolist()
