"""`distributed.worker.session`: the worker's handle on the multi-process world."""

from __future__ import annotations

import contextlib
import threading
import time

import jax
import numpy as np
import pytest

from mnemojax._src.device_layer import JaxDeviceLayer
from mnemojax._src.distributed.agreement import Agreement
from mnemojax._src.distributed.env import WorldSpec
from mnemojax._src.distributed.snapshot_codec import ShardEntry, pack
from mnemojax._src.distributed.worker.recovery import WorldRecovery
from mnemojax._src.distributed.worker.session import DistributedSession
from mnemojax._src.errors import DistributedError
from tests.distributed.fakes import SECRET, held, local_copies, wait_until


def _session(agent: str) -> DistributedSession:
    """A one-process session whose agent is ``agent`` (no coordinator behind it)."""
    return DistributedSession(WorldSpec(coordinator="127.0.0.1:1", process_id=0,
                                        num_processes=1, agent=agent, secret=SECRET))


def test_a_background_publish_is_settled_before_the_next_and_its_error_raised_once(
        two_agents, caplog):
    """`publish(background=True)` copies on a thread: the next publish (or `settle`) waits
    for it, so the agent holds every step in order; an agent that cannot be reached is
    raised by the next `settle`, or only logged by a quiet one (a recovery's)."""
    import jax.numpy as jnp

    _, agents = two_agents
    session = _session(agents[0].address)
    assert session.agent is not None
    try:
        for step in (1, 2, 3):
            assert session.publish(step, [jnp.full((256,), step, jnp.float32)],
                                   budget_bytes=1 << 20, background=True)
        assert session.publish_idle(10.0)  # (what `wait_snapshots` waits for)
        session.settle()
        assert held(agents[0].address)[0] == {"0": [2, 3]}
        session.agent._sock.close()  # the agent's connection is gone
        for quiet in (False, True):
            assert session.publish(4, [jnp.ones((256,), jnp.float32)], background=True)
            if quiet:
                session.settle(quiet=True)
                assert "did not reach its agent" in caplog.text
            else:
                with pytest.raises(OSError):
                    session.settle()
            session.settle()  # raised (or logged) once
    finally:
        session.agent.close()


def test_a_held_copy_goes_to_the_agent_only_for_a_step_published_in_this_world(
        two_agents, monkeypatch):
    """`hold` hands the agent the replicas of the step it last published in this world
    (listed under `held_origin`); not for another step or world (a restored step is not
    published again in its new world), and not when they would not fit the budget beside
    the snapshots, which it finds before copying anything."""
    import dataclasses

    import jax.numpy as jnp

    from mnemojax._src.distributed.agreement import held_origin
    from mnemojax._src.distributed.worker import state_transfer

    replica = np.arange(1000, dtype=np.float32)

    def held_shards(leaves, *, max_bytes=None):  # one process has no replica of another's
        del leaves
        return None if max_bytes is not None and replica.nbytes > max_bytes else [
            ShardEntry(0, (2000,), ((1000, 2000),), replica)]

    monkeypatch.setattr(state_transfer, "held_shards", held_shards)
    _, agents = two_agents
    session = _session(agents[0].address)
    leaves = [jnp.ones((2000,), jnp.float32)]
    assert session.agent is not None
    try:
        assert session.publish(3, leaves, budget_bytes=1 << 20, background=True)
        assert session.hold(2, leaves) == 0  # not the step published
        assert session.hold(3, leaves, budget_bytes=6 * 8000) == 0  # beside ~6 x 8 KB
        assert held(agents[0].address)[0] == {"0": [3]}
        assert session.hold(3, leaves, budget_bytes=1 << 20) > replica.nbytes
        assert held(agents[0].address)[0] == {"0": [3], str(held_origin(0)): [3]}
        session.world = dataclasses.replace(session.world, generation=1)
        assert session.hold(3, leaves) == 0  # step 3 was published in world 0
    finally:
        session.agent.close()


@contextlib.contextmanager
def _slow_buddy(delay_s: float = 0.5):
    """A buddy that answers each replica after ``delay_s``: yields its address, the steps
    it has answered for, in order, and the replica messages received."""
    from mnemojax._src.distributed import transport, wire

    answered: list[int] = []
    received: list = []
    stop = threading.Event()

    def serve(conn):
        with conn:
            while True:
                try:
                    message, _ = transport.recv(conn)
                except (OSError, ConnectionError):
                    return
                received.append(message)
                time.sleep(delay_s)
                answered.append(message.step)
                transport.send(conn, wire.Ok())

    server, address = transport.listen()
    threading.Thread(target=transport.accept_loop, args=(server, serve),
                     kwargs={"secret": SECRET, "stop": stop}, daemon=True).start()
    try:
        yield address, answered, received
    finally:
        stop.set()
        transport.close_server(server)


