"""The multi-node control plane: the pure view of the job's keys, and the etcd store and
arbiter against a real 3-member etcd cluster on loopback (skipped, saying why, without
etcd: `make etcd`)."""

from __future__ import annotations

import threading

import pytest

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.launcher.etcd_store import EtcdStore, LeaseKeeper, parse_endpoints
from mnemojax._src.distributed.launcher.options import LaunchOptions
from mnemojax._src.distributed.launcher.plane import EtcdArbiter, JobView, ring
from mnemojax._src.distributed.launcher.roster import AgentRoster
from mnemojax._src.distributed.launcher.services import ServiceHost
from mnemojax._src.errors import InvalidOptionError
from tests.etcd_cluster import etcd_cluster


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


def test_the_book_counts_arrivals_of_live_members_only():
    items = {"world/0": {"members": [0, 1, 2]}, "nodes/0": {}, "nodes/1": {},
             "arrive/0/0": {"last_step": 5, "first_replayable": None},
             "arrive/0/2": {"last_step": 4, "first_replayable": None}, "dead/2": {}}
    book = JobView(items, nproc=2, seen_nodes=frozenset({0, 1})).book(0)
    assert book.arrived == {0: 5} and book.dead == {2} and book.missing() == [1]


@pytest.mark.parametrize("url", ["etcd:/x", "http://h:1", "etcd://h", "etcd://h:1,:2",
                                 "etcd://h:99999"])
def test_bad_rdzv_urls_are_refused_by_name(url):
    with pytest.raises(InvalidOptionError, match="rdzv="):
        parse_endpoints(url)


def test_several_nodes_need_an_etcd_rendezvous():
    with pytest.raises(InvalidOptionError, match="nnodes=2 needs rdzv"):
        LaunchOptions(nproc=1, nnodes=2)
    with pytest.raises(InvalidOptionError, match="node_rank=2"):
        LaunchOptions(nproc=1, nnodes=2, node_rank=2, rdzv="etcd://h:1")
    o = LaunchOptions(nproc=3, nnodes=2, node_rank=1, rdzv="etcd://h:1")
    assert o.world_size == 6 and list(o.local_workers) == [3, 4, 5]


@pytest.fixture(scope="module")
def cluster():
    with etcd_cluster(3) as c:
        yield c


def test_store_creates_once_and_survives_a_member_loss(cluster):
    store = EtcdStore.from_url(cluster.url, "store-test", retry_s=10)
    key = store.key("world", 1)
    assert store.create(key, {"by": "a"}) and not store.create(key, {"by": "b"})
    assert not store.create(store.key("world", 2), 1, unless=[key])
    assert store.get(key) == {"by": "a"}
    keeper = LeaseKeeper(store, 2)
    store.put(store.key("nodes", 0), "alive", lease=keeper.lease)
    cluster.kill(0)  # the member every call tried first
    assert store.items()["nodes/0"] == "alive"
    store.put(store.key("x"), [1, 2])
    assert store.get(store.key("x")) == [1, 2]
    keeper.close(revoke=True)
    assert "nodes/0" not in store.items()


def test_two_nodes_agree_once_on_the_next_world(tmp_path):
    """Two nodes' arbiters, four workers (threads); worker 3 dies: every survivor gets the
    same world 1, decided once, with its coordination service on the deciding node."""
    with etcd_cluster(3) as c:
        store = EtcdStore.from_url(c.url, "agree-test")
        store.put(store.key("world", 0), {"members": [0, 1, 2, 3], "coordinator": "-",
                                          "host_node": 0})
        arbiters, hosts = [], []
        for rank in (0, 1):
            store.put(store.key("nodes", rank), {})
            roster, services = AgentRoster(secret=b"s" * 32), ServiceHost(heartbeat_s=10)
            arbiters.append(EtcdArbiter(store, node_rank=rank, nproc=2, agree_timeout_s=30,
                                        roster=roster, services=services, record=lambda e: None,
                                        poll_s=0.02))
            hosts.append(services)
        try:
            for a in arbiters:
                a.start()
            with arbiters[1]._roster.cv:
                arbiters[1].member_died(3)
            results: dict[int, object] = {}

            def agree(w):
                try:
                    results[w] = arbiters[w // 2].agree(
                        wire.Agree(worker_id=w, generation=0, last_step=7))
                except Exception as e:  # noqa: BLE001 - the test reports it
                    results[w] = e

            threads = [threading.Thread(target=agree, args=(w,)) for w in (0, 1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            decided = [results[w] for w in (0, 1, 2)]
            assert all(hasattr(a, "survivors") for a in decided), decided
            assert {a.survivors for a in decided} == {(0, 1, 2)}  # pyright: ignore
            assert [a.process_id for a in decided] == [0, 1, 2]  # pyright: ignore
            world1 = store.get(store.key("world", 1))
            assert world1["members"] == [0, 1, 2]
            assert {a.coordinator for a in decided} == {world1["coordinator"]}  # pyright: ignore
            # The losing node started no service, or stopped the one it started.
            assert sum(1 for s in hosts if s._services) == 1
            with pytest.raises(Exception, match="not a member of world 0"):
                arbiters[0].agree(wire.Agree(worker_id=0, generation=0, last_step=7))
        finally:
            for a, s in zip(arbiters, hosts, strict=True):
                with a._roster.cv:
                    a.close()
                a.join()
                s.stop_all()
