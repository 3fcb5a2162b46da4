"""`distributed.wire`: every message survives the trip, and a malformed one is named."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agreement import Agreement, CopyInfo
from mnemojax._src.errors import ProtocolError

AGREEMENT = Agreement(generation=2, worker_id=3, process_id=1, num_processes=2,
                      coordinator="127.0.0.1:9", resume_step=6, survivors=(0, 3),
                      previous_members=(0, 1, 3), sources={0: ("a0", "a1"), 1: ("a1",)},
                      lost=(), resume_generation=1, why="")
COPY = CopyInfo(1, 6, 1, 2, ((0, (2, 6), ((0, 2), (3, 6))), (1, (4,), ((0, 4),))))

# One instance of every message, with optional fields both set and unset.
EXAMPLES = [
    wire.Hello(worker_id=1, address="127.0.0.1:5", pid=42),
    wire.WorkerStarted(worker_id=1, pid=43),
    wire.WorkerExit(worker_id=1, code=-9, pid=43),
    wire.Progress(worker_id=1, step=7),
    wire.Hang(worker_id=1, idle_s=31.5, median_s=0.2, step=7),
    wire.Hang(worker_id=1, idle_s=31.5, median_s=None, step=None),
    wire.ReplicaRefused(worker_id=1, origin=0, step=7, budget_bytes=4096),
    wire.WorkerPhase(worker_id=1, phase="compile"),
    wire.Start(env={"MNEMOJAX_PROCESS_ID": "1"}, buddy="127.0.0.1:6"),
    wire.Start(env={}, buddy=None),
    wire.SetBuddy(buddy="127.0.0.1:6"),
    wire.SetBuddy(buddy=None),
    wire.SetBuddy(buddy="127.0.0.1:6", resume_step=4, keep_from=2),
    wire.PauseWatchdog(),
    wire.KillWorker(),
    wire.Shutdown(),
    wire.ReportFailure(worker_id=1, generation=0, reason="Gloo AllGather failed"),
    wire.Leave(worker_id=2, generation=1, reason="no device of mesh (2, 2)"),
    wire.Agree(worker_id=1, generation=0, last_step=7, first_replayable=5),
    wire.Agree(worker_id=1, generation=0, last_step=7),
    wire.AgreementReply(agreement=AGREEMENT),
    wire.AgreementReply(agreement=dataclasses.replace(AGREEMENT, resume_step=-1, sources={},
                                                      lost=(1,), why="gone")),
    wire.AgreementReply(agreement=dataclasses.replace(AGREEMENT, replaces={7: 1})),
    # A survivor's held copy is named by a negative origin (`agreement.held_origin`).
    wire.AgreementReply(agreement=dataclasses.replace(AGREEMENT, sources={-4: ("a3",)})),
    wire.Barrier(worker_id=1, generation=0, name="mnemojax-compiled-0", timeout_s=300.0),
    wire.BarrierReply(failed=()),
    wire.BarrierReply(failed=(0, 2)),
    wire.WatchWorld(worker_id=2, generation=1, timeout_s=60.0),
    wire.AwaitJoin(worker_id=5, timeout_s=30.0),
    wire.Joined(),
    wire.Joined(agreement=dataclasses.replace(AGREEMENT, replaces={5: 0})),
    wire.WorldFailed(generation=1, failed=()),
    wire.WorldFailed(generation=0, failed=(1,)),
    wire.WorldFailed(generation=2, failed=(), regrow=True),
    wire.WorldFailed(generation=2, failed=(), left=(0, 3)),
    wire.HoldingsQuery(),
    wire.Holdings(copies=(COPY, CopyInfo(2, 6, 1, 2, ())),
                  corrupt=(wire.CorruptCopy(origin=0, step=5, error="CRC32"),
                           wire.CorruptCopy(origin=4, step=None, error="metadata"))),
    wire.Holdings(copies=()),
    wire.Alloc(nbytes=1 << 20, budget_bytes=None),
    wire.Alloc(nbytes=1 << 20, budget_bytes=1 << 30),
    wire.Allocated(name="mnjx1_w0_1", slot_bytes=1 << 20),
    wire.Published(step=7),
    wire.AwaitReplicated(timeout_s=10.0),
    wire.Replicated(caught_up=True),
    wire.Replicated(caught_up=False, detail="buddy unreachable"),
    wire.Hold(step=7, crc=123456),
    wire.Phase(phase="train"),
    wire.InStep(inside=False),
    wire.Replica(origin=0, step=7, crc=0xFFFFFFFF),
    wire.Get(origin=0, step=7),
    wire.Get(origin=0, step=7, header_only=True),
    wire.Get(origin=1, step=7, boxes=((0, ((0, 4), (2, 6))), (3, ()))),
    wire.Snapshot(origin=0, step=7, crc=12345),
    wire.RefusedConnection(worker_id=1, peer="127.0.0.1:7", reason="wrong proof"),
    wire.AuthChallenge(nonce="ab" * 32),
    wire.AuthResponse(nonce="cd" * 32, mac="ef" * 32),
    wire.AuthAccepted(mac="01" * 32),
    wire.Ok(),
    wire.ErrorReply(message="no copy"),
]


def test_every_message_has_an_example_and_a_unique_op():
    assert {type(m) for m in EXAMPLES} == set(wire.MESSAGES)
    assert len({m.OP for m in wire.MESSAGES}) == len(wire.MESSAGES)
    assert all(m.OP for m in wire.MESSAGES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_through_json(message):
    header = json.loads(json.dumps(message.to_wire()))
    assert header["op"] == message.OP
    assert wire.decode(header) == message


def test_events_keep_the_fields_tests_and_chaos_read():
    """The launcher records received messages as dicts (`to_wire`)."""
    assert wire.Hello(worker_id=1, address="a", pid=2).to_wire() == {
        "op": "hello", "worker_id": 1, "address": "a", "pid": 2}
    assert wire.Agree(worker_id=1, generation=0, last_step=3).to_wire() == {
        "op": "agree", "worker_id": 1, "generation": 0, "last_step": 3,
        "first_replayable": None}


@pytest.mark.parametrize("header, field", [
    ({"op": "progress", "worker_id": 1}, "step"),
    ({"op": "progress", "worker_id": 1, "step": "7"}, "step"),
    ({"op": "progress", "worker_id": True, "step": 7}, "worker_id"),
    ({"op": "hang", "worker_id": 1, "idle_s": "long", "median_s": None, "step": None},
     "idle_s"),
    ({"op": "start", "env": {"A": 1}, "buddy": None}, "env"),
    ({"op": "set_buddy", "buddy": 5}, "buddy"),
    ({"op": "agree", "worker_id": 1, "generation": 0, "last_step": 3.5}, "last_step"),
    ({"op": "alloc", "nbytes": 10, "budget_bytes": "lots"}, "budget_bytes"),
    ({"op": "error"}, "message"),
    ({"op": "get", "origin": 0, "step": 1, "boxes": [{"leaf": 0, "index": [[0, "4"]]}]},
     "boxes[0].index"),
    ({"op": "barrier_result", "failed": [1, "2"]}, "failed"),
    ({"op": "barrier", "worker_id": 1, "generation": 0, "name": "b", "timeout_s": "long"},
     "timeout_s"),
    ({"op": "agreement", "agreement": []}, "agreement"),
    ({"op": "held", "copies": [{"origin": 0, "step": 1, "generation": 0, "num_leaves": 1,
                                "shards": [{"leaf": 0, "shape": [4], "index": [[0]]}]}],
      "corrupt": []}, "copies[0].shards[0].index"),
    ({"op": "held", "copies": [], "corrupt": [{"origin": 0, "step": 1}]}, "corrupt[0].error"),
    ({"op": "nope"}, "op"),
    ({"step": 3}, "op"),
    ([1, 2], "op"),
])
def test_malformed_message_names_its_field(header, field):
    with pytest.raises(ProtocolError) as e:
        wire.decode(header)
    assert e.value.field == field, e.value
    assert field in str(e.value)


def test_malformed_agreement_names_the_nested_field():
    header = wire.AgreementReply(agreement=AGREEMENT).to_wire()
    header["agreement"]["sources"] = {"zero": ["a0"]}
    with pytest.raises(ProtocolError) as e:
        wire.decode(header)
    assert e.value.op == "agreement" and e.value.field == "agreement.sources"
    del header["agreement"]["survivors"]
    header["agreement"]["sources"] = {}
    with pytest.raises(ProtocolError, match="'agreement.survivors' is missing"):
        wire.decode(header)


def test_a_new_worlds_buddy_command_carries_what_its_agreement_keeps():
    """`SetBuddy.for_world`, what both launchers send every member's agent when a world
    forms: the step it resumed from and the oldest world whose copies stay; world 0 sends
    neither, an older world a launcher catches up on keeps everything."""
    from mnemojax._src.distributed.agreement import Agreement

    def agreed(step, generation):
        return Agreement(generation=3, worker_id=0, process_id=0, num_processes=2,
                         coordinator="c", resume_step=step, survivors=(0, 1),
                         previous_members=(0, 1, 2), sources={}, resume_generation=generation)

    assert wire.SetBuddy.for_world("b", None) == wire.SetBuddy(buddy="b")
    assert wire.SetBuddy.for_world("b", agreed(7, 1)) == wire.SetBuddy(
        buddy="b", resume_step=7, keep_from=1)
    assert wire.SetBuddy.for_world(None, agreed(-1, 0)).keep_from == 3  # from disk
    assert wire.SetBuddy.for_world("b", agreed(7, 1), newest=False).keep_from is None
