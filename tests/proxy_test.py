"""The device proxy (mnemojax._src.proxy): error verdicts, health probes, spares, batches.

Steps here are plain Python callables run through the device layer, so nothing compiles.
"""

import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mnemojax._src import sharding as shd
from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.proxy import DeviceProxy, host_batch, looks_local, looks_transient
from mnemojax._src.topology import MeshPlan
from mnemojax.errors import BatchSplitError, StepHangError
from mnemojax.testing import FaultInjector

pytestmark = pytest.mark.needs8


class _CountingLayer(JaxDeviceLayer):
    """The real layer, counting health probes per device."""

    def __init__(self):
        super().__init__()
        self.probed: list[int] = []

    def probe(self, device, timeout_s):
        self.probed.append(device.id)
        return super().probe(device, timeout_s)


def _plan(ids, idle=()):
    return MeshPlan(np.asarray(ids), ("data", "model"), "unchanged", idle=tuple(idle))


def _proxy(faults=None, ids=((0, 1), (2, 3), (4, 5)), spares=(6, 7)):
    inner = _CountingLayer()
    layer = faults.wrap(inner) if faults is not None else inner
    plan = _plan(ids)
    proxy = DeviceProxy(layer, plan, shd.mesh_from_plan(plan), spares, batch_axes=("data",),
                        probe_timeout_s=5.0)
    return proxy, inner


def _noop_step(leaves, batch):
    return leaves, {"loss": 0.0}


def _runtime_error(text):
    return jax.errors.JaxRuntimeError(text)


# -- classify ----------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [
    ValueError("bad shape"), TypeError("not an array"), KeyError("loss"),
    FloatingPointError("nan"),
])
def test_non_runtime_errors_are_user_errors_without_probing(exc):
    proxy, layer = _proxy()
    assert proxy.classify(exc).kind == "user"
    assert layer.probed == [] and proxy.dead == set()


@pytest.mark.parametrize("text", [
    "INVALID_ARGUMENT: shapes do not match",
    "RESOURCE_EXHAUSTED: out of memory allocating 1 GiB",
    "INTERNAL: something broke",
])
def test_runtime_error_with_every_device_healthy_and_no_retryable_status_is_user(text):
    proxy, layer = _proxy()
    verdict = proxy.classify(_runtime_error(text))
    assert verdict.kind == "user" and verdict.failed == ()
    assert sorted(layer.probed) == list(range(8))  # it did look: mesh and spares


@pytest.mark.parametrize("text", [
    "UNAVAILABLE: peer not ready", "DEADLINE_EXCEEDED: rpc", "ABORTED: collective",
    "CANCELLED: op", "Connection reset by peer", "operation timed out",
])
def test_retryable_status_with_every_device_healthy_is_transient(text):
    proxy, _ = _proxy()
    verdict = proxy.classify(_runtime_error(text))
    assert verdict.kind == "transient" and verdict.failed == ()
    assert proxy.dead == set() and proxy.spares == [6, 7]


def test_injected_transient_error_is_classified_transient():
    faults = FaultInjector().transient_error(1)
    proxy, _ = _proxy(faults)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        proxy.run(_noop_step, [], {}, step=1)
    assert proxy.classify(info.value).kind == "transient"
    assert proxy.run(_noop_step, [], {}, step=1)[1] == {"loss": 0.0}  # the retry works


@pytest.mark.parametrize("surface", ["dispatch", "block"])
def test_device_lost_in_the_mesh_is_a_device_failure_naming_it(surface):
    faults = FaultInjector().lose_devices(2, [3], surface=surface)
    proxy, _ = _proxy(faults)
    proxy.run(_noop_step, [], {}, step=1)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        proxy.run(_noop_step, [], {}, step=2)
    verdict = proxy.classify(info.value)
    assert verdict.kind == "device_failure" and verdict.failed == (3,)
    assert verdict.detect_s > 0
    assert proxy.dead == {3}


def test_device_failure_wins_over_a_retryable_status():
    """A dead device in the mesh means recovery, even if the error text looks transient."""
    faults = FaultInjector().lose_devices(1, [4, 1])
    proxy, _ = _proxy(faults)
    with pytest.raises(jax.errors.JaxRuntimeError):
        proxy.run(_noop_step, [], {}, step=1)
    verdict = proxy.classify(_runtime_error("UNAVAILABLE: peer gone"))
    assert verdict.kind == "device_failure" and verdict.failed == (1, 4)


def test_a_dead_spare_alone_is_transient_and_leaves_the_pool():
    faults = FaultInjector().lose_devices(1, [7])
    proxy, _ = _proxy(faults)
    proxy.run(_noop_step, [], {}, step=1)  # 7 is not in the mesh: the step succeeds
    verdict = proxy.classify(_runtime_error("INTERNAL: spare died"))
    assert verdict.kind == "transient" and verdict.failed == ()
    assert proxy.dead == {7} and proxy.spares == [6]


