"""`distributed.agent.replica_store`: the buddy copies an agent keeps."""

from __future__ import annotations

import pytest

from mnemojax._src.checksum import checksum
from mnemojax._src.distributed.agent.replica_store import ReplicaStore
from mnemojax._src.errors import SnapshotCorruptError


def test_replica_store_checks_crc_and_keeps_two_newest():
    store = ReplicaStore(keep=2)
    for step in (1, 2, 3):
        data = f"s{step}".encode()
        store.put(4, step, data, checksum(data))
    assert sorted((o, s) for o, s, _ in store.verify()[0]) == [(4, 2), (4, 3)]
    assert store.get(4, 3)[0] == b"s3"
    with pytest.raises(SnapshotCorruptError):
        store.put(4, 9, b"abc", 123)
    with pytest.raises(KeyError):
        store.get(5, 1)


def test_replica_store_verify_drops_a_copy_that_went_bad_after_the_put():
    store = ReplicaStore(keep=2)
    for step in (2, 3):
        data = f"s{step}".encode()
        store.put(4, step, data, checksum(data))
    _, crc = store.get(4, 3)
    store._by_origin[4][3] = (b"s4", crc, 0)  # a flipped bit in memory
    good, bad = store.verify()
    assert [(o, s) for o, s, _ in good] == [(4, 2)] and bad == [(4, 3)]
    with pytest.raises(KeyError):
        store.get(4, 3)  # never served again


def test_replica_store_refuses_a_flipped_bit_and_another_algorithms_checksum():
    """The buddy checks the worker's CRC32C: a copy with any bit flipped is refused, and so
    is a copy whose checksum was computed with zlib's CRC32 (the algorithms must agree)."""
    import zlib

    store = ReplicaStore(keep=2)
    data = bytes(range(256))
    with pytest.raises(SnapshotCorruptError, match="CRC32C"):
        store.put(4, 1, data, zlib.crc32(data))
    for byte in (0, 127, 255):
        bad = bytearray(data)
        bad[byte] ^= 0x04
        with pytest.raises(SnapshotCorruptError, match="CRC32C"):
            store.put(4, 1, bad, checksum(data))
    store.put(4, 1, data, checksum(data))
    assert store.get(4, 1) == (data, checksum(data))


def test_replica_store_keeps_the_received_frame_and_never_an_older_step():
    """A received payload is stored as it is (no second copy of a replica in the host's
    memory), what it outdates goes, and a step older than both held ones is not kept."""
    store = ReplicaStore(keep=2)
    frames = {step: bytearray(f"s{step}".encode()) for step in (5, 6, 7, 4)}
    for step, frame in frames.items():
        store.put(1, step, frame, checksum(frame))
    assert store.get(1, 7)[0] is frames[7] and store.get(1, 6)[0] is frames[6]
    assert sorted(s for _, s, _ in store.verify()[0]) == [6, 7]
    assert store.nbytes() == len(frames[6]) + len(frames[7])
    assert store.steps(1) == [6, 7] and store.steps(2) == []


def test_a_new_worlds_copies_outrank_the_old_worlds_later_steps():
    """After a recovery that resumes behind the held steps, the new world's replayed steps
    are the newest copies (kept), and the old world's later steps go; an old world's copy
    never replaces a new world's copy of the same step."""
    store = ReplicaStore(keep=2)

    def put(step, generation):
        data = f"s{step}g{generation}".encode()
        store.put(1, step, data, checksum(data), generation=generation)

    for step in (10, 11):
        put(step, 0)
    put(9, 1)  # the new world replays from step 9
    assert store.steps(1) == [9, 11]
    put(10, 1)
    assert store.steps(1) == [9, 10] and store.get(1, 10)[0] == b"s10g1"
    put(10, 0)  # a late copy of the old world
    assert store.get(1, 10)[0] == b"s10g1"


def test_making_room_drops_what_a_copy_in_series_outdates_before_it_arrives():
    """A copy that outranks every one held (by world, then step) from a worker in series:
    the oldest goes first, so the origin never has three copies at once; the same step of
    an older world (a replay of an abandoned one): that copy goes. A copy that does not
    outrank them (a resend of a step held, an older step, a new buddy's copy of a resumed
    step), or room to spare: nothing goes."""
    store = ReplicaStore(keep=2)

    def put(step, generation=0):
        data = f"s{step}g{generation}".encode()
        store.put(1, step, data, checksum(data), generation=generation)

    store.make_room(1, 1)  # nothing held yet
    put(1)
    store.make_room(1, 2)  # one held: room to spare
    assert store.steps(1) == [1]
    put(2)
    store.make_room(1, 0)  # older than every copy: received first, then ranked
    store.make_room(1, 2)  # a resend of a step held (its reply was lost): kept
    assert store.steps(1) == [1, 2]
    store.make_room(1, 3)
    assert store.steps(1) == [2]
    put(3)
    store.make_room(1, 3, generation=1)  # the new world replays step 3
    assert store.steps(1) == [2]
    put(3, generation=1)
    assert store.steps(1) == [2, 3] and store.get(1, 3)[0] == b"s3g1"
    store.make_room(2, 5)  # another origin's copies are not touched
    store.make_room(1, 4, generation=1)  # the oldest by (world, step): step 2 of world 0
    assert store.steps(1) == [3]


