"""`distributed.agent`: two agents (threads, no workers) replicate, serve and refuse copies."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agent.snapshots import SnapshotHolder
from mnemojax._src.distributed.snapshot_codec import ShardEntry, pack, read_meta, unpack
from mnemojax._src.distributed.worker.agent_client import AgentClient, fetch_snapshot
from mnemojax._src.errors import StateUnavailableError
from mnemojax.testing import corrupt_agent_copies
from tests.distributed.fakes import SECRET, closed_without_reply, held, running_agents, wait_until


def _only_shard(payload) -> np.ndarray:
    [entry] = unpack(payload)[1]
    return entry.data


def test_buddy_replication_and_serving(two_agents):
    fake, agents = two_agents
    fake.command(0, wire.SetBuddy(buddy=fake.addresses[1]))
    client = AgentClient(agents[0].address, secret=SECRET)
    w = np.arange(8, dtype=np.float32)
    try:
        for step in (1, 2, 3):
            client.publish(step, pack(step, 0, [ShardEntry(0, (8,), ((0, 8),), w + step)],
                                      num_leaves=1))
        wait_until(lambda: held(agents[1].address)[0].get("0", [])[-1:] == [3])
        data, addr = fetch_snapshot([agents[1].address], 0, 3, secret=SECRET)
        np.testing.assert_array_equal(_only_shard(data), w + 3)
        assert addr == agents[1].address
        # The worker's own agent serves both slots; a missing step is a typed error.
        assert held(agents[0].address) == ({"0": [2, 3]}, [])
        # The first one is dead.
        data, _ = fetch_snapshot(["127.0.0.1:1", agents[0].address], 0, 2, secret=SECRET)
        np.testing.assert_array_equal(_only_shard(data), w + 2)
        with pytest.raises(StateUnavailableError):
            fetch_snapshot([agents[1].address], 0, 9, secret=SECRET)
        assert [e.step for e in fake.events if isinstance(e, wire.Progress)] == [1, 2, 3]
        # A flipped bit in the shared memory: the agent no longer counts that copy, and
        # serving it fails its CRC, so a survivor takes the buddy's.
        buffer = agents[0].snapshots.buffer
        assert buffer is not None and corrupt_agent_copies(buffer.name, step=3) == [3]
        steps, corrupt = held(agents[0].address)
        assert steps == {"0": [2]} and [(c.origin, c.step) for c in corrupt] == [(0, 3)]
        data, addr = fetch_snapshot([agents[0].address, agents[1].address], 0, 3,
                                    secret=SECRET)
        assert addr == agents[1].address
        np.testing.assert_array_equal(_only_shard(data), w + 3)
    finally:
        client.close()


def test_a_replayed_step_and_a_new_buddy_each_get_the_newest_copy():
    """The replicator sends by publish, not by step number: a step a new world publishes
    again under the same number (it replays the failed step) replaces the buddy's copy
    of the old world, and a new buddy gets the newest copy at once, not at the next
    publish (both were one-step windows with a host lost and no copy of that step)."""
    w = np.arange(8, dtype=np.float32)

    def payload(step, value, generation):
        return pack(step, 0, [ShardEntry(0, (8,), ((0, 8),), w + value)], num_leaves=1,
                    generation=generation)

    def replica(address, step):
        data = fetch_snapshot([address], 0, step, secret=SECRET)[0]
        return read_meta(data)["generation"], _only_shard(data)

    with running_agents(3) as (fake, agents):
        fake.command(0, wire.SetBuddy(buddy=fake.addresses[1]))
        client = AgentClient(agents[0].address, secret=SECRET)
        try:
            for step in (4, 5):
                client.publish(step, payload(step, step, 0))
            wait_until(lambda: held(agents[1].address)[0].get("0", [])[-1:] == [5])
            client.publish(5, payload(5, 50, 1))  # world 1 replays step 5
            wait_until(lambda: replica(agents[1].address, 5)[0] == 1)
            np.testing.assert_array_equal(replica(agents[1].address, 5)[1], w + 50)
            assert held(agents[2].address)[0] == {}
            fake.command(0, wire.SetBuddy(buddy=fake.addresses[2]))  # no publish after
            wait_until(lambda: held(agents[2].address)[0] == {"0": [5]})
            generation, data = replica(agents[2].address, 5)
            assert generation == 1
            np.testing.assert_array_equal(data, w + 50)
        finally:
            client.close()


def _worker0_copy(step: int, generation: int) -> list:
    """Worker 0's snapshot of ``step`` in world ``generation`` (one leaf of 8)."""
    w = np.arange(8, dtype=np.float32)
    return pack(step, 0, [ShardEntry(0, (8,), ((0, 8),), w + step)], num_leaves=1,
                generation=generation)