def test_a_publish_waits_until_the_buddy_holds_the_last_snapshot(two_agents, caplog):
    """Publishing step N overwrites the slot of N - 2, so it first waits until the ring
    buddy holds N - 1 (a peer one step behind at a failure agrees on N - 1, which then
    only the buddy may have): with a buddy that takes 0.5 s per replica, each publish
    returns only after the buddy has answered for the one before. A buddy that cannot be
    reached does not block the publish: it is counted and said once."""
    import jax.numpy as jnp

    from mnemojax._src.distributed import wire

    fake, agents = two_agents
    session = _session(agents[0].address)
    assert session.agent is not None
    try:
        with _slow_buddy() as (address, answered, _):
            fake.command(0, wire.SetBuddy(buddy=address))
            wait_until(lambda: agents[0].replicator._buddy == address)
            for step in (1, 2, 3):
                assert session.publish(step, [jnp.full((256,), step, jnp.float32)],
                                       budget_bytes=1 << 20)
                # N - 1 was answered for before N was written (N may follow any time)
                assert answered[:step - 1] == list(range(1, step))
            assert session.replication_lags == 0
        fake.command(0, wire.SetBuddy(buddy="127.0.0.1:1"))  # nobody listens there
        wait_until(lambda: agents[0].replicator._buddy == "127.0.0.1:1")
        for step in (4, 5, 6):
            assert session.publish(step, [jnp.full((256,), step, jnp.float32)],
                                   budget_bytes=1 << 20)
        assert session.replication_lags >= 2
        assert caplog.text.count("has not reached its ring buddy") == 1
        assert held(agents[0].address)[0] == {"0": [5, 6]}
    finally:
        session.agent.close()


def test_a_publish_in_series_returns_once_the_buddy_holds_it(two_agents):
    """`SnapshotOptions.replicate_in_series`: publishing N returns only after the buddy
    has answered for N itself, so the next step starts after it (the default returns
    before: N's answer comes 0.5 s later). Not combinable with a background copy."""
    import jax.numpy as jnp

    from mnemojax._src.distributed import wire

    fake, agents = two_agents
    session = _session(agents[0].address)
    assert session.agent is not None
    leaves = [jnp.ones((256,), jnp.float32)]
    try:
        with _slow_buddy() as (address, answered, received):
            fake.command(0, wire.SetBuddy(buddy=address))
            wait_until(lambda: agents[0].replicator._buddy == address)
            assert session.publish(1, leaves, budget_bytes=1 << 20)
            assert answered == []  # the default: N's copy overlaps what follows
            waits = []
            await_replicated = session.agent.await_replicated
            session.agent.await_replicated = lambda t: waits.append(t) or await_replicated(t)
            for step in (2, 3):
                assert session.publish(step, leaves, budget_bytes=1 << 20, in_series=True)
                assert answered[-1] == step
            # Before and after 2's copy; only after 3's (its wait before would be a second
            # one between two progress signals: the agent's hang floor bounds one).
            assert len(waits) == 3
            assert session.replication_lags == 0
            # Only the copies published in series let the buddy make room for them first.
            assert [(m.step, m.make_room) for m in received] == [
                (1, False), (2, True), (3, True)]
            with pytest.raises(ValueError, match="background"):
                session.publish(4, leaves, in_series=True, background=True)
    finally:
        session.agent.close()


def test_after_a_wait_in_series_gave_up_the_buddy_makes_no_room_first(two_agents):
    """A buddy slower than the wait's bound (half the agent's 5 s hang floor): the wait
    after step 1's copy gives up, so step 2's copy no longer lets the buddy drop what it
    outdates before it arrives (the guarantee that made it safe is gone)."""
    import jax.numpy as jnp

    from mnemojax._src.distributed import wire

    fake, agents = two_agents
    session = _session(agents[0].address)
    assert session.agent is not None
    leaves = [jnp.ones((256,), jnp.float32)]
    try:
        with _slow_buddy(delay_s=3.0) as (address, _, received):
            fake.command(0, wire.SetBuddy(buddy=address))
            wait_until(lambda: agents[0].replicator._buddy == address)
            for step in (1, 2):
                assert session.publish(step, leaves, budget_bytes=1 << 20, in_series=True)
            assert session.replication_lags == 2  # each wait after a copy gave up
            wait_until(lambda: len(received) == 2, timeout=15)
            assert [(m.step, m.make_room) for m in received] == [(1, True), (2, False)]
    finally:
        session.agent.close()


def test_publish_over_the_host_memory_budget_stops_with_a_warning(two_agents):
    """The agent would hold ~5 x the payload at its peak (`shm.agent_peak_bytes`): over
    the budget the worker stops publishing, says so once, and writes nothing."""
    import jax.numpy as jnp

    from mnemojax.errors import SnapshotBudgetWarning

    _, agents = two_agents
    session = _session(agents[0].address)
    leaves = [jnp.ones((256,), jnp.float32)]  # 1 KiB of shards, plus metadata
    assert session.agent is not None
    try:
        assert session.publish(1, leaves, budget_bytes=1 << 20)
        with pytest.warns(SnapshotBudgetWarning, match="host_memory_budget_bytes=4000"):
            assert not session.publish(2, leaves, budget_bytes=4000)
        assert session.publish_refused
        assert not session.publish(3, leaves, budget_bytes=1 << 20)  # for good
        assert held(agents[0].address)[0] == {"0": [1]}
    finally:
        session.agent.close()