def test_hang_is_a_step_hang_error_then_a_device_failure():
    faults = FaultInjector().hang(1, [2])
    proxy, _ = _proxy(faults)
    try:
        with pytest.raises(StepHangError, match="step 1: results not ready after 0.2 s") as info:
            proxy.run(_noop_step, [], {}, step=1, timeout_s=0.2)
        assert info.value.step == 1 and info.value.timeout_s == 0.2
        verdict = proxy.classify(info.value)
        assert verdict.kind == "device_failure" and verdict.failed == (2,)
    finally:
        faults.release_hung()


def test_slow_step_with_healthy_devices_is_a_transient_hang():
    gate = threading.Event()

    class _SlowLayer(_CountingLayer):
        def block(self, outputs, *, step, devices):
            gate.wait(10)
            return super().block(outputs, step=step, devices=devices)

    plan = _plan([[0, 1], [2, 3]])
    proxy = DeviceProxy(_SlowLayer(), plan, shd.mesh_from_plan(plan), [], batch_axes=("data",),
                        probe_timeout_s=5.0)
    with pytest.raises(StepHangError) as info:
        proxy.run(_noop_step, [], {}, step=4, timeout_s=0.1)
    gate.set()
    assert proxy.classify(info.value).kind == "transient"
    # The abandoned waiter does not block the next step.
    assert proxy.run(_noop_step, [1], {}, step=5, timeout_s=5.0)[0] == [1]


def test_run_returns_the_step_outputs_with_and_without_a_timeout():
    proxy, _ = _proxy()
    x = jax.device_put(np.arange(4.0, dtype=np.float32))
    out = proxy.run(lambda leaves, batch: [leaves[0] + batch], [x], 1.0, step=1)
    np.testing.assert_array_equal(out[0], [1, 2, 3, 4])
    out = proxy.run(lambda leaves, batch: [leaves[0] * batch], [x], 2.0, step=2, timeout_s=5.0)
    np.testing.assert_array_equal(out[0], [0, 2, 4, 6])
    with pytest.raises(ZeroDivisionError):  # a user error propagates unchanged
        proxy.run(lambda leaves, batch: 1 / 0, [], {}, step=3, timeout_s=5.0)


def test_await_outputs_waits_like_a_step_without_the_layers_injected_faults():
    """Work run beside the steps (a warm-up) is waited for as a step is, but never
    through the device layer: a fault set to fire when step 1 blocks stays for step 1."""
    faults = FaultInjector().lose_devices(1, [2], surface="block")
    proxy, _ = _proxy(faults)
    x = jax.device_put(np.arange(4.0, dtype=np.float32))
    out = proxy.await_outputs([x + 1], timeout_s=5.0, step=1)
    np.testing.assert_array_equal(out[0], [1, 2, 3, 4])
    with pytest.raises(jax.errors.JaxRuntimeError):  # the step's fault is still to come
        proxy.run(_noop_step, [], {}, step=1, timeout_s=5.0)


# -- probe_all ----------------------------------------------------------------------------

def test_probe_all_records_new_deaths_once_and_skips_known_dead():
    faults = FaultInjector().lose_devices(1, [2, 6])
    proxy, layer = _proxy(faults)
    assert proxy.probe_all() == set()  # nothing has fired yet
    with pytest.raises(jax.errors.JaxRuntimeError):
        proxy.run(_noop_step, [], {}, step=1)
    layer.probed.clear()
    assert proxy.probe_all() == {2, 6}
    assert proxy.dead == {2, 6} and proxy.spares == [7]
    assert 2 not in layer.probed  # dead per the injector: never reached the real layer
    layer.probed.clear()
    assert proxy.probe_all() == set()  # already known
    assert sorted(layer.probed) == [0, 1, 3, 4, 5, 7]  # the dead are not probed again


def test_probe_all_covers_mesh_and_spares_only():
    proxy, layer = _proxy(ids=((0, 1), (2, 3)), spares=(5,))
    proxy.probe_all()
    assert sorted(layer.probed) == [0, 1, 2, 3, 5]


# -- the spare pool ---------------------------------------------------------------------

def test_known_dead_devices_never_join_the_spare_pool():
    plan = _plan([[0, 1], [2, 3]])
    proxy = DeviceProxy(JaxDeviceLayer(), plan, shd.mesh_from_plan(plan), [4, 5, 6],
                        batch_axes=("data",), probe_timeout_s=5.0, dead=[5])
    assert proxy.dead == {5} and proxy.spares == [4, 6]


def test_spares_after_a_plan_pool_its_idle_devices():
    proxy, _ = _proxy(ids=((0, 1), (2, 3), (4, 5)), spares=(6,))
    proxy.dead = {1}
    new = _plan([[6, 0], [2, 3]], idle=(4, 5))  # spare 6 swapped in, a replica idle
    assert proxy.spares_after(new) == [4, 5]  # 6 left the pool for the mesh
    assert proxy.spares == [6]  # asking changes nothing