def test_making_room_after_a_resume_from_disk_drops_the_old_worlds_later_steps():
    """A new world resumed from the persistent tier at step 10 while the buddy held steps
    20 and 21 of the old world: its copies outrank those, so room is made for each and the
    host never holds three (the peak `agent_peak_bytes(in_series=True)` counts)."""
    store = ReplicaStore(keep=2)
    for step in (20, 21):
        data = f"s{step}".encode()
        store.put(1, step, data, checksum(data), generation=0)
    for step in (11, 12, 13):
        store.make_room(1, step, generation=1)
        assert len(store.steps(1)) == 1
        data = f"s{step}g1".encode()
        store.put(1, step, data, checksum(data), generation=1)
    assert store.steps(1) == [12, 13]


def _put(store: ReplicaStore, origin: int, step: int, generation: int, size: int = 10) -> None:
    data = bytes([step % 256]) * size
    store.put(origin, step, data, checksum(data), generation=generation)


def test_a_new_world_drops_copies_of_older_worlds_and_refuses_late_ones():
    """After a ring change the agent holds its former predecessor's copies (worker 0,
    dead) beside the new one's (worker 2); no later copy of worker 0 ever replaces them.
    A world formed from world 1's copies drops every copy of world 0, and a late send of
    world 0 (a replication still in flight) is not kept; world 1's copies stay, those of
    the resumed step included."""
    store = ReplicaStore(keep=2)
    for step in (7, 8):
        _put(store, 0, step, generation=0)
    _put(store, 2, 8, generation=0)
    _put(store, 2, 9, generation=1)
    assert store.forget_before(1) == 30
    assert (store.steps(0), store.steps(2)) == ([], [9])
    _put(store, 0, 9, generation=0)
    store.make_room(2, 10, generation=0)  # a copy below the floor makes no room either
    assert (store.steps(0), store.steps(2)) == ([], [9])
    assert store.forget_before(0) == 0 and store.floor == 1  # never lowered
    _put(store, 2, 10, generation=1)
    assert store.steps(2) == [9, 10]


def test_room_for_a_newer_worlds_copy_comes_from_former_predecessors_oldest_first():
    """Under the budget, a copy from world 2 may take the room of other origins' copies
    from older worlds, oldest (world, step) first; never of its own origin or of its own
    world, and nothing at all when they cannot make the room asked for."""
    store = ReplicaStore(keep=2)
    _put(store, 0, 5, generation=0)
    _put(store, 0, 6, generation=0)
    _put(store, 1, 9, generation=1)
    _put(store, 3, 9, generation=2)
    _put(store, 3, 3, generation=1)  # its own origin: not droppable for it
    assert store.evict_for(3, 10, 2, 41) == 0  # only 30 bytes are droppable: none dropped
    assert (store.steps(0), store.steps(1)) == ([5, 6], [9])
    assert store.evict_for(3, 10, 2, 15) == 20  # whole copies, oldest first
    assert (store.steps(0), store.steps(1), store.steps(3)) == ([], [9], [3, 9])
    assert store.evict_for(3, 10, 1, 5) == 0  # world 1's copy cannot take world 1's room
    _put(store, 3, 10, generation=2)
    assert store.evict_for(3, 8, 2, 5) == 0  # older than both held: `put` would drop it
    assert store.evict_for(3, 11, 2, 5) == 10 and store.steps(1) == []


def test_the_step_a_world_resumed_from_keeps_its_room_for_two_steps():
    """World 1 resumed from step 2 of world 0, whose copy of worker 0 (dead) only this
    agent holds. Until the new predecessor (worker 1) sends step 4, world 1 may hold no
    step whole and a second failure falls back to step 2: its copy takes no room for
    steps 3 (the other, step 1, may go). From step 4 on, the two steps kept per origin
    have replaced worker 1's own copy of step 2 too, and worker 0's may go."""
    store = ReplicaStore(keep=2)
    _put(store, 0, 1, generation=0)
    _put(store, 0, 2, generation=0)
    _put(store, 1, 2, generation=0)
    store.forget_before(0, resumed=2)
    assert store.agreed == (0, 2)
    assert store.evict_for(1, 3, 1, 20) == 0  # only step 1's 10 bytes may go: none does
    assert store.evict_for(1, 3, 1, 10) == 10 and store.steps(0) == [2]
    assert store.evict_for(1, 4, 1, 10) == 10 and store.steps(0) == []
    store.forget_before(1, resumed=-1)  # a later world from the persistent tier
    assert store.agreed is None and store.floor == 1
