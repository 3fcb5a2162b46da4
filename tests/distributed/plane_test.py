"""The multi-node control plane: the pure view of the job's keys, and the etcd store and
arbiter against a real 3-member etcd cluster on loopback (skipped, saying why, without
etcd: `make etcd`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import pytest

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agreement import Agreement
from mnemojax._src.distributed.launcher.etcd_store import (
    EtcdRefusedError,
    EtcdStore,
    FencedOutError,
    LeaseKeeper,
    RendezvousError,
    parse_rdzv,
)
from mnemojax._src.distributed.launcher.options import LaunchOptions
from mnemojax._src.distributed.launcher.plane import EtcdArbiter, JobView, ring
from mnemojax._src.distributed.launcher.roster import AgentRoster
from mnemojax._src.distributed.launcher.services import ServiceHost
from mnemojax._src.errors import AgreementError, InvalidOptionError
from tests.etcd_cluster import CutOff, etcd_cluster


def test_ring_puts_each_buddy_on_another_node():
    order = ring(range(6), nproc=2)  # nodes {0,1}, {2,3}, {4,5}
    for i, w in enumerate(order):
        assert (order[(i + 1) % len(order)] // 2) != w // 2
    assert ring([0, 1], nproc=2) == [0, 1]  # one node: nothing else to choose


def _view(items, seen=(0, 1)):
    return JobView(items, nproc=2, seen_nodes=frozenset(seen))


def test_a_lost_node_kills_its_workers_that_had_not_exited_zero():
    items = {"world/0": {"members": [0, 1, 2, 3]}, "nodes/0": {}, "exit/3": 0}
    view = _view(items)
    assert view.live_nodes() == {0}
    assert view.dead() == {2}  # worker 3 had finished: not a death
    assert view.failed_members(0) == (2,)
    assert _view({**items, "world/1": {"members": [0, 1]}}).failed_members(0) == (2, 3)


def test_a_node_that_finished_is_not_lost():
    """A node ends its part (every worker of its ended) and says so before its lease goes:
    the others do not take it for lost (a user trial: "node 0, which ran the coordination
    service, is lost" after a clean end)."""
    items = {"world/0": {"members": [0, 1, 2, 3]}, "nodes/1": {}}
    assert _view(items).lost_nodes() == {0}
    assert _view({**items, "finished/0": {"exit_codes": {"0": 0, "1": 0}}}).lost_nodes() == set()


class _FlakyStore:
    """An `EtcdStore`'s lease calls, answering as told: ``reach`` False, no member
    answers; ``ttl``, what a keepalive says (-1: the lease expired)."""

    def __init__(self):
        self.reach, self.ttl, self.revoked = True, 2, []

    def grant(self, ttl_s):
        return 7

    def keepalive(self, lease, *, retry_s=None):
        if not self.reach:
            time.sleep(0.05)
            raise RendezvousError("no etcd member answered")
        return self.ttl

    def revoke(self, lease):
        self.revoked.append(lease)


def _keeper(store, outage_s):
    lost = threading.Event()
    return LeaseKeeper(store, 2, on_lost=lost.set, outage_s=outage_s), lost  # type: ignore[arg-type]


def test_a_lease_is_not_taken_for_lost_while_etcd_is_silent_within_the_outage_bound():
    """No member answering for longer than the TTL is not a lost lease (a leader elected
    after a whole-cluster outage renews every lease): the keeper goes on until etcd
    answers; once it answers that the lease expired (the node was cut off alone), it is
    lost at once, and not revoked (nothing left)."""
    store = _FlakyStore()
    keeper, lost = _keeper(store, outage_s=30)
    try:
        store.reach = False
        assert not lost.wait(3.5)  # well past the 2 s TTL
        store.reach = True
        assert not lost.wait(1.5)  # renewed
        store.reach = False
        time.sleep(1.0)
        store.reach, store.ttl = True, -1  # back, and the lease had ended meanwhile
        assert lost.wait(3)
        assert keeper.why.startswith("etcd says its lease ended")
    finally:
        keeper.close(revoke=True)
    assert store.revoked == []


def test_a_lease_is_lost_once_etcd_stays_silent_for_the_outage_bound():
    store = _FlakyStore()
    keeper, lost = _keeper(store, outage_s=3)
    try:
        store.reach = False
        t0 = time.monotonic()
        assert lost.wait(10)
        assert 3 <= time.monotonic() - t0 + 0.7 < 6  # (the last renewal came <= 0.7 s before)
        assert keeper.why.startswith("no etcd member answered for")
    finally:
        keeper.close(revoke=True)


def test_the_book_counts_arrivals_of_live_members_only():
    items = {"world/0": {"members": [0, 1, 2]}, "nodes/0": {}, "nodes/1": {},
             "arrive/0/0": {"last_step": 5, "first_replayable": None},
             "arrive/0/2": {"last_step": 4, "first_replayable": None}, "dead/2": {}}
    book = JobView(items, nproc=2, seen_nodes=frozenset({0, 1})).book(0)
    assert book.arrived == {0: 5} and book.dead == {2} and book.missing() == [1]


def _agreements(members, replaces):
    first = Agreement(generation=0, worker_id=members[0], process_id=0,
                      num_processes=len(members), coordinator="c", resume_step=1,
                      survivors=tuple(members), previous_members=(), sources={}, lost=(),
                      resume_generation=0, why="", replaces=replaces)
    return {str(members[0]): wire.AgreementReply(agreement=first).to_wire()}


def test_slots_follow_survivors_and_joiners_and_a_shrunk_world_may_grow_back():
    """World 0 = [0..3]; world 1: spare 4 took worker 0's rank; world 2: node 1 lost,
    [4, 1]. A rejoined node's spares 6, 7 (idle, with agents) can fill slots 2 and 3, so
    world 2 is due to grow back once it has formed; the ids used so far include the
    start's spares 4, 5."""
    items = {"world/0": {"members": [0, 1, 2, 3]},
             "world/1": {"members": [4, 1, 2, 3], "agreements": _agreements([4, 1, 2, 3],
                                                                             {4: 0})},
             "world/2": {"members": [4, 1], "agreements": _agreements([4, 1], {})},
             "nodes/0": {}, "nodes/1": {}, "dead/0": {}, "dead/2": {}, "dead/3": {},
             "agents/4": "a", "agents/1": "b", "agents/6": "c", "agents/7": "d",
             "spares/6": 1, "spares/7": 1, "home/6": 1, "home/7": 1, "home/4": 0,
             "rejoin/6": {"node": 1, "count": 2}}
    assert _view(items).regrow_due() is None  # world 2 has not formed yet
    items["outcome/2/mnemojax-compiled-2"] = []  # (its members passed the barrier)
    view = _view(items)
    assert view.slots() == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0}
    assert view.full_size() == 4 and view.joiners(2) == [6, 7]
    assert view.open_slots(2, [4, 1]) == [2, 3]  # smaller than world 0: its free slots
    assert view.open_slots(2, [4]) == [1, 2, 3]  # ... and a member that did not arrive
    assert view.open_slots(1, [4, 1, 3]) == [2]  # full size: the dead member's slot
    assert view.regrow_due() == 2 and not view.regrows(2)
    assert view.used_ids(range(4, 6)) == set(range(8))
    asked = _view({**items, "regrow/2": {"by_node": 0}})
    assert asked.regrow_due() is None and asked.regrows(2)  # asked once
    one = _view({k: v for k, v in items.items() if k not in ("spares/7", "agents/7")})
    assert one.regrow_due() is None  # one spare cannot fill two slots
    grown = _view({**items, "regrow/2": {}, "world/3": {
        "members": [4, 1, 6, 7], "agreements": _agreements([4, 1, 6, 7], {6: 2, 7: 3})}})
    assert grown.slots()[6] == 2 and grown.slots()[7] == 3
    assert grown.regrow_due() is None and not grown.regrows(2)


