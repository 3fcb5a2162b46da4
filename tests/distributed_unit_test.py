"""Fast tests of the multi-process layer: no JAX world is started (see tests/e2e for that)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import pytest

from mnemojax._src.distributed import coordination, protocol
from mnemojax._src.distributed.agent import Agent
from mnemojax._src.distributed.agent_client import AgentClient, fetch_snapshot
from mnemojax._src.distributed.agreement import (
    Agreement,
    AgreementBook,
    CopyInfo,
    agreement_from_json,
    agreement_to_json,
    choose_resume_step,
    missing_leaves,
)
from mnemojax._src.distributed.env import WorldSpec, first_slurm_host, world_from_env
from mnemojax._src.distributed.errors import (
    AgreementError,
    ChecksumError,
    DistributedError,
    SnapshotUnavailableError,
    UnsupportedJaxVersionError,
    WorldConfigError,
)
from mnemojax._src.distributed.launcher import Launcher, LaunchOptions
from mnemojax._src.distributed.recovery import recover_world
from mnemojax._src.distributed.scenario import process_alive
from mnemojax._src.distributed.shm import DATA_AT, SnapshotBuffer
from mnemojax._src.distributed.snapshot_codec import (
    ShardEntry,
    assemble,
    pack,
    read_meta,
    unpack,
)
from mnemojax._src.distributed.watchdog import HangWatchdog, ReplicaStore
from mnemojax._src.errors import InvalidOptionError, MnemojaxError
from mnemojax.testing import corrupt_agent_copies

# -- shared-memory double buffer --------------------------------------------------------------


@pytest.fixture
def buffer():
    buf = SnapshotBuffer.create(1024)
    yield buf
    buf.close()


def test_publish_flips_and_keeps_previous_step(buffer):
    writer = SnapshotBuffer.attach(buffer.name)  # the worker's side
    try:
        assert buffer.holdings() == {}
        for step in (1, 2, 3):
            crc = writer.publish(step, [b"step-", str(step).encode()])
        assert sorted(buffer.holdings()) == [2, 3]  # newest + the one before it
        step, data, got_crc = buffer.read()
        assert (step, data, got_crc) == (3, b"step-3", crc)
        assert buffer.read(2)[1] == b"step-2"
        with pytest.raises(KeyError):
            buffer.read(1)
    finally:
        writer.close()
    assert buffer.read()[0] == 3  # the worker detaching does not remove the agent's segment


def test_torn_or_corrupt_slot_fails_crc(buffer):
    buffer.publish(7, [b"x" * 100])
    raw = shared_memory.SharedMemory(name=buffer.name)
    resource_tracker.unregister(raw._name, "shared_memory")
    try:
        slot = buffer.holdings()[7]
        raw.buf[DATA_AT + slot * buffer.slot_bytes] ^= 0xFF
    finally:
        raw.close()
    with pytest.raises(ChecksumError, match="CRC32"):
        buffer.read(7)


def test_publish_over_capacity_is_typed(buffer):
    with pytest.raises(DistributedError, match="exceeds the slot"):
        buffer.publish(1, [b"x" * 2000])


def test_attach_rejects_foreign_segment():
    raw = shared_memory.SharedMemory(create=True, size=8192)
    try:
        with pytest.raises(DistributedError, match="not a mnemojax"):
            SnapshotBuffer.attach(raw.name)
    finally:
        raw.close()
        raw.unlink()


# -- snapshot codec -----------------------------------------------------------------------------


def _payload(step, worker, entries, num_leaves=2, generation=0):
    return b"".join(bytes(p) for p in pack(step, worker, entries, num_leaves=num_leaves,
                                           generation=generation))


def test_codec_roundtrip_and_assemble_across_workers():
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    b = np.arange(3, dtype=np.int32)
    p0 = _payload(5, 0, [ShardEntry(0, (4, 6), ((0, 4), (0, 3)), w[:, :3]),
                         ShardEntry(1, (3,), ((0, 3),), b)])
    p1 = _payload(5, 1, [ShardEntry(0, (4, 6), ((0, 4), (3, 6)), w[:, 3:])])
    meta, entries = unpack(p0)
    assert meta["step"] == 5 and meta["worker_id"] == 0 and len(entries) == 2
    assert read_meta(p1)["num_leaves"] == 2 and read_meta(p1)["shards"][0]["index"] == [
        [0, 4], [3, 6]]
    full = assemble([p0, p1], 2)
    np.testing.assert_array_equal(full[0], w)
    np.testing.assert_array_equal(full[1], b)
    assert full[1].dtype == np.int32


def test_assemble_refuses_missing_shards_and_mixed_steps():
    w = np.ones((4,), np.float32)
    half = _payload(5, 0, [ShardEntry(0, (4,), ((0, 2),), w[:2])], num_leaves=1)
    with pytest.raises(SnapshotUnavailableError, match="not fully covered"):
        assemble([half], 1)
    other = _payload(6, 1, [ShardEntry(0, (4,), ((2, 4),), w[2:])], num_leaves=1)
    with pytest.raises(SnapshotUnavailableError, match="mix steps"):
        assemble([half, other], 1)


# -- watchdog and replica store -------------------------------------------------------------------


def test_watchdog_uses_median_and_exempts_non_train_phases():
    wd = HangWatchdog(factor=5, min_s=1.0)
    wd.set_phase("compile", 0.0)
    assert wd.hung(1000.0) is None  # compiling is never a hang
    wd.set_phase("train", 100.0)
    for i, t in enumerate([105.0, 105.5, 106.0, 106.4, 106.9]):  # first interval skipped
        wd.progress(i + 1, t)
    assert wd.median_s() == pytest.approx(0.5)
    assert wd.threshold_s() == pytest.approx(2.5)
    assert wd.hung(108.0) is None
    assert wd.hung(110.0) == pytest.approx(3.1)
    wd.set_phase("recover", 110.0)
    assert wd.hung(500.0) is None


def test_watchdog_floor():
    wd = HangWatchdog(factor=10, min_s=30.0)
    wd.set_phase("train", 0.0)
    for i in range(4):
        wd.progress(i, 0.1 * i)
    assert wd.threshold_s() == 30.0


def test_replica_store_checks_crc_and_keeps_two_newest():
    store = ReplicaStore(keep=2)
    for step in (1, 2, 3):
        data = f"s{step}".encode()
        store.put(4, step, data, zlib.crc32(data))
    assert sorted((o, s) for o, s, _ in store.verify()[0]) == [(4, 2), (4, 3)]
    assert store.get(4, 3)[0] == b"s3"
    with pytest.raises(ChecksumError):
        store.put(4, 9, b"abc", 123)
    with pytest.raises(KeyError):
        store.get(5, 1)


def test_replica_store_verify_drops_a_copy_that_went_bad_after_the_put():
    store = ReplicaStore(keep=2)
    for step in (2, 3):
        data = f"s{step}".encode()
        store.put(4, step, data, zlib.crc32(data))
    payload, crc = store.get(4, 3)
    store._by_origin[4][3] = (b"s4", crc)  # a flipped bit in memory
    good, bad = store.verify()
    assert [(o, s) for o, s, _ in good] == [(4, 2)] and bad == [(4, 3)]
    with pytest.raises(KeyError):
        store.get(4, 3)  # never served again


# -- buddy transfer between two agents over loopback --------------------------------------------


class _FakeLauncher:
    """Accepts agent links and lets a test send commands to them."""

    def __init__(self):
        self.server, self.address = protocol.listen()
        self.links: dict[int, socket.socket] = {}
        self.addresses: dict[int, str] = {}
        self.events: list[dict] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn):
        try:
            while True:
                h, _ = protocol.recv_msg(conn)
                if h["op"] == "hello":
                    self.links[h["worker_id"]] = conn
                    self.addresses[h["worker_id"]] = h["address"]
                self.events.append(h)
        except (OSError, ConnectionError):
            return

    def close(self):
        for c in self.links.values():
            c.close()
        self.server.close()


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def two_agents():
    fake = _FakeLauncher()
    agents = [Agent(worker_id=i, launcher=fake.address, command=[]) for i in range(2)]
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for t in threads:
        t.start()
    _wait(lambda: len(fake.addresses) == 2)
    yield fake, agents
    for i in list(fake.links):
        protocol.send_msg(fake.links[i], {"op": "shutdown"})
    for t in threads:
        t.join(timeout=10)
    fake.close()
    assert not any(t.is_alive() for t in threads)


def _held(agent_address):
    reply = protocol.request(agent_address, {"op": "holdings"})[0]
    held = {}
    for c in reply["copies"]:
        held.setdefault(str(c["origin"]), []).append(c["step"])
    return held, reply["corrupt"]


def test_buddy_replication_and_serving(two_agents):
    fake, agents = two_agents
    protocol.send_msg(fake.links[0], {"op": "set_buddy", "buddy": fake.addresses[1]})
    client = AgentClient(agents[0].address)
    w = np.arange(8, dtype=np.float32)
    try:
        for step in (1, 2, 3):
            client.publish(step, pack(step, 0, [ShardEntry(0, (8,), ((0, 8),), w + step)],
                                      num_leaves=1))
        _wait(lambda: _held(agents[1].address)[0].get("0", [])[-1:] == [3])
        data, addr = fetch_snapshot([agents[1].address], 0, 3)
        np.testing.assert_array_equal(assemble([data], 1)[0], w + 3)
        assert addr == agents[1].address
        # The worker's own agent serves both slots; a missing step is a typed error.
        assert _held(agents[0].address) == ({"0": [2, 3]}, [])
        data, _ = fetch_snapshot(["127.0.0.1:1", agents[0].address], 0, 2)  # first one dead
        np.testing.assert_array_equal(assemble([data], 1)[0], w + 2)
        with pytest.raises(SnapshotUnavailableError):
            fetch_snapshot([agents[1].address], 0, 9)
        assert [e["step"] for e in fake.events if e["op"] == "progress"] == [1, 2, 3]
        # A flipped bit in the shared memory: the agent no longer counts that copy, and
        # serving it fails its CRC, so a survivor takes the buddy's.
        assert corrupt_agent_copies(agents[0].buffer.name, step=3) == [3]
        held, corrupt = _held(agents[0].address)
        assert held == {"0": [2]} and [(c["origin"], c["step"]) for c in corrupt] == [(0, 3)]
        data, addr = fetch_snapshot([agents[0].address, agents[1].address], 0, 3)
        assert addr == agents[1].address
        np.testing.assert_array_equal(assemble([data], 1)[0], w + 3)
    finally:
        client.close()


def test_publish_over_the_host_memory_budget_stops_with_a_warning(two_agents):
    """The agent would hold ~4 x the payload (two own slots, two of the ring neighbour's):
    over the budget the worker stops publishing, says so once, and writes nothing."""
    import jax.numpy as jnp

    from mnemojax._src.distributed.session import DistributedSession
    from mnemojax.errors import SnapshotBudgetWarning

    _, agents = two_agents
    session = DistributedSession(WorldSpec(coordinator="127.0.0.1:1", process_id=0,
                                           num_processes=1, agent=agents[0].address))
    leaves = [jnp.ones((256,), jnp.float32)]  # 1 KiB of shards, plus metadata
    try:
        assert session.publish(1, leaves, budget_bytes=1 << 20)
        with pytest.warns(SnapshotBudgetWarning, match="host_memory_budget_bytes=4000"):
            assert not session.publish(2, leaves, budget_bytes=4000)
        assert session.publish_refused
        assert not session.publish(3, leaves, budget_bytes=1 << 20)  # for good
        assert _held(agents[0].address)[0] == {"0": [1]}
    finally:
        session.agent.close()


# -- agreement --------------------------------------------------------------------------------------


def _copy(origin, step, cols, generation=0, num_leaves=1):
    """A copy of leaf 0 (shape (2, 6)) holding columns ``cols`` = (start, stop) pairs."""
    return CopyInfo(origin, step, generation, num_leaves,
                    tuple((0, (2, 6), ((0, 2), c)) for c in cols))


def test_missing_leaves_counts_distinct_shards_once():
    assert missing_leaves([_copy(0, 5, [(0, 3)]), _copy(1, 5, [(3, 6)])]) == []
    # A replica of the same shard does not make up for a missing one.
    assert missing_leaves([_copy(0, 5, [(0, 3)]), _copy(1, 5, [(0, 3)])]) == [0]
    assert missing_leaves([_copy(0, 5, [(0, 6)], num_leaves=2)]) == [1]


def test_resume_step_is_newest_step_whose_copies_cover_the_state():
    holdings = {"a0": [_copy(0, 5, [(0, 3)]), _copy(0, 6, [(0, 3)]), _copy(2, 6, [])],
                "a1": [_copy(1, 5, [(3, 6)]), _copy(0, 5, [(0, 3)])],
                "a2": [_copy(1, 6, [(3, 6)])]}
    assert choose_resume_step(holdings) == (6, 0)
    del holdings["a2"]  # 1's step-6 shards are gone: step 5 is the newest complete one
    assert choose_resume_step(holdings) == (5, 0)
    assert choose_resume_step({"a0": [_copy(0, 6, [(0, 3)])]}) is None
    # The same step replayed in a newer world is preferred (its own mesh, its own tiling).
    holdings["a3"] = [_copy(0, 5, [(0, 6)], generation=1)]
    assert choose_resume_step(holdings) == (5, 1)


def test_book_barrier_waits_for_live_members_only():
    book = AgreementBook(0, [0, 1, 2])
    book.arrive(2, 0, last_step=6)
    assert not book.complete() and book.missing() == [0, 1]
    book.mark_dead(1)
    assert book.missing() == [0]
    book.arrive(0, 0, last_step=6)
    assert book.complete()
    holdings = {"x": [_copy(0, 6, [(0, 3)]), _copy(1, 6, [(3, 6)]), _copy(0, 5, [(0, 6)])],
                "y": [_copy(2, 6, [])]}
    decision = book.decide(coordinator="127.0.0.1:9", holdings=holdings)
    assert set(decision) == {0, 2}
    assert decision[0].process_id == 0 and decision[2].process_id == 1
    assert {a.resume_step for a in decision.values()} == {6}
    assert decision[2].survivors == (0, 2) and decision[2].num_processes == 2
    # Worker 2's copy holds no shards: nothing of it to fetch.
    assert decision[0].sources == {0: ("x",), 1: ("x",)} and decision[0].lost == ()
    homes = AgreementBook(0, [0, 1])
    homes.arrive(0, 0, last_step=6)
    homes.arrive(1, 0, last_step=6)
    both = {"a0": [_copy(0, 6, [(0, 3)]), _copy(1, 6, [(3, 6)])],
            "a1": [_copy(1, 6, [(3, 6)]), _copy(0, 6, [(0, 3)])]}
    got = homes.decide(coordinator="c", holdings=both, homes={0: "a0", 1: "a1"})[0].sources
    assert got == {0: ("a0", "a1"), 1: ("a1", "a0")}  # each worker's own agent first
    assert book.decide(coordinator="other", holdings={}) is decision  # decided once
    assert agreement_from_json(agreement_to_json(decision[2])) == decision[2]


def test_resume_step_is_not_newer_than_any_survivors_last_step():
    """Worker 2 holds no shards and its step 6 failed after worker 0's succeeded: resuming
    from 6 would skip worker 2 ahead of its own state, so the survivors resume from 5."""
    book = AgreementBook(0, [0, 1, 2])
    book.arrive(0, 0, last_step=6)
    book.arrive(2, 0, last_step=5)
    book.mark_dead(1)
    holdings = {"x": [_copy(0, 5, [(0, 6)]), _copy(0, 6, [(0, 6)]), _copy(2, 5, [])]}
    assert choose_resume_step(holdings) == (6, 0)
    assert book.decide(coordinator="c", holdings=holdings)[2].resume_step == 5


def test_book_member_dying_at_the_barrier_is_left_out():
    book = AgreementBook(1, [0, 1, 2])
    book.arrive(0, 1, last_step=4)
    book.arrive(1, 1, last_step=4)
    book.mark_dead(1)  # arrived, then died while waiting
    assert book.missing() == [2] and 1 not in book.arrived
    book.arrive(2, 1, last_step=4)
    decision = book.decide(coordinator="c", holdings={"x": [_copy(0, 4, [(0, 6)])]})
    assert set(decision) == {0, 2} and decision[2].generation == 2
    book.mark_dead(2)  # after the decision: the next world's book handles it
    assert set(book.decision) == {0, 2}


def test_book_says_which_workers_state_is_lost():
    book = AgreementBook(0, [0, 1, 2, 3])
    for w in (2, 3):
        book.arrive(w, 0, last_step=4)
    book.mark_dead(0)
    book.mark_dead(1)
    holdings = {"a2": [_copy(2, 4, [(3, 6)]), _copy(1, 3, [(0, 3)])],
                "a3": [_copy(3, 3, []), _copy(3, 4, [])]}
    decision = book.decide(coordinator="c", holdings=holdings)
    assert decision[2].resume_step == -1 and decision[3].lost == (0, 1)
    # Worker 3 holds no shards in world 0: missing its step-4 copy would lose nothing.
    del holdings["a3"][1]
    again = AgreementBook(0, [0, 1, 2, 3])
    for w in (2, 3):
        again.arrive(w, 0, last_step=4)
    again.mark_dead(0)
    again.mark_dead(1)
    assert again.decide(coordinator="c", holdings=holdings)[2].lost == (0, 1)
    assert decision[2].sources == {} and decision[2].survivors == (2, 3)
    # A second round over a world that never formed ({2, 3}): the newest copies are of
    # world 0, so its members are the ones named.
    again = AgreementBook(1, [2, 3])
    for w in (2, 3):
        again.arrive(w, 1, last_step=4)
    decision = again.decide(coordinator="c", holdings=holdings,
                            members_of={0: (0, 1, 2, 3), 1: (2, 3)})
    assert decision[2].lost == (0, 1)


def test_book_rejects_wrong_generation_and_evicted():
    book = AgreementBook(3, [0, 1])
    with pytest.raises(AgreementError) as e:
        book.arrive(0, 2, last_step=1)
    assert e.value.generation == 2
    book.mark_dead(1)
    with pytest.raises(AgreementError, match="evicted"):
        book.arrive(1, 3, last_step=1)
    with pytest.raises(AgreementError, match="incomplete"):
        AgreementBook(0, [0, 1]).decide(coordinator="c", holdings={})


# -- environment --------------------------------------------------------------------------------------


def test_world_from_mnemojax_env():
    w = world_from_env({"MNEMOJAX_COORDINATOR": "127.0.0.1:1234", "MNEMOJAX_PROCESS_ID": "2",
                        "MNEMOJAX_NUM_PROCESSES": "4", "MNEMOJAX_DEVICES_PER_PROC": "2",
                        "MNEMOJAX_HEARTBEAT_S": "12", "MNEMOJAX_WORKER_ID": "3"})
    assert (w.coordinator, w.process_id, w.num_processes, w.devices_per_proc) == (
        "127.0.0.1:1234", 2, 4, 2)
    assert w.heartbeat_s == 12 and w.collective_timeout_s == 20 and w.stable_id == 3


def test_world_from_slurm_env():
    w = world_from_env({"SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "SLURM_NTASKS": "8",
                        "SLURM_JOB_NODELIST": "gpu[003-010],cpu1"})
    assert w.coordinator == "gpu003:" + str(8476 + 242)
    assert (w.process_id, w.num_processes, w.stable_id) == (1, 8, 1)
    assert first_slurm_host("node7") == "node7"
    assert first_slurm_host("a[1,5-6]") == "a1"


@pytest.mark.parametrize("env, match", [
    ({}, "no world"),
    ({"MNEMOJAX_COORDINATOR": "h:1"}, "MNEMOJAX_PROCESS_ID"),
    ({"MNEMOJAX_COORDINATOR": "h:1", "MNEMOJAX_PROCESS_ID": "4",
      "MNEMOJAX_NUM_PROCESSES": "4"}, "process_id=4"),
    ({"MNEMOJAX_COORDINATOR": "nohost", "MNEMOJAX_PROCESS_ID": "0",
      "MNEMOJAX_NUM_PROCESSES": "1"}, "host:port"),
    ({"MNEMOJAX_COORDINATOR": "h:1", "MNEMOJAX_PROCESS_ID": "x",
      "MNEMOJAX_NUM_PROCESSES": "1"}, "integer"),
    ({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0"}, "incomplete"),
])
def test_world_errors_are_typed(env, match):
    with pytest.raises(WorldConfigError, match=match) as e:
        world_from_env(env)
    assert isinstance(e.value, MnemojaxError) and isinstance(e.value, ValueError)


def test_worldspec_validates():
    with pytest.raises(WorldConfigError):
        WorldSpec(coordinator="h:1", process_id=0, num_processes=1, devices_per_proc=0)


# -- the private-API guard: fails loudly when JAX changes what coordination.py uses ------------


def test_private_jax_api_shape_is_what_coordination_relies_on():
    coordination.check_jax_version()
    coordination.check_private_api()
    from jax._src.lib import _jax
    doc = _jax.get_distributed_runtime_service.__doc__
    assert "recoverable: bool | None" in doc, doc
    doc = _jax.get_distributed_runtime_client.__doc__
    for param in ("init_timeout", "heartbeat_timeout", "shutdown_timeout", "use_compression"):
        assert f"{param}:" in doc, doc
    assert "timeout_in_ms" in _jax.DistributedRuntimeClient.wait_at_barrier.__doc__
    import jax.extend.backend
    assert callable(jax.extend.backend.clear_backends)
    from jax._src import xla_bridge
    src = inspect.getsource(xla_bridge.make_cpu_client)
    # Gloo collectives and the CPU client read these fields of global_state.
    for field in ("global_state.client", "global_state.process_id", "global_state.num_processes"):
        assert field in src, field


@pytest.mark.parametrize("version", ["0.9.9", "0.11.0", "1.0.0"])
def test_unsupported_jax_version_is_typed(version):
    with pytest.raises(UnsupportedJaxVersionError) as e:
        coordination.check_jax_version(version)
    assert e.value.version == version and "0.11" in e.value.supported


def test_supported_versions_pass():
    for v in ("0.10.0", "0.10.2", "0.10.9.dev20261201"):
        coordination.check_jax_version(v)


# -- launcher and CLI (no JAX in the workers) ---------------------------------------------------------


def test_launch_options_validate():
    with pytest.raises(InvalidOptionError, match="nproc=0"):
        LaunchOptions(nproc=0)
    with pytest.raises(InvalidOptionError):
        LaunchOptions(nproc=1, hang_factor=1.0)


def test_cli_parses_command_after_double_dash():
    from mnemojax._src.distributed import launch_cli
    parser = argparse.ArgumentParser()
    launch_cli.add_arguments(parser)
    args = parser.parse_args(["--nproc", "4", "--devices-per-proc", "2", "--heartbeat-s", "12",
                              "--", sys.executable, "train.py", "--lr", "1"])
    assert args.nproc == 4 and args.devices_per_proc == 2 and args.heartbeat_s == 12
    assert args.command[-3:] == ["train.py", "--lr", "1"]



@pytest.mark.parametrize("code, recover, expected", [(0, True, 0), (3, False, 3)])
def test_launcher_forwards_exit_status_and_leaves_nothing(tmp_path, code, recover, expected):
    script = ("import os, sys; open(os.path.join(sys.argv[1], os.environ['MNEMOJAX_WORKER_ID']),"
              " 'w').write(os.environ['MNEMOJAX_COORDINATOR']); sys.exit(int(sys.argv[2]))")
    launcher = Launcher(LaunchOptions(nproc=2, recover=recover, job_timeout_s=60, grace_s=1),
                        [sys.executable, "-c", script, str(tmp_path), str(code)])
    assert launcher.run() == expected
    if code == 0:
        assert sorted(os.listdir(tmp_path)) == ["0", "1"]
    pids = [p.pid for p in launcher.agents.values()] + list(launcher.worker_pids.values())
    assert len(pids) == 4 and not any(process_alive(p) for p in pids)


def test_launcher_job_timeout_kills_everything(tmp_path):
    launcher = Launcher(LaunchOptions(nproc=2, job_timeout_s=3, grace_s=1),
                        [sys.executable, "-c", "import time; time.sleep(600)"])
    t = time.monotonic()
    assert launcher.run() == 124
    assert time.monotonic() - t < 30
    pids = [p.pid for p in launcher.agents.values()] + list(launcher.worker_pids.values())
    assert not any(process_alive(p) for p in pids)


def test_agent_process_does_not_import_jax():
    from mnemojax._src.distributed.agent import agent_command
    cmd = agent_command("--help")
    probe = cmd[2].replace("from mnemojax._src.distributed.agent import main; "
                           "sys.exit(main(sys.argv[1:]))",
                           "import mnemojax._src.distributed.agent, "
                           "mnemojax._src.distributed.agent_client; "
                           "sys.exit(10 + ('jax' in sys.modules))")
    assert probe != cmd[2]
    result = subprocess.run([cmd[0], "-c", probe], timeout=60, check=False)
    assert result.returncode == 10, "the agent imported jax"


def test_process_fault_names_a_bad_kind_or_victim():
    from mnemojax.testing import ProcessFault

    with pytest.raises(InvalidOptionError, match="kind='explode'"):
        ProcessFault("explode", 1, 3)
    with pytest.raises(InvalidOptionError, match="victim=-1"):
        ProcessFault("kill", -1, 3)


def test_resume_step_must_be_replayable_by_every_survivor():
    """A survivor that keeps only the batches from step 6 on cannot resume from step 4: with
    nothing newer complete in memory, the decision says so (then Orbax or a typed error)."""
    book = AgreementBook(0, [0, 1])
    book.arrive(0, 0, last_step=6, first_replayable=6)
    book.arrive(1, 0, last_step=6, first_replayable=3)
    holdings = {"x": [_copy(0, 4, [(0, 3)]), _copy(1, 4, [(3, 6)])]}
    assert choose_resume_step(holdings, min_step=5) is None
    decision = book.decide(coordinator="c", holdings=holdings)[0]
    assert decision.resume_step == -1 and decision.lost == ()
    assert "older than step 5" in decision.why


class _Coordinator:
    """Decides world g+1 with both workers, then (a member having died) world g+2."""

    def __init__(self):
        self.calls = []

    def report_failure(self, *, generation, reason):
        self.calls.append(("report", generation))

    def agree(self, *, generation, last_step, first_replayable=None):
        self.calls.append(("agree", generation))
        members = (0, 1) if generation == 0 else (0,)
        return Agreement(generation=generation + 1, worker_id=0, process_id=0,
                         num_processes=len(members), coordinator=f"127.0.0.1:{9000 + generation}",
                         resume_step=-1, survivors=members, previous_members=(0, 1, 2),
                         sources={}, lost=(2,), why="test")


def test_a_world_that_does_not_form_is_agreed_again(monkeypatch):
    """connect of world 1 times out (a member died after the decision): the survivor
    reports it and agrees again over world 1; world 2 forms."""
    attached = []

    def attach(world, *, init_timeout_s):
        attached.append((world.generation, init_timeout_s))
        if world.generation == 1:
            raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")

    monkeypatch.setattr(coordination, "detach_worker", lambda: None)
    monkeypatch.setattr(coordination, "attach_worker", attach)
    coordinator = _Coordinator()
    world = WorldSpec(coordinator="127.0.0.1:1", process_id=0, num_processes=3,
                      attach_timeout_s=7)
    rec = recover_world(coordinator, world, last_step=4, reason="peer died")
    assert rec.rounds == 2 and rec.world.generation == 2 and rec.world.num_processes == 1
    assert rec.members == (0, 1, 2)  # the world that failed, not the one that never formed
    assert attached == [(1, 7), (2, 7)]
    assert coordinator.calls == [("report", 0), ("agree", 0), ("report", 1), ("agree", 1)]


def test_a_survivor_that_cannot_fetch_stays_out_and_agrees_again(monkeypatch):
    """Every source of the agreed copy died since the decision: the survivor does not join
    that world (so it cannot form for anyone) and goes straight to the next agreement."""
    from mnemojax._src.distributed import recovery as dist_recovery

    attached, fetches = [], []

    class Sourced(_Coordinator):
        def agree(self, **kw):
            a = super().agree(**kw)
            return dataclasses.replace(a, resume_step=4, sources={0: ("127.0.0.1:1",)},
                                       lost=(), why="")

    def fetch(addrs, origin, step):
        fetches.append(addrs)
        if len(fetches) == 1:
            raise SnapshotUnavailableError("no copy of worker 0 step 4: refused")
        return bytearray(b"".join(bytes(p) for p in pack(4, 0, [], num_leaves=0))), addrs[0]

    monkeypatch.setattr(coordination, "detach_worker", lambda: None)
    monkeypatch.setattr(coordination, "attach_worker",
                        lambda world, *, init_timeout_s: attached.append(world.generation))
    monkeypatch.setattr(dist_recovery, "fetch_snapshot", fetch)
    coordinator = Sourced()
    rec = recover_world(coordinator, WorldSpec(coordinator="127.0.0.1:1", process_id=0,
                                               num_processes=3), last_step=4)
    assert rec.rounds == 2 and attached == [2] and len(rec.payloads) == 1
    assert coordinator.calls == [("report", 0), ("agree", 0), ("report", 1), ("agree", 1)]


def test_agent_refuses_replicas_over_its_hosts_budget(two_agents):
    """Agent 1 keeps worker 0's replicas only within its own worker's budget (its slots
    count too): over it the replica is refused and reported, never held."""
    fake, agents = two_agents
    protocol.send_msg(fake.links[0], {"op": "set_buddy", "buddy": fake.addresses[1]})
    c0, c1 = AgentClient(agents[0].address), AgentClient(agents[1].address)
    try:
        def payload(step, worker, n):
            return pack(step, worker, [ShardEntry(0, (n,), ((0, n),), np.ones(n, np.uint8))],
                        num_leaves=1)

        c1.publish(1, payload(1, 1, 100), budget_bytes=20_000)  # agent 1's slots: ~9 KB
        c0.publish(1, payload(1, 0, 4000), budget_bytes=1 << 20)
        _wait(lambda: _held(agents[1].address)[0].get("0") == [1])
        c0.publish(2, payload(2, 0, 40_000), budget_bytes=1 << 20)
        _wait(lambda: any(e["op"] == "replica_refused" for e in fake.events))
        assert _held(agents[1].address)[0].get("0") == [1]  # step 2 was never held
        with pytest.raises(SnapshotUnavailableError):
            fetch_snapshot([agents[1].address], 0, 2)
    finally:
        c0.close()
        c1.close()