def test_spares_after_never_pool_dead_or_mesh_devices_and_keep_order():
    proxy, _ = _proxy(ids=((0, 1), (2, 3), (4, 5)), spares=(7, 6))
    proxy.dead = {5, 6}
    new = _plan([[0, 1], [2, 3]], idle=(4, 5, 2, 4))
    assert proxy.spares_after(new) == [7, 4]  # old spares first, then idle; no duplicates


def test_device_places_are_process_and_rank_in_one_process():
    proxy, _ = _proxy()
    assert proxy.device_places() == {d.id: (0, rank) for rank, d in
                                     enumerate(sorted(jax.devices(), key=lambda d: d.id))}


# -- place_batch --------------------------------------------------------------------------

def _batch_shardings(proxy, batch):
    return jax.tree.map(lambda x: NamedSharding(
        proxy.mesh, shd.batch_spec(proxy.mesh, ("data",), np.ndim(x))), batch)


def test_place_batch_splits_along_the_data_axis():
    proxy, _ = _proxy()  # data width 3
    batch = {"x": np.arange(12.0, dtype=np.float32).reshape(6, 2), "lr": np.float32(0.5)}
    placed = proxy.place_batch(batch, _batch_shardings(proxy, batch), examples=None)
    np.testing.assert_array_equal(placed["x"], batch["x"])
    assert placed["x"].sharding.spec == P("data")
    assert {s.data.shape for s in placed["x"].addressable_shards} == {(2, 2)}
    assert float(placed["lr"]) == 0.5


def test_place_batch_truncates_to_the_examples_the_plan_uses():
    proxy, _ = _proxy()
    batch = {"x": np.arange(8, dtype=np.int32), "y": np.arange(8, dtype=np.int32)}
    placed = proxy.place_batch(batch, _batch_shardings(proxy, batch), examples=6)
    np.testing.assert_array_equal(placed["x"], np.arange(6))
    assert placed["y"].shape == (6,)


def test_place_batch_error_names_the_leaf_size_and_width():
    proxy, _ = _proxy()  # data width 3
    batch = {"inputs": {"tokens": np.zeros((3, 4), np.int32)},
             "targets": np.zeros((4, 4), np.int32)}
    with pytest.raises(BatchSplitError) as info:
        proxy.place_batch(batch, _batch_shardings(proxy, batch), examples=None)
    message = str(info.value)
    assert "['targets']" in message and "4 examples" in message and "width 3" in message
    assert isinstance(info.value, ValueError)


def test_replicated_batch_leaves_need_not_divide():
    proxy, _ = _proxy()
    batch = {"table": np.zeros((5, 2), np.float32)}
    shardings = {"table": NamedSharding(proxy.mesh, P())}
    assert proxy.place_batch(batch, shardings, examples=None)["table"].shape == (5, 2)


def test_place_batch_goes_through_the_layer():
    faults = FaultInjector().lose_devices(1, [4])
    proxy, _ = _proxy(faults)
    with pytest.raises(jax.errors.JaxRuntimeError):
        proxy.run(_noop_step, [], {}, step=1)
    batch = {"x": np.zeros((6,), np.float32)}
    with pytest.raises(jax.errors.JaxRuntimeError, match="host-to-device"):
        proxy.place_batch(batch, _batch_shardings(proxy, batch), examples=None)


# -- helpers ----------------------------------------------------------------------------

@pytest.mark.parametrize("text,transient", [
    ("UNAVAILABLE: try again", True),
    ("DEADLINE_EXCEEDED", True),
    ("INTERNAL: gloo: Connection reset by peer", False),  # a dead CPU peer, not a blip
    ("Gloo collective timed out", False),
    ("INVALID_ARGUMENT", False),
])
def test_looks_transient(text, transient):
    assert looks_transient(RuntimeError(text)) is transient


@pytest.mark.parametrize("text,local", [
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB", True),
    ("INVALID_ARGUMENT: Executable expected parameter 0 of size 64", True),
    ("UNIMPLEMENTED: this collective is not implemented on CPU", True),
    ("UNKNOWN: mnemojax: workers [2] of world 0 died (told by the launcher)", False),
    ("INTERNAL: gloo: Connection closed by peer", False),
    ("INVALID_ARGUMENT: Gloo all-reduce failed: connection reset", False),
    ("UNAVAILABLE: RESOURCE_EXHAUSTED later in the text", False),
])
def test_looks_local(text, local):
    """A process's own error (out of memory, a bad argument) is never a peer failure
    under a session: it is raised, not recovered by re-planning the same mesh."""
    assert looks_local(RuntimeError(text)) is local


def test_host_batch_turns_leaves_into_numpy():
    got = host_batch({"x": jax.numpy.ones((1, 2)), "y": 3})
    assert isinstance(got["x"], np.ndarray) and got["x"].shape == (1, 2)
    assert isinstance(got["y"], np.ndarray) and got["y"] == 3