def test_restore_places_the_agreed_state_with_the_given_put():
    """The state goes through ``put`` (the device layer's), never around it."""
    import jax

    w = np.arange(8, dtype=np.float32)
    payload = bytearray(b"".join(bytes(p) for p in pack(
        4, 0, [ShardEntry(0, (8,), ((0, 4),), w[:4]), ShardEntry(0, (8,), ((4, 8),), w[4:])],
        num_leaves=1)))
    world = WorldSpec(coordinator="127.0.0.1:1", process_id=0, num_processes=1)
    agreement = Agreement(generation=1, worker_id=0, process_id=0, num_processes=1,
                          coordinator="127.0.0.1:1", resume_step=4, survivors=(0,),
                          previous_members=(0, 1), sources={0: ("127.0.0.1:2",)})
    rec = WorldRecovery(agreement, world, local_copies({0: payload}, 4), phases={})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    calls = []

    def put(value, s):
        calls.append((np.asarray(value), s))
        return JaxDeviceLayer().put(value, s)

    [leaf] = DistributedSession(world).restore(rec, [sharding], put=put)
    np.testing.assert_array_equal(np.asarray(leaf), w)
    [(value, placed_on)] = calls
    np.testing.assert_array_equal(value, w)
    assert placed_on is sharding


def test_a_session_without_a_launcher_cannot_recover():
    session = DistributedSession(WorldSpec(coordinator="127.0.0.1:1", process_id=0,
                                           num_processes=1))
    assert not session.can_recover
    with pytest.raises(DistributedError, match="no coordinator"):
        session.recover(last_step=3, reason="test")


def test_a_fresh_process_whose_copy_holders_died_leaves_the_job(monkeypatch):
    """A fresh process read the agreed copy's header when it joined; by its restore, every
    holder of the copy has died. It leaves the job (the launcher learns it, it detaches,
    `LeftJobExit`, status 0) instead of ending the job with `StateUnavailableError`."""
    import jax

    from mnemojax._src.distributed.worker import coordination
    from mnemojax._src.distributed.worker.recovery import AgreedCopies
    from mnemojax._src.errors import LeftJobExit, StateUnavailableError

    payload = bytearray(b"".join(bytes(p) for p in pack(
        4, 0, [ShardEntry(0, (8,), ((0, 8),), np.zeros(8, np.float32))], num_leaves=1)))
    world = WorldSpec(coordinator="127.0.0.1:1", process_id=1, num_processes=2,
                      worker_id=5, generation=1)
    agreement = Agreement(generation=1, worker_id=5, process_id=1, num_processes=2,
                          coordinator="127.0.0.1:1", resume_step=4, survivors=(0, 5),
                          previous_members=(0, 1), sources={1: ("agent-1",)}, replaces={5: 1})

    def dead_holders(addrs, origin, step, *, secret, boxes):  # as `fetch_snapshot` fails
        raise StateUnavailableError(f"no copy of worker {origin} step {step}: "
                                    f"[{addrs[0]}: connection refused]")

    copies = AgreedCopies(4, 0, {1: local_copies({1: payload}, 4).headers[1]},
                          {1: ("agent-1",)}, b"", fetch=dead_holders)
    calls = []

    class Coordinator:
        def leave(self, *, generation, reason):
            calls.append(("leave", generation, reason))

    monkeypatch.setattr(coordination, "detach_worker", lambda: calls.append(("detach",)))
    session = DistributedSession(world)
    session.coordinator = Coordinator()  # pyright: ignore[reportAttributeAccessIssue]
    session.resume = WorldRecovery(agreement, world, copies, phases={})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(LeftJobExit, match="could not be fetched") as info:
        session.take_resume([sharding], put=JaxDeviceLayer().put)
    assert info.value.code == 0 and info.value.step == 4
    assert [c[0] for c in calls] == ["detach", "leave"] and calls[1][1] == 1
    assert session.resume is None and session.left is info.value


@pytest.mark.parametrize(("error", "hinted"), [
    (jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Connection reset by peer"),
     True),
    (ValueError("bad eval batch"), False),
    (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory"), False),
])
def test_an_uncaught_error_a_lost_peer_explains_points_to_guard(monkeypatch, capsys, error,
                                                               hinted):
    """The uncaught-exception hook tells the launcher why the worker ends; a gloo
    collective's error outside the resilient step (an unguarded eval) names `guard`."""
    import sys
    import types

    from mnemojax._src.distributed.worker import session as session_mod

    reported = []
    coordinator = types.SimpleNamespace(
        report_failure=lambda generation, reason: reported.append((generation, reason)))
    fake = types.SimpleNamespace(coordinator=coordinator,
                                 world=types.SimpleNamespace(generation=2))
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: None)
    session_mod._report_uncaught_exceptions(fake)  # type: ignore[arg-type]
    sys.excepthook(type(error), error, None)
    [(generation, reason)] = reported
    assert generation == 2 and reason.startswith(session_mod.UNCAUGHT + type(error).__name__)
    assert ("step.guard(fn)" in reason) is hinted
    assert ("step.guard(fn)" in capsys.readouterr().err) is hinted