def _steps_4_and_5_then_a_new_buddy(fake, client: AgentClient, *, resume_step: int) -> None:
    """Worker 0 publishes steps 4 and 5 (world 0); once both reached its agent, the
    launcher names agent 1 its buddy, with the step the new world resumed from."""
    for step in (4, 5):
        client.publish(step, _worker0_copy(step, 0))
    wait_until(lambda: [e.step for e in fake.events if isinstance(e, wire.Progress)]
               == [4, 5])
    fake.command(0, wire.SetBuddy(buddy=fake.addresses[1], resume_step=resume_step))


def test_a_new_buddy_after_a_rollback_gets_the_step_the_world_resumed_from(two_agents):
    """A worker ahead at a failure holds the step the new world resumed from (4) and the
    old world's abandoned next one (5, its newest). A new buddy gets 4 (the launcher
    names it in `wire.SetBuddy`), so a host lost before the first publish of the new world
    still has its copy of 4 at its buddy (it got only 5 before); the newest follows
    (harmless here; see the next test for why), and the new world's 5 replaces it."""
    payload, w = _worker0_copy, np.arange(8, dtype=np.float32)
    fake, agents = two_agents
    client = AgentClient(agents[0].address, secret=SECRET)
    try:
        _steps_4_and_5_then_a_new_buddy(fake, client, resume_step=4)
        wait_until(lambda: held(agents[1].address)[0] == {"0": [4, 5]})
        data = fetch_snapshot([agents[1].address], 0, 4, secret=SECRET)[0]
        np.testing.assert_array_equal(_only_shard(data), w + 4)
        client.publish(5, payload(5, 1))  # the new world replays step 5
        wait_until(lambda: read_meta(fetch_snapshot([agents[1].address], 0, 5,
                                                    secret=SECRET)[0])["generation"] == 1)
        assert held(agents[1].address)[0] == {"0": [4, 5]}
    finally:
        client.close()


def test_a_new_worlds_publish_before_the_new_buddy_still_leaves_it_the_resumed_step(
        two_agents):
    """The new world's first publish (step 5 again, world 1) may reach the agent before
    the launcher's `wire.SetBuddy`: the new buddy then gets the resumed step 4 and that
    publish (it keeps two), not only one of them."""
    payload = _worker0_copy
    fake, agents = two_agents
    client = AgentClient(agents[0].address, secret=SECRET)
    try:
        for step, generation in ((4, 0), (5, 0), (5, 1)):
            client.publish(step, payload(step, generation))
        wait_until(lambda: [e.step for e in fake.events if isinstance(e, wire.Progress)]
                   == [4, 5, 5])
        fake.command(0, wire.SetBuddy(buddy=fake.addresses[1], resume_step=4))
        wait_until(lambda: held(agents[1].address)[0] == {"0": [4, 5]})
        assert read_meta(fetch_snapshot([agents[1].address], 0, 5,
                                        secret=SECRET)[0])["generation"] == 1
    finally:
        client.close()


def test_a_new_buddy_after_a_restore_from_disk_gets_the_newest_copy_only(two_agents):
    """A world that resumed from the persistent tier (``resume_step`` -1, as the
    launchers pass the agreement's) names no step held here: the new buddy gets the newest
    copy, as after a failure with no rollback, and nothing is sent for step -1."""
    w = np.arange(8, dtype=np.float32)
    fake, agents = two_agents
    client = AgentClient(agents[0].address, secret=SECRET)
    try:
        _steps_4_and_5_then_a_new_buddy(fake, client, resume_step=-1)
        wait_until(lambda: held(agents[1].address)[0] == {"0": [5]})
        data = fetch_snapshot([agents[1].address], 0, 5, secret=SECRET)[0]
        np.testing.assert_array_equal(_only_shard(data), w + 5)
        time.sleep(0.3)  # no second copy follows
        assert held(agents[1].address)[0] == {"0": [5]}
        assert not any(isinstance(e, wire.ReplicaRefused) for e in fake.events)
    finally:
        client.close()