def test_joiners_are_placed_on_the_node_of_the_slot_they_fill():
    """World 1 = [0, 1] (node 1 lost): node 0 keeps spare 4 idle, rejoined node 1 waits
    with 6 and 7. Slots 2 and 3 were node 1's: its spares take them, not node 0's."""
    items = {"world/0": {"members": [0, 1, 2, 3]},
             "world/1": {"members": [0, 1], "agreements": _agreements([0, 1], {})},
             "nodes/0": {}, "nodes/1": {}, "dead/2": {}, "dead/3": {},
             "agents/0": "a", "agents/1": "b", "agents/4": "c", "agents/6": "d",
             "agents/7": "e", "spares/4": 0, "spares/6": 1, "spares/7": 1,
             "home/4": 0, "home/6": 1, "home/7": 1}
    view = _view(items)
    assert view.joiners(1) == [4, 6, 7]
    assert view.placed_joiners(1, [0, 1]) == [6, 7, 4]


def test_no_growth_while_a_member_started_fresh_in_a_smaller_world():
    """Node 0 (the coordination service's) was lost: node 1's workers 2, 3 were restarted
    into world 1 = [2, 3] (``fresh``): they know only a 2-process layout, so spares that
    could fill world 0's size are not taken (it would be a mesh they cannot rebuild)."""
    items = {"world/0": {"members": [0, 1, 2, 3]},
             "world/1": {"members": [2, 3], "fresh": [2, 3],
                         "agreements": _agreements([2, 3], {})},
             "nodes/0": {}, "nodes/1": {}, "dead/0": {}, "dead/1": {},
             "agents/2": "a", "agents/3": "b", "agents/4": "c", "agents/5": "d",
             "spares/4": 0, "spares/5": 0, "home/4": 0, "home/5": 0}
    view = _view(items)
    assert view.first_sizes(1) == {2: 2, 3: 2}
    assert view.joiners(1) == [] and view.regrow_due() is None


def test_after_growing_back_a_spare_replaces_a_dead_member_in_place():
    """World 2 grew back to [0, 1, 6, 7], every member at its world-0 rank: a later
    death is filled by an idle spare (no shrink, then regrow)."""
    items = {"world/0": {"members": [0, 1, 2, 3]},
             "world/1": {"members": [0, 1], "agreements": _agreements([0, 1], {})},
             "world/2": {"members": [0, 1, 6, 7], "fresh": [6, 7],
                         "agreements": _agreements([0, 1, 6, 7], {6: 2, 7: 3})},
             "nodes/0": {}, "nodes/1": {}, "dead/2": {}, "dead/3": {}, "dead/7": {},
             "agents/0": "a", "agents/1": "b", "agents/6": "c", "agents/8": "d",
             "spares/8": 1, "home/6": 1, "home/7": 1, "home/8": 1}
    view = _view(items)
    assert view.first_sizes(2) == {0: 4, 1: 4, 6: 4, 7: 4}
    assert view.joiners(2) == [8]