def test_a_copy_in_series_makes_room_at_the_buddy_before_its_payload_arrives(two_agents):
    """A worker that publishes in series marks its copies (`wire.Replica.make_room`): its
    buddy drops the oldest of its two copies as soon as the next one's header arrives,
    before the payload is read, so it never holds three. Sent straight from the slot."""
    import json
    import struct

    from mnemojax._src.checksum import checksum
    from mnemojax._src.distributed import transport

    fake, agents = two_agents
    fake.command(0, wire.SetBuddy(buddy=fake.addresses[1]))
    client = AgentClient(agents[0].address, secret=SECRET)
    sent: list[wire.Replica] = []
    real_send = transport.send

    def spy(sock, message, payload=b""):
        if isinstance(message, wire.Replica):
            sent.append(message)
        return real_send(sock, message, payload)

    try:
        transport.send = spy
        for step in (4, 5):
            client.publish(step, _worker0_copy(step, 0), in_series=True)
            assert client.await_replicated(5.0) is None
        assert held(agents[1].address)[0] == {"0": [4, 5]}
        assert [(m.step, m.make_room) for m in sent] == [(4, True), (5, True)]
        # Step 6's copy by hand: its header, then (later) its payload.
        data = b"".join(bytes(p) for p in _worker0_copy(6, 0))
        head = json.dumps(wire.Replica(origin=0, step=6, crc=checksum(data),
                                       make_room=True).to_wire()).encode()
        with transport.connect(fake.addresses[1], secret=SECRET) as sock:
            sock.sendall(struct.pack("!II", len(head), len(data)) + head)
            wait_until(lambda: agents[1].snapshots.replicas.steps(0) == [5])
            sock.sendall(data)
            assert isinstance(transport.recv(sock)[0], wire.Ok)
        assert agents[1].snapshots.replicas.steps(0) == [5, 6]
    finally:
        transport.send = real_send
        client.close()


def test_agent_refuses_replicas_over_its_hosts_budget(two_agents):
    """Agent 1 keeps worker 0's replicas only within its own worker's budget (its slots
    count too): over it the replica is refused and reported, never held."""
    fake, agents = two_agents
    fake.command(0, wire.SetBuddy(buddy=fake.addresses[1]))
    c0, c1 = AgentClient(agents[0].address, secret=SECRET), AgentClient(agents[1].address, secret=SECRET)
    try:
        def payload(step, worker, n):
            return pack(step, worker, [ShardEntry(0, (n,), ((0, n),), np.ones(n, np.uint8))],
                        num_leaves=1)

        c1.publish(1, payload(1, 1, 100), budget_bytes=20_000)  # agent 1's slots: ~9 KB
        c0.publish(1, payload(1, 0, 4000), budget_bytes=1 << 20)
        wait_until(lambda: held(agents[1].address)[0].get("0") == [1])
        c0.publish(2, payload(2, 0, 40_000), budget_bytes=1 << 20)
        wait_until(lambda: any(isinstance(e, wire.ReplicaRefused) for e in fake.events))
        assert held(agents[1].address)[0].get("0") == [1]  # step 2 was never held
        with pytest.raises(StateUnavailableError):
            fetch_snapshot([agents[1].address], 0, 2, secret=SECRET)
        # The worker's wait before its next publish hears that its buddy lacks step 2.
        detail = c0.await_replicated(5.0)
        assert detail is not None and "refused" in detail and "host_memory_budget" in detail
    finally:
        c0.close()
        c1.close()


def test_agent_answers_a_malformed_request_with_an_error(two_agents):
    from mnemojax._src.distributed import transport

    _, agents = two_agents
    with transport.connect(agents[0].address, secret=SECRET) as sock:
        transport.send_frame(sock, {"op": "get", "origin": 0, "step": "three"})
        reply, _ = transport.recv(sock)
    assert isinstance(reply, wire.ErrorReply) and "'step'" in reply.message


def test_an_unauthenticated_client_is_refused_and_reported(two_agents):
    """A forged `alloc` (it would wipe the buddy replicas) or `get` (it would read a
    snapshot) without the job secret: the connection is closed with no reply, the agent
    tells the launcher, and it goes on serving its own processes."""
    import socket

    from mnemojax._src.distributed import transport

    fake, agents = two_agents
    client = AgentClient(agents[0].address, secret=SECRET)
    try:
        client.publish(1, pack(1, 0, [ShardEntry(0, (4,), ((0, 4),), np.ones(4, np.float32))],
                               num_leaves=1))
        wait_until(lambda: held(agents[0].address)[0] == {"0": [1]})
        host, port = agents[0].address.rsplit(":", 1)
        for forged in (wire.Alloc(nbytes=1 << 20, budget_bytes=None), wire.Get(origin=0, step=1)):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                assert isinstance(transport.recv(sock)[0], wire.AuthChallenge)
                transport.send(sock, forged)
                assert closed_without_reply(sock)
        with pytest.raises(StateUnavailableError):  # a wrong secret is refused too
            fetch_snapshot([agents[0].address], 0, 1, secret=b"w" * 32)
        wait_until(lambda: len([e for e in fake.events
                                if isinstance(e, wire.RefusedConnection)]) == 3)
        assert all(e.worker_id == 0 for e in fake.events if isinstance(e, wire.RefusedConnection))
        assert held(agents[0].address)[0] == {"0": [1]}  # nothing was wiped
        data, _ = fetch_snapshot([agents[0].address], 0, 1, secret=SECRET)
        np.testing.assert_array_equal(_only_shard(data), np.ones(4, np.float32))
    finally:
        client.close()


def test_agent_serves_a_header_or_the_asked_regions_of_a_checked_copy(two_agents):
    """Over the wire: the header alone, or only the cells inside the asked boxes, each with
    a checksum of its own; a copy that fails its check is never cut (a fresh checksum
    would hide the flip), so the survivor takes the buddy's."""
    fake, agents = two_agents
    fake.command(0, wire.SetBuddy(buddy=fake.addresses[1]))
    client = AgentClient(agents[0].address, secret=SECRET)
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    try:
        client.publish(3, pack(3, 0, [ShardEntry(0, (8, 8), ((0, 8), (0, 8)), w)],
                               num_leaves=1))
        wait_until(lambda: held(agents[1].address)[0].get("0") == [3])
        head, _ = fetch_snapshot([agents[0].address], 0, 3, secret=SECRET, header_only=True)
        assert read_meta(head)["shards"][0]["index"] == [[0, 8], [0, 8]]
        assert len(head) < w.nbytes
        box = (0, ((2, 4), (0, 8)))
        part, addr = fetch_snapshot([agents[0].address], 0, 3, secret=SECRET, boxes=[box])
        [entry] = unpack(part)[1]
        assert addr == agents[0].address and entry.index == box[1]
        np.testing.assert_array_equal(entry.data, w[2:4])
        buffer = agents[0].snapshots.buffer
        assert buffer is not None and corrupt_agent_copies(buffer.name, step=3) == [3]
        part, addr = fetch_snapshot([agents[0].address, agents[1].address], 0, 3,
                                    secret=SECRET, boxes=[box])
        assert addr == agents[1].address
        np.testing.assert_array_equal(unpack(part)[1][0].data, w[2:4])
    finally:
        client.close()


def test_agent_never_cuts_a_replica_that_fails_its_check(two_agents):
    """A flipped bit in a buddy's replica (held in the agent's process memory): asked for
    its header or its regions, the agent refuses rather than cut it under a fresh
    checksum."""
    fake, agents = two_agents
    fake.command(0, wire.SetBuddy(buddy=fake.addresses[1]))
    client = AgentClient(agents[0].address, secret=SECRET)
    w = np.arange(16, dtype=np.float32)
    try:
        client.publish(2, pack(2, 0, [ShardEntry(0, (16,), ((0, 16),), w)], num_leaves=1))
        wait_until(lambda: held(agents[1].address)[0].get("0") == [2])
        store = agents[1].snapshots.replicas
        payload, crc = store.get(0, 2)
        flipped = bytearray(payload)
        flipped[-1] ^= 0x01
        with store._lock:
            store._by_origin[0][2] = (bytes(flipped), crc, 0)
        for kw in ({"header_only": True}, {"boxes": [(0, ((0, 4),))]}):
            with pytest.raises(StateUnavailableError, match="fails its check"):
                fetch_snapshot([agents[1].address], 0, 2, secret=SECRET, **kw)
    finally:
        client.close()