@pytest.mark.parametrize("url", ["etcd:/x", "http://h:1", "etcd://h", "etcd://h:1,:2",
                                 "etcd://h:99999"])
def test_bad_rdzv_urls_are_refused_by_name(url):
    with pytest.raises(InvalidOptionError, match="rdzv="):
        parse_rdzv(url)


def test_several_nodes_need_an_etcd_rendezvous():
    with pytest.raises(InvalidOptionError, match="nnodes=2 needs rdzv"):
        LaunchOptions(nproc=1, nnodes=2)
    with pytest.raises(InvalidOptionError, match="node_rank=2"):
        LaunchOptions(nproc=1, nnodes=2, node_rank=2, rdzv="etcd://h:1")
    o = LaunchOptions(nproc=3, nnodes=2, node_rank=1, rdzv="etcd://h:1")
    assert o.world_size == 6 and list(o.local_workers) == [3, 4, 5]
    with pytest.raises(InvalidOptionError, match="grow_back=True needs rdzv"):
        LaunchOptions(nproc=1, grow_back=True)
    rejoin = LaunchOptions(nproc=3, nnodes=2, node_rank=1, rdzv="etcd://h:1", spares=1,
                           grow_back=True, rejoin_first_id=10)
    assert list(rejoin.local_workers) == [] and list(rejoin.spare_ids) == [10, 11, 12, 13]


@pytest.fixture(scope="module")
def cluster():
    with etcd_cluster(3) as c:
        yield c