def test_a_budget_the_worker_publishes_under_is_one_the_buddy_keeps_replicas_under(
        two_agents):
    """The worker refuses to publish and the agent refuses a replica by the same peak
    (`shm.agent_peak_bytes`): at a budget just at that peak, equal shares publish and every
    replica is kept, so the buddy never holds stale copies while the worker publishes."""
    from mnemojax._src.distributed.shm import agent_peak_bytes

    fake, agents = two_agents
    for i in range(2):
        fake.command(i, wire.SetBuddy(buddy=fake.addresses[1 - i]))
    clients = [AgentClient(a.address, secret=SECRET) for a in agents]
    try:
        def payload(step, worker):
            return pack(step, worker, [ShardEntry(0, (4096,), ((0, 4096),),
                                                  np.full(4096, step, np.float32))],
                        num_leaves=1)

        nbytes = sum(len(memoryview(p).cast("B")) for p in payload(10, 0))
        budget = agent_peak_bytes(nbytes, nbytes)
        for step in (10, 11, 12):
            for w, c in enumerate(clients):
                c.publish(step, payload(step, w), budget_bytes=budget)
            wait_until(lambda s=step: all(
                held(a.address)[0].get(str(1 - i), [])[-1:] == [s]
                for i, a in enumerate(agents)))
        assert not [e for e in fake.events if isinstance(e, wire.ReplicaRefused)]
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("in_series", [False, True], ids=["default", "in-series"])
@pytest.mark.parametrize("slack", [0, -1])
def test_the_agents_replica_check_is_the_workers_peak(slack, in_series):
    """At a budget of exactly `agent_peak_bytes(n, n)` the agent keeps a third replica of
    n bytes (two held, one arriving; in series, one held after the room made for it);
    one byte less, it refuses the copy that would make that peak and says so once."""
    import os

    from mnemojax._src.checksum import checksum
    from mnemojax._src.distributed.agent.snapshots import SnapshotHolder
    from mnemojax._src.distributed.shm import SLOT_MARGIN, agent_peak_bytes

    frames = {step: bytearray(b"".join(bytes(p) for p in pack(
        step, 0, [ShardEntry(0, (10_000,), ((0, 10_000),), np.full(10_000, step, np.uint8))],
        num_leaves=1))) for step in (1, 2, 3)}
    n, events = len(frames[1]), []
    holder = SnapshotHolder(1, shm_prefix=f"mnjxtest{os.getpid()}_{slack + 1}_",
                            report=events.append)
    try:
        holder.allocate(n + SLOT_MARGIN, budget_bytes=agent_peak_bytes(
            n, n, in_series=in_series) + slack)
        replies = []
        for step, frame in frames.items():
            if in_series:  # what the agent's server does before the payload arrives
                holder.replicas.make_room(0, step)
            replies.append(holder.accept_replica(
                wire.Replica(origin=0, step=step, crc=checksum(frame),
                             make_room=in_series), frame))
        kept = [isinstance(r, wire.Ok) for r in replies]
        # One byte under it, the copy that would make the peak is refused: the third
        # (two held and one arriving), in series the second (one held and one arriving).
        assert kept == ([True] * 3 if slack == 0 else
                        [True, False, False] if in_series else [True, True, False])
        assert len([e for e in events if isinstance(e, wire.ReplicaRefused)]) == (slack < 0)
    finally:
        holder.close()


def test_a_bigger_segment_keeps_the_old_copies_until_the_first_publish_into_it(two_agents):
    """A snapshot that outgrows its slots (a smaller world's larger shares) gets a new
    segment: until the worker has published into it, the old segment's complete copies
    are still held and served, so there is no moment without one. Shares that shrink to
    less than half the slots (a world grown back) get smaller slots again."""
    _, agents = two_agents
    client = AgentClient(agents[0].address, secret=SECRET)
    small, big = np.arange(256, dtype=np.float32), np.arange(4096, dtype=np.float32)
    try:
        for step in (1, 2):
            client.publish(step, pack(step, 0, [ShardEntry(0, (256,), ((0, 256),), small)],
                                      num_leaves=1))
        old = agents[0].snapshots.buffer
        parts = pack(3, 0, [ShardEntry(0, (4096,), ((0, 4096),), big)], num_leaves=1)
        client._ensure_capacity(sum(len(memoryview(p).cast("B")) for p in parts), None)
        assert agents[0].snapshots.buffer is not old  # the new segment, nothing in it yet
        assert held(agents[0].address)[0] == {"0": [1, 2]}
        data, _ = fetch_snapshot([agents[0].address], 0, 2, secret=SECRET)
        np.testing.assert_array_equal(_only_shard(data), small)
        client.publish(3, parts)
        wait_until(lambda: held(agents[0].address)[0] == {"0": [3]})
        np.testing.assert_array_equal(
            _only_shard(fetch_snapshot([agents[0].address], 0, 3, secret=SECRET)[0]), big)
        with pytest.raises(StateUnavailableError):  # the old segment is gone
            fetch_snapshot([agents[0].address], 0, 2, secret=SECRET)
        # Smaller shares again (a world grown back): slots sized for them, not the big ones.
        large = agents[0].snapshots.buffer
        client.publish(4, pack(4, 0, [ShardEntry(0, (256,), ((0, 256),), small)],
                               num_leaves=1))
        assert agents[0].snapshots.buffer is not large
        assert agents[0].snapshots.buffer.slot_bytes < large.slot_bytes / 2
        wait_until(lambda: held(agents[0].address)[0] == {"0": [4]})
    finally:
        client.close()


def test_a_held_copy_is_served_until_the_next_publish_and_kept_within_the_budget(two_agents):
    """At a peer failure the worker hands its agent a held copy (`AgentClient.hold`): the
    agent lists it under `held_origin`, serves it (whole or by region) like any copy,
    never replicates it, and drops it at the worker's next publish. A held copy that would
    take the host over its budget is refused, with the reason."""
    from mnemojax._src.distributed.agreement import held_origin

    fake, agents = two_agents
    fake.command(0, wire.SetBuddy(buddy=fake.addresses[1]))
    client = AgentClient(agents[0].address, secret=SECRET)
    w = np.arange(8, dtype=np.float32)

    def payload(step, origin, n=8):
        return pack(step, origin, [ShardEntry(0, (n,), ((0, n),), np.arange(n, dtype=np.float32)
                                              + step)], num_leaves=1)

    try:
        client.publish(3, payload(3, 0), budget_bytes=40_000)
        assert client.hold(3, payload(3, held_origin(0)), timeout_s=10) is None
        wait_until(lambda: held(agents[1].address)[0].get("0") == [3])
        assert held(agents[0].address)[0] == {"0": [3], str(held_origin(0)): [3]}
        data, addr = fetch_snapshot([agents[0].address], held_origin(0), 3, secret=SECRET)
        np.testing.assert_array_equal(_only_shard(data), w + 3)
        assert held(agents[1].address)[0] == {"0": [3]}  # never replicated
        with pytest.raises(StateUnavailableError):  # only the held step
            fetch_snapshot([agents[0].address], held_origin(0), 2, secret=SECRET)
        client.publish(4, payload(4, 0), budget_bytes=40_000)
        wait_until(lambda: str(held_origin(0)) not in held(agents[0].address)[0])
        with pytest.raises(StateUnavailableError):
            fetch_snapshot([agents[0].address], held_origin(0), 3, secret=SECRET)
        # Slots of ~4 KB each plus ~40 KB held: over the budget of 40 KB, refused.
        refused = client.hold(4, payload(4, held_origin(0), n=10_000), timeout_s=10)
        assert refused is not None and "host_memory_budget_bytes=40000" in refused
        assert held(agents[0].address)[0] == {"0": [3, 4]}
    finally:
        client.close()


def test_an_agent_refuses_a_held_copy_that_fails_its_check():
    import os

    from mnemojax._src.distributed.agent.snapshots import SnapshotHolder

    frame = bytearray(b"".join(bytes(p) for p in pack(
        2, -1, [ShardEntry(0, (4,), ((0, 4),), np.ones(4, np.float32))], num_leaves=1)))
    holder = SnapshotHolder(0, shm_prefix=f"mnjxtest{os.getpid()}_h_", report=lambda e: None)
    try:
        reply = holder.accept_held(wire.Hold(step=2, crc=1), frame)
        assert isinstance(reply, wire.ErrorReply) and "fails its" in reply.message
        assert holder.held is None and holder.verified_copies().copies == ()
    finally:
        holder.close()


def _holder_with_step_1(tag: str):
    """An agent's holder (no agent around it) whose slots hold step 1."""
    import os

    holder = SnapshotHolder(0, shm_prefix=f"mnjxtest{os.getpid()}_{tag}_", report=lambda e: None)
    holder.allocate(1000, budget_bytes=None)
    old = holder.buffer
    assert old is not None
    old.publish(1, [b"x" * 900])
    return holder, old


def _replace_segment(holder) -> None:
    """A bigger segment replaces the current one and the worker publishes step 2 into
    it: the retired one is due to close."""
    holder.allocate(5000, budget_bytes=None)
    new = holder.buffer
    assert new is not None
    new.publish(2, [b"y" * 4000])
    holder.published()