class TwoNodes:
    """Two nodes' arbiters over one job in ``cluster``, world 0 = workers 0..3 (2 each)."""

    def __init__(self, cluster, job: str, agree_timeout_s: float = 30):
        self.store = EtcdStore.from_url(cluster.url, job)
        self.store.put(self.store.key("world", 0), {"members": [0, 1, 2, 3],
                                                    "coordinator": "-", "host_node": 0})
        self.arbiters, self.hosts = [], []
        for rank in (0, 1):
            self.store.put(self.store.key("nodes", rank), {})
            roster, services = AgentRoster(secret=b"s" * 32), ServiceHost(heartbeat_s=10)
            self.arbiters.append(EtcdArbiter(self.store, node_rank=rank, nproc=2,
                                             agree_timeout_s=agree_timeout_s, roster=roster,
                                             services=services, record=lambda e: None,
                                             poll_s=0.02))
            self.hosts.append(services)
        for a in self.arbiters:
            a.start()

    def of(self, worker: int) -> EtcdArbiter:
        return self.arbiters[worker // 2]

    def together(self, call, workers, timeout_s: float = 60) -> dict:
        """``call(worker)`` from one thread per worker; worker -> result or exception
        (none for a call still running after ``timeout_s``)."""
        results: dict = {}

        def run(w):
            try:
                results[w] = call(w)
            except Exception as e:  # noqa: BLE001 - the test reports it
                results[w] = e

        threads = [threading.Thread(target=run, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return dict(results)

    def close(self):
        for a, s in zip(self.arbiters, self.hosts, strict=True):
            with a._roster.cv:
                a.close()
            a.join()
            s.stop_all()


@pytest.fixture
def nodes(cluster, request):
    two = TwoNodes(cluster, request.node.name.replace("[", "-").replace("]", ""))
    try:
        yield two
    finally:
        two.close()


def test_two_nodes_agree_once_on_the_next_world(nodes):
    """Worker 3 dies: survivors 0, 1 (node 0) and 2 (node 1) get the same world 1, decided
    once, with its coordination service on the deciding node; worker 3 is dead in it."""
    with nodes.arbiters[1]._roster.cv:
        nodes.arbiters[1].member_died(3)
    results = nodes.together(lambda w: nodes.of(w).agree(
        wire.Agree(worker_id=w, generation=0, last_step=7)), (0, 1, 2))
    decided = [results[w] for w in (0, 1, 2)]
    assert all(isinstance(a, Agreement) for a in decided), decided
    assert {a.survivors for a in decided} == {(0, 1, 2)}
    assert [a.process_id for a in decided] == [0, 1, 2]
    world1 = nodes.store.get(nodes.store.key("world", 1))
    assert world1["members"] == [0, 1, 2]
    assert {a.coordinator for a in decided} == {world1["coordinator"]}
    # The node that lost the transaction stopped the service it had started.
    assert sum(1 for s in nodes.hosts if s._services) == 1
    with pytest.raises(AgreementError, match="not a member of world 0"):
        nodes.arbiters[0].agree(wire.Agree(worker_id=0, generation=0, last_step=7))


def test_a_barrier_has_one_outcome_on_every_node(nodes):
    passed = nodes.together(lambda w: nodes.of(w).barrier(
        wire.Barrier(worker_id=w, generation=0, name="c", timeout_s=30)), (0, 1, 2, 3))
    assert {r.failed for r in passed.values()} == {()}
    with nodes.arbiters[1]._roster.cv:
        nodes.arbiters[1].member_died(3)  # dead before it arrives: failed for all
    failed = nodes.together(lambda w: nodes.of(w).barrier(
        wire.Barrier(worker_id=w, generation=0, name="d", timeout_s=30)), (0, 1, 2))
    assert {r.failed for r in failed.values()} == {(3,)}


def test_the_end_on_one_node_stops_every_agreement(nodes):
    with nodes.arbiters[1]._roster.cv:
        nodes.arbiters[1].end("the job is ending: worker 3 exited with status 1", code=1,
                              worker_id=3)
    with pytest.raises(AgreementError, match="worker 3 exited with status 1"):
        nodes.arbiters[0].agree(wire.Agree(worker_id=0, generation=0, last_step=1))
    assert nodes.store.get(nodes.store.key("end"))["code"] == 1
    assert nodes.store.get(nodes.store.key("world", 1)) is None


def test_a_lost_node_is_told_to_the_other_nodes_watch(nodes):
    """Node 1's lease is gone (its key deleted, as at expiry): a watch on node 0 returns
    node 1's workers as failed, and they are dead in node 0's view."""
    results: dict = {}
    watcher = threading.Thread(target=lambda: results.update(w=nodes.arbiters[0].watch(
        wire.WatchWorld(worker_id=0, generation=0, timeout_s=30))))
    watcher.start()
    nodes.store.delete(nodes.store.key("nodes", 1))
    watcher.join(timeout=30)
    assert results["w"].failed == (2, 3)
    assert nodes.arbiters[0].live_members() == [0, 1]


def test_a_regrow_asked_on_one_node_is_told_to_the_other_nodes_watch(nodes):
    """Node 0 asks world 0 to re-form larger (`JobView.regrow_due`): a watch on node 1
    returns no dead member, but ``regrow``; asking again changes nothing."""
    results: dict = {}
    watcher = threading.Thread(target=lambda: results.update(w=nodes.arbiters[1].watch(
        wire.WatchWorld(worker_id=2, generation=0, timeout_s=30))))
    watcher.start()
    for _ in range(2):
        with nodes.arbiters[0]._roster.cv:
            nodes.arbiters[0].request_regrow(0)
    watcher.join(timeout=30)
    assert results["w"].failed == () and results["w"].regrow
    assert nodes.store.get(nodes.store.key("regrow", 0)) == {"by_node": 0}


def test_a_regrows_agreement_waits_past_its_deadline_for_a_member_between_steps(cluster):
    """World 0 re-forms larger and nobody died: a member still in its own code between
    steps when the deadline passes is waited for, not evicted (it was killed, as on one
    machine before: a trial), and every member is in the next world."""
    two = TwoNodes(cluster, "regrow-waits", agree_timeout_s=1.0)
    try:
        with two.arbiters[0]._roster.cv:
            two.arbiters[0].request_regrow(0)

        def agree(w):
            if w == 3:
                time.sleep(3.0)  # (three deadlines of the others)
            return two.of(w).agree(wire.Agree(worker_id=w, generation=0, last_step=7))
        results = two.together(agree, (0, 1, 2, 3))
        assert all(isinstance(results[w], Agreement) for w in range(4)), results
        assert {results[w].survivors for w in range(4)} == {(0, 1, 2, 3)}
        assert two.store.get(two.store.key("dead", 3)) is None
    finally:
        two.close()


def test_a_member_done_with_its_loop_is_out_of_an_agreement_at_once(nodes):
    """Worker 3 exited 0 (its loop is done) while the others go to an agreement: it never
    comes, so they decide without it at once, not after evicting it at the deadline
    (30 s here); it is not said dead by the other node."""
    with nodes.arbiters[1]._roster.cv:
        nodes.arbiters[1].publish_exit(3, 0)
    results = nodes.together(lambda w: nodes.of(w).agree(
        wire.Agree(worker_id=w, generation=0, last_step=7)), (0, 1, 2), timeout_s=15)
    assert all(isinstance(results.get(w), Agreement) for w in (0, 1, 2)), results
    assert {results[w].survivors for w in (0, 1, 2)} == {(0, 1, 2)}
    assert nodes.store.get(nodes.store.key("dead", 3))["why"] == "not in world 1"


def test_an_ambiguous_create_is_read_back(cluster):
    """A transaction that committed, then was retried (a timeout), reads as this call's."""
    store = EtcdStore.from_url(cluster.url, "ambiguous-test")
    key, value = store.key("world", 1), {"nonce": "abc"}
    assert store.create(key, value)
    assert store.create(key, value)  # the retry of our own commit
    assert not store.create(key, {"nonce": "other"})


def test_a_node_cut_off_from_etcd_evicts_no_one_and_writes_nothing_once_back(cluster):
    """Node 1 reaches etcd through a way of its own, cut while worker 2 waits in its
    agreement; its lease ends and node 0 decides world 1 without it. Node 1's mirror is
    stale meanwhile: it evicts none of the workers it cannot see arrive (a review: its
    ``dead/0``, ``dead/1`` landed once it was back, and node 0 killed its own healthy
    workers). Back, worker 2 learns it is out. A launcher of the same rank registered
    since (``--grow-back``): the old one's `stopping` and `end` are refused by the fence
    (its own lease), not only by the key's absence."""
    job = "cut-off-node"
    with contextlib.closing(CutOff(cluster)) as way:
        s0, s1 = EtcdStore.from_url(cluster.url, job), EtcdStore.from_url(way.url, job)
        s0.put(s0.key("world", 0), {"members": [0, 1, 2, 3], "coordinator": "-",
                                    "host_node": 0})
        s0.put(s0.key("nodes", 0), {})
        keeper = LeaseKeeper(s1, 2, outage_s=120)  # (renewed through the way until cut)
        s1.put(s1.key("nodes", 1), {}, lease=keeper.lease)
        s1.fence(s1.key("nodes", 1), keeper.lease)
        arbiters = [EtcdArbiter(store, node_rank=rank, nproc=2, agree_timeout_s=2,
                                roster=AgentRoster(secret=b"s" * 32),
                                services=ServiceHost(heartbeat_s=10), record=lambda e: None,
                                poll_s=0.02) for rank, store in ((0, s0), (1, s1))]
        for a in arbiters:
            a.start()
        try:
            got: dict = {}

            def agree(w):
                try:
                    got[w] = arbiters[w // 2].agree(wire.Agree(worker_id=w, generation=0,
                                                               last_step=7))
                except AgreementError as e:
                    got[w] = e
            waiting = threading.Thread(target=agree, args=(2,))
            waiting.start()
            deadline = time.monotonic() + 30
            while s0.get(s0.key("arrive", 0, 2)) is None:
                assert time.monotonic() < deadline, "worker 2's arrival was not written"
                time.sleep(0.05)
            way.cut()
            deadline = time.monotonic() + 30
            while s0.get(s0.key("nodes", 1)) is not None:  # node 1's lease (2 s) ends
                assert time.monotonic() < deadline, "node 1's lease did not end"
                time.sleep(0.1)
            others = [threading.Thread(target=agree, args=(w,)) for w in (0, 1)]
            for t in others:
                t.start()
            for t in others:
                t.join(60)
            assert s0.get(s0.key("world", 1))["members"] == [0, 1]
            time.sleep(3)  # past node 1's agreement timeout (2 s), its mirror stale
            assert not arbiters[1]._local_dead  # (evicted no one it could not see)
            way.mend()
            waiting.join(60)
            assert isinstance(got[2], AgreementError), got
            arbiters[1]._writes.submit(lambda: None).result(timeout=30)
            assert s0.get(s0.key("dead", 0)) is None and s0.get(s0.key("dead", 1)) is None
            assert arbiters[0].refresh().failed_members(1) == ()
            # A launcher of rank 1 registered again, under its own lease:
            s0.put(s0.key("nodes", 1), {"again": True}, lease=s0.grant(30))
            with arbiters[1]._roster.cv:
                arbiters[1].stopping("a stop told to the cut-off node", signal=15)
                arbiters[1].end("the job is ending: a worker of the cut-off node failed",
                                code=1)
            arbiters[1]._writes.submit(lambda: None).result(timeout=30)
            assert s0.get(s0.key("end")) is None and s0.get(s0.key("stopping")) is None
            with pytest.raises(FencedOutError, match="held under another lease"):
                s1.put(s1.key("progress", 1), {"steps": {}})
        finally:
            keeper.close(revoke=False)
            for a in arbiters:
                with a._roster.cv:
                    a.close()
                a.join()


def test_a_write_made_while_etcd_does_not_answer_lands_once_it_does(cluster):
    """A stop told to a node while no etcd member answers (node 1's way cut for longer
    than one call's retries) is written once etcd answers, within ``outage_s`` (trial 41:
    it was lost after one call's 15 s, and the other node trained on), also when the
    launcher closes its plane meanwhile (it stops its workers and exits: review 28 found
    the stop given up at the close)."""
    job = "write-through-outage"
    with contextlib.closing(CutOff(cluster)) as way:
        store = EtcdStore.from_url(way.url, job, retry_s=0.5)
        arbiter = EtcdArbiter(store, node_rank=1, nproc=2, agree_timeout_s=5,
                              roster=AgentRoster(secret=b"s" * 32),
                              services=ServiceHost(heartbeat_s=10), record=lambda e: None,
                              poll_s=0.05, outage_s=30)
        arbiter.start()
        try:
            way.cut()
            with arbiter._roster.cv:
                arbiter.stopping("a stop told during an outage", signal=15)
            time.sleep(2)  # four calls' retries
            assert arbiter.stale()
            with arbiter._roster.cv:
                arbiter.close()
            time.sleep(1)
            way.mend()
            arbiter.join()
            direct = EtcdStore.from_url(cluster.url, job)
            assert direct.get(direct.key("stopping"))["signal"] == 15
        finally:
            with arbiter._roster.cv:
                arbiter.close()
            arbiter.join()


def test_a_call_etcd_refuses_is_not_tried_again(cluster):
    """etcd's refusal of the call itself (a lease it does not know) raises at once:
    trying again, here or on another member, would answer the same (it was retried for
    the store's 15 s, and through an outage's bound since session 26: review 28)."""
    store = EtcdStore.from_url(cluster.url, "refused-call", retry_s=15)
    t0 = time.monotonic()
    with pytest.raises(EtcdRefusedError, match="lease not found"):
        store.revoke(123456789)
    assert time.monotonic() - t0 < 5


def test_store_survives_a_member_loss(cluster):
    """Last in this module: it kills a member of the module's cluster."""
    store = EtcdStore.from_url(cluster.url, "store-test", retry_s=10)
    key = store.key("world", 1)
    assert store.create(key, {"by": "a"}) and not store.create(key, {"by": "b"})
    assert not store.create(store.key("world", 2), 1, unless=[key])
    keeper = LeaseKeeper(store, 2)
    try:
        store.put(store.key("nodes", 0), "alive", lease=keeper.lease)
        cluster.kill(0)  # the member every call tried first
        assert store.items()["nodes/0"] == "alive"
        store.put(store.key("x"), [1, 2])
        assert store.get(store.key("x")) == [1, 2]
    finally:
        keeper.close(revoke=True)
    assert "nodes/0" not in store.items()


def test_a_member_gone_to_the_agreement_is_told_to_the_other_nodes_watch(nodes):
    """Worker 0 saw world 0 fail where no death is known (the holders of a copy it needed
    died) and arrived at the next agreement: a watch on node 1 returns no dead member, but
    worker 0 as ``left``, so worker 2 recovers too instead of waiting in a collective."""
    results: dict = {}
    watcher = threading.Thread(target=lambda: results.update(w=nodes.arbiters[1].watch(
        wire.WatchWorld(worker_id=2, generation=0, timeout_s=30))))
    watcher.start()
    time.sleep(0.2)
    assert "w" not in results  # a quiet world: the poll waits
    with nodes.arbiters[0]._roster.cv:
        nodes.arbiters[0].arrive_for(0, 0)
    watcher.join(timeout=30)
    assert results["w"] == wire.WorldFailed(generation=0, failed=(), left=(0,))


def test_a_member_gone_to_the_agreement_fails_the_barrier_on_every_node(nodes):
    """Worker 0 arrived at the next agreement (it saw world 0 fail): the others' barrier
    fails naming it, on both nodes, instead of waiting to evict it."""
    with nodes.arbiters[0]._roster.cv:
        nodes.arbiters[0].arrive_for(0, 0)
    failed = nodes.together(lambda w: nodes.of(w).barrier(
        wire.Barrier(worker_id=w, generation=0, name="c", timeout_s=30)), (1, 2, 3))
    assert {r.failed for r in failed.values()} == {(0,)}, failed
    assert 0 not in nodes.arbiters[1].view.dead()  # not evicted: it is at the agreement


def test_a_worker_that_left_is_out_of_the_agreement_but_not_reported_dead():
    """A worker that left the job (no device for it in the new world) is out of the next
    agreement as a dead member is, but `mnemojax status` and the nodes' logs said "dead" (a
    user trial): ``left/`` tells them apart."""
    from mnemojax._src.distributed.launcher import status
    items = {"world/0": {"members": [0, 1, 2, 3]}, "nodes/0": {"nproc": 2},
             "nodes/1": {"nproc": 2}, "dead/3": {"by_node": 1}, "dead/2": {"by_node": 1},
             "left/2": {"by_node": 1}}
    view = _view(items)
    assert view.dead() == {2, 3} and view.left() == {2}
    s = status.summary_of(items)
    assert s["dead"] == [3] and s["left"] == [2] and s["dead_why"] == {}
    # An eviction says why (trial 49: a spare evicted as silent showed only exit -9).
    why = "evicted: taken into world 1, it did not say it has its agreement within 10 s"
    s = status.summary_of({**items, "dead/3": {"by_node": 1, "why": why}})
    assert s["dead"] == [3] and s["dead_why"] == {3: why}


def test_status_tells_a_finished_job_and_no_job_from_one_still_starting():
    """A user trial: `mnemojax status` said "no world formed yet" (status 0) for a mistyped
    job name, and gave no end for a job that had finished."""
    from mnemojax._src.distributed.launcher import status
    assert status.summary_of({})["empty"]  # nothing under the name: no such job
    starting = status.summary_of({"nodes/0": {"nproc": 2}})
    assert not starting["empty"] and starting["generation"] < 0
    running = {"world/0": {"members": [0, 1]}, "nodes/0": {"nproc": 2}, "exit/0": 0}
    assert not status.summary_of(running)["finished"]
    assert status.summary_of({**running, "exit/1": 0})["finished"]
    assert not status.summary_of({**running, "exit/1": 1})["finished"]
    stopped = {**running, "exit/1": 0, "end": {"why": "the launcher was signalled (15)"}}
    assert not status.summary_of(stopped)["finished"]  # stopped, not finished
    # A stop told (workers that checkpointed and exited 0, no end written): stopped too
    # (trial 41: "finished: every worker exited 0" after a SIGTERM at step 11 of 90).
    told = status.summary_of({**running, "exit/1": 0,
                              "stopping": {"signal": 15, "node": 1, "why": "SIGTERM"}})
    assert not told["finished"] and told["stopping"]["signal"] == 15


def test_status_shows_the_newest_step_of_every_member_and_where_each_world_resumed():
    """Trial 26: `mnemojax status` showed no step. Each node writes its workers' newest
    published steps (``progress/<rank>``); the job's step is the newest that every member
    of the current world has published (a dead worker's stale step does not count), and
    each world after the first says the step its members resumed from."""
    from mnemojax._src.distributed.agreement import Agreement
    from mnemojax._src.distributed.launcher import status
    reply = wire.AgreementReply(agreement=Agreement(
        generation=1, worker_id=0, process_id=0, num_processes=2, coordinator="h:1",
        resume_step=6, survivors=(0, 1), previous_members=(0, 1, 2), sources={}))
    items = {"world/0": {"members": [0, 1, 2]}, "nodes/0": {"nproc": 2},
             "world/1": {"members": [0, 1], "agreements": {"0": reply.to_wire()}},
             "dead/2": {"by_node": 1},
             "progress/0": {"steps": {"0": 9, "1": 8}, "t": time.time() - 3},
             "progress/1": {"steps": {"2": 7}, "t": time.time() - 30}}
    s = status.summary_of(items)
    assert s["steps"] == {0: 9, 1: 8, 2: 7} and s["step"] == 8
    assert s["resumed_from"] == {0: None, 1: 6}
    assert 2 <= s["progress_age_s"] < 10  # the newest record's age
    assert status.summary_of({**items, "progress/0": {"steps": {"0": 9}, "t": 0}})[
        "step"] is None  # worker 1 has not published: no step is every member's
    # `--max-restarts`: which fresh id restarted which worker (a trial: not shown); a node
    # that rejoined (`--grow-back`) claimed its ids restarting no one.
    claims = {"rejoin/4": {"node": 1, "count": 1, "restarts": 2},
              "rejoin/5": {"node": 0, "count": 4}}
    assert status.summary_of({**items, **claims})["restarts"] == {4: 2}


def test_a_member_that_left_is_seen_as_left_by_both_nodes_at_once_with_its_death(nodes):
    """`EtcdArbiter.member_left`: out of the agreement as a dead member is; its own node's
    view has it as left as soon as dead (no window in which its node would log a death),
    and the other node reads ``left/`` with ``dead/``."""
    with nodes.arbiters[1]._roster.cv:
        nodes.arbiters[1].member_left(3)
        view = nodes.arbiters[1].view
        assert 3 in view.dead() and 3 in view.left()
    deadline = time.monotonic() + 10
    while 3 not in nodes.arbiters[0].view.dead() and time.monotonic() < deadline:
        time.sleep(0.02)
    other = nodes.arbiters[0].view
    assert 3 in other.dead() and 3 in other.left()
    results = nodes.together(lambda w: nodes.of(w).agree(
        wire.Agree(worker_id=w, generation=0, last_step=7)), (0, 1, 2))
    assert {results[w].survivors for w in (0, 1, 2)} == {(0, 1, 2)}


def test_mnemojax_status_of_a_job_name_with_nothing_under_it_fails_saying_so(cluster,
                                                                               capsys):
    """A mistyped ``--rdzv-id`` said "no world formed yet" with status 0 (a user trial)."""
    from mnemojax._src.cli import main
    assert main(["status", "--rdzv", cluster.url, "--rdzv-id", "no-such-job"]) == 1
    assert "no job 'no-such-job' in etcd" in capsys.readouterr().err


def _node(store, lease: int, job: str):
    """What `NodeLauncher._register` reads of its launcher."""
    import types
    options = types.SimpleNamespace(node_rank=0, nnodes=2, node_ttl_s=2, rdzv_id=job)
    return types.SimpleNamespace(options=options, store=store,
                                 _lease=types.SimpleNamespace(lease=lease))


def test_a_node_rank_another_live_launcher_holds_is_refused_naming_it(cluster):
    """Two launchers given the same --node-rank overwrote each other's entry and both
    waited 120 s for the other node (a user trial); the second is refused once the
    first's lease outlives the node lease, and a rank whose holder died is free again."""
    from mnemojax._src.distributed.launcher.node import NodeLauncher
    from mnemojax._src.errors import WorldConfigError

    store = EtcdStore.from_url(cluster.url, "taken-rank")
    first = store.grant(30)
    NodeLauncher._register(_node(store, first, "taken-rank"), {"pid": 111, "control": "127.0.0.1:1"})
    t0 = time.monotonic()
    with pytest.raises(WorldConfigError, match=r"node rank 0 is taken: another launcher of "
                                               r"job 'taken-rank' holds it \(pid 111"):
        NodeLauncher._register(_node(store, store.grant(30), "taken-rank"), {"pid": 222})
    assert time.monotonic() - t0 >= 2  # (a restarted host's old entry may still end)
    store.revoke(first)  # (its launcher died: its lease ends)
    NodeLauncher._register(_node(store, store.grant(30), "taken-rank"), {"pid": 333})
    assert store.get(store.key("nodes", 0))["pid"] == 333


def test_a_node_waiting_for_others_says_which_and_what_to_check(monkeypatch, caplog):
    """A node that never registers gave 120 s of silence, then "waited 120 s for all 2
    nodes to register" (a user trial): the wait is told, naming the missing ranks, and
    the error says what to check."""
    import types

    from mnemojax._src.distributed.launcher import node
    from mnemojax._src.errors import DistributedError

    monkeypatch.setattr(node, "FORM_TIMEOUT_S", 0.6)
    monkeypatch.setattr(node, "SAY_WAIT_S", 0.2)
    launcher = types.SimpleNamespace(
        options=types.SimpleNamespace(node_rank=0, nnodes=3, rdzv_id="job7"),
        roster=types.SimpleNamespace(cv=threading.Condition()),
        plane=types.SimpleNamespace(view=types.SimpleNamespace(live_nodes=lambda: {0, 2},
                                                               refused=dict)))
    with caplog.at_level("WARNING"), pytest.raises(
            DistributedError, match=r"nodes \[1\] have not registered: is each launched with "
                                    r"the same --rdzv and --rdzv-id 'job7', --nnodes 3"):
        node.NodeLauncher._wait_view(launcher, lambda v: False, "all 3 nodes to register",
                                     missing=lambda v: sorted({0, 1, 2} - v.live_nodes()))
    assert any("waiting for all 3 nodes to register" in r.getMessage()
               and "nodes [1] have not registered" in r.getMessage() for r in caplog.records)


def test_a_node_waiting_for_one_that_refused_the_job_ends_at_once_saying_why(monkeypatch):
    """Nodes launched with another job secret refuse the job and leave; a node that came
    later waited the full 120 s for them (a user trial): their refusal is in etcd, and the
    wait ends with it."""
    import types

    from mnemojax._src.distributed.launcher import node
    from mnemojax._src.errors import WorldConfigError

    monkeypatch.setattr(node, "FORM_TIMEOUT_S", 30.0)
    why = "node 2 was launched with another MNEMOJAX_JOB_SECRET than node 0"
    launcher = types.SimpleNamespace(
        options=types.SimpleNamespace(node_rank=1, nnodes=3, rdzv_id="job7"),
        roster=types.SimpleNamespace(cv=threading.Condition()),
        plane=types.SimpleNamespace(view=types.SimpleNamespace(
            live_nodes=lambda: {1}, refused=lambda: {0: why})))
    with pytest.raises(WorldConfigError, match=f"node 1: node 0 refused to run the job: {why}"):
        node.NodeLauncher._wait_view(launcher, lambda v: False, "all 3 nodes to register",
                                     missing=lambda v: sorted({0, 1, 2} - v.live_nodes()))


def test_a_launch_that_fails_in_the_multi_process_layer_ends_with_one_line(monkeypatch,
                                                                          capsys):
    """`mnemojax launch` ended with a traceback when etcd was out of reach or a node never
    came (a user trial); now one line and status 1."""
    from mnemojax._src.cli import main
    from mnemojax._src.distributed.launcher import cli as launch_cli
    from mnemojax._src.errors import DistributedError

    def run(args):
        raise DistributedError("node 0: waited 120 s for all 2 nodes to register in etcd")

    monkeypatch.setattr(launch_cli, "run", run)
    assert main(["launch", "--nproc", "1", "--", "true"]) == 1
    err = capsys.readouterr().err
    assert err == ("mnemojax launch: error: node 0: waited 120 s for all 2 nodes to register "
                   "in etcd\n")


def test_a_node_takes_back_a_spare_that_stops_asking_to_join(cluster, monkeypatch):
    """A spare is published in etcd while it asks to join (`wire.AwaitJoin`) and taken
    back once it stops (a frozen process), so no world across nodes takes it in and
    stalls on it (as on one machine: a trial); it is published again once it asks again."""
    import types

    from mnemojax._src.distributed import auth
    from mnemojax._src.distributed.launcher import launcher as launcher_module
    from mnemojax._src.distributed.launcher import status
    from mnemojax._src.distributed.launcher.node import NodeLauncher

    monkeypatch.setattr(launcher_module, "POLL_GAP_S", 0.3)
    monkeypatch.setenv(auth.JOB_SECRET, "ab" * 32)
    options = LaunchOptions(nproc=2, nnodes=2, node_rank=0, rdzv=cluster.url,
                            rdzv_id="frozen-spare", spares=1)
    launcher = NodeLauncher(options, ["true"])
    store, [spare] = launcher.store, list(options.spare_ids)
    lease = store.grant(30)
    launcher._lease = types.SimpleNamespace(lease=lease,
                                            close=lambda revoke: store.revoke(lease))
    key = store.key("spares", spare)

    def offer_until(cond, what) -> None:
        def offered():
            with launcher.roster.cv:
                launcher._offer_spares()  # (the launcher's run loop, every 0.2 s)
            return cond()
        _wait_until(offered, what=what)

    def ask() -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            asking = pool.submit(launcher._await_join,
                                 wire.AwaitJoin(worker_id=spare, timeout_s=1.0))
            offer_until(lambda: store.get(key) == 0, "the spare published")
            assert asking.result(timeout=5) == wire.Joined()  # (no world took it in)
        _wait_until(lambda: status.summary(store)["quiet_spares"] == [],
                    what="no quiet spare in status")  # (the plane writes in the background)

    def shown_quiet() -> None:
        _wait_until(lambda: status.summary(store)["quiet_spares"] == [spare],
                    what="the quiet spare in status")

    try:
        with launcher.roster.cv:
            launcher._idle.add(spare)
        ask()
        offer_until(lambda: store.get(key) is None, "the frozen spare taken back")
        assert [e["worker_id"] for e in launcher.events
                if e["op"] == "spare_withdrawn"] == [spare]
        shown_quiet()  # in `mnemojax status` (trial 49: nothing showed it), until it asks
        ask()  # (it asks again: offered again)
        offer_until(lambda: store.get(key) is None, "taken back once more")
        shown_quiet()
    finally:
        launcher.cleanup()


def _wait_until(cond, *, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.05)