def test_a_segment_a_send_reads_from_stays_mapped_until_the_send_is_done():
    """The replicator sends straight from a slot (`SnapshotHolder.lend`): when a bigger
    segment replaces that one and the worker publishes into it meanwhile, the old one is
    closed only once the view is back, and the copy read through it is intact."""
    import os

    from mnemojax._src.distributed.shm import SnapshotBuffer

    holder, old = _holder_with_step_1("lend")
    try:
        with holder.lend() as lent:
            assert (lent.step, bytes(lent.data)) == (1, b"x" * 900)
            _replace_segment(holder)  # its view is out: it stays
            assert bytes(lent.data[:3]) == b"xxx" and lent.intact()
            assert os.path.exists(f"/dev/shm/{old.name}")
        assert not os.path.exists(f"/dev/shm/{old.name}")  # closed on the way out
        with holder.lend() as lent:
            assert lent.step == 2
        with pytest.raises(FileNotFoundError):
            SnapshotBuffer.attach(old.name)
    finally:
        holder.close()


def test_a_segment_whose_view_outlived_its_loan_is_unlinked_and_closed_later():
    """A view cut from a lent slot that outlives the loan (a failed send's traceback can
    keep one): the segment cannot be unmapped yet, so its name goes at once and it is
    closed at the next loan's end, without an error in the replicator's thread."""
    import os

    holder, old = _holder_with_step_1("late")
    try:
        with holder.lend() as lent:
            leaked = lent.data.cast("B")  # what a pending traceback may hold
            _replace_segment(holder)
        assert not os.path.exists(f"/dev/shm/{old.name}")  # unlinked, still mapped
        assert bytes(leaked[:3]) == b"xxx"
        leaked.release()
        with holder.lend() as lent:
            assert lent.step == 2
        assert holder._closing == []  # closed at the end of that loan
    finally:
        holder.close()


def test_a_new_world_from_newer_copies_drops_a_former_predecessors_replicas(two_agents):
    """Agent 1 holds worker 0's copies of world 0. A world formed from world 0's copies
    keeps them (they are what its survivors restore); the next one, formed from world 1's,
    has the launcher tell agent 1 so (`wire.SetBuddy.keep_from`), and they go, though no
    later copy of worker 0 would ever have replaced them."""
    fake, agents = two_agents
    fake.command(0, wire.SetBuddy(buddy=fake.addresses[1]))
    client = AgentClient(agents[0].address, secret=SECRET)
    try:
        for step in (4, 5):
            client.publish(step, _worker0_copy(step, 0))
        wait_until(lambda: held(agents[1].address)[0].get("0", [])[-1:] == [5])
        kept = held(agents[1].address)[0]
        fake.command(1, wire.SetBuddy(buddy=None, resume_step=4, keep_from=0))
        time.sleep(0.2)
        assert held(agents[1].address)[0] == kept
        fake.command(1, wire.SetBuddy(buddy=None, resume_step=9, keep_from=1))
        wait_until(lambda: held(agents[1].address)[0] == {})
        assert agents[1].snapshots.replicas.floor == 1
    finally:
        client.close()


def test_over_the_budget_a_new_predecessors_copy_takes_a_former_ones_room():
    """At the budget the worker counts (`agent_peak_bytes`: two replicas held, one
    arriving), an agent holding its former predecessor's (worker 0) two copies of world 0
    keeps its new predecessor's (worker 2) copies of world 1 in their place; a copy of
    world 0 finds nothing it may drop and is refused, as before."""
    import os

    from mnemojax._src.checksum import checksum
    from mnemojax._src.distributed.shm import SLOT_MARGIN, agent_peak_bytes

    def frame(origin: int, step: int, generation: int) -> bytearray:
        return bytearray(b"".join(bytes(p) for p in pack(
            step, origin, [ShardEntry(0, (10_000,), ((0, 10_000),),
                                      np.full(10_000, step, np.uint8))],
            num_leaves=1, generation=generation)))

    def offer(origin: int, step: int, generation: int):
        f = frame(origin, step, generation)
        return holder.accept_replica(
            wire.Replica(origin=origin, step=step, crc=checksum(f)), f)

    n, events = len(frame(0, 1, 0)), []
    holder = SnapshotHolder(1, shm_prefix=f"mnjxtest{os.getpid()}_evict_",
                            report=events.append)
    try:
        holder.allocate(n + SLOT_MARGIN, budget_bytes=agent_peak_bytes(n, n))
        assert [isinstance(offer(0, s, 0), wire.Ok) for s in (1, 2)] == [True, True]
        assert isinstance(offer(2, 3, 1), wire.Ok)  # the peak: two held, one arriving
        assert (holder.replicas.steps(0), holder.replicas.steps(2)) == ([1, 2], [3])
        assert isinstance(offer(2, 4, 1), wire.Ok)  # room: worker 0's oldest went
        assert (holder.replicas.steps(0), holder.replicas.steps(2)) == ([2], [3, 4])
        assert isinstance(offer(2, 5, 1), wire.Ok)
        assert (holder.replicas.steps(0), holder.replicas.steps(2)) == ([], [4, 5])
        assert not events
        holder.replicas.put(0, 6, frame(0, 6, 0), checksum(frame(0, 6, 0)))
        holder.replicas.put(0, 7, frame(0, 7, 0), checksum(frame(0, 7, 0)))
        bad = frame(2, 6, 1)  # fails its check: it takes no one's room
        refused = holder.accept_replica(
            wire.Replica(origin=2, step=6, crc=checksum(bad) ^ 1), bad)
        assert isinstance(refused, wire.ErrorReply) and "CRC32C" in refused.message
        assert (holder.replicas.steps(0), holder.replicas.steps(2)) == ([6, 7], [4, 5])
        refused = offer(2, 6, 0)  # world 0, like worker 0's: nothing to drop for it
        assert isinstance(refused, wire.ErrorReply) and "host_memory_budget" in refused.message
        assert [type(e) for e in events] == [wire.ReplicaRefused]
    finally:
        holder.close()


def test_a_buddy_out_of_reach_is_told_once_until_replication_works_again(caplog):
    """An agent whose buddy's host is gone logged "replication to ... failed: Connection
    refused" every 0.2 s until the launcher declared it dead (23 lines in a user trial):
    the same failure to the same buddy is told once."""
    import socket
    import threading

    from mnemojax._src.distributed.agent.replication import Replicator

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"  # (closed: connections are refused)
    stop = threading.Event()
    replicator = Replicator(7, None, stop, secret=SECRET)  # type: ignore[arg-type]
    thread = threading.Thread(target=replicator.run, daemon=True)
    with caplog.at_level("DEBUG", logger="mnemojax"):
        thread.start()
        replicator.set_buddy(gone)
        for step in range(1, 6):
            replicator.published(step)
            time.sleep(0.3)
        stop.set()
        replicator.published(6)  # (wakes it to stop)
        thread.join(timeout=10)
    assert not thread.is_alive()
    failed = [r for r in caplog.records if "replication to" in r.getMessage()]
    assert len(failed) >= 3
    assert [r.levelname for r in failed].count("WARNING") == 1, [r.getMessage() for r in failed]
    assert "told once until it works again" in failed[0].getMessage()


def test_a_workers_stderr_reaches_the_agents_with_its_id_at_each_line(capfd, tmp_path):
    """Several workers share the launcher's terminal or log: each line a worker writes to
    its standard error (a warning, a traceback) says whose it is (trial 26: they did not),
    also after a carriage return (a progress bar redrawn); a partial line is passed on at
    once, not held back; its standard output is left alone; its last lines are out once
    `flush` returns."""
    import sys

    from mnemojax._src.distributed.agent.worker_process import WorkerProcess
    go = tmp_path / "go"
    code = ("import os, sys, time; sys.stderr.write('half'); sys.stderr.flush()\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
            "sys.stderr.write(' done\\nwarning: two\\n\\n10%\\r20%\\nlast'); "
            "print('plain output')")
    worker = WorkerProcess([sys.executable, "-c", code], 7)
    worker.spawn({})
    seen = []
    wait_until(lambda: seen.append(capfd.readouterr()) or "half" in seen[-1].err)
    assert worker.collect_exit() is None  # passed on while the worker still runs
    go.touch()
    wait_until(lambda: worker.collect_exit() is not None)
    worker.flush()
    seen.append(capfd.readouterr())
    assert "".join(s.out for s in seen) == "plain output\n"
    assert "".join(s.err for s in seen) == (
        "[worker 7] half done\n[worker 7] warning: two\n[worker 7] \n"
        "[worker 7] 10%\r[worker 7] 20%\n[worker 7] last")
