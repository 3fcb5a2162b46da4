"""`distributed.worker.recovery`: agreement rounds, with a fake coordinator."""

from __future__ import annotations

import dataclasses
import threading
import time

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agreement import Agreement
from mnemojax._src.distributed.env import WorldSpec
from mnemojax._src.distributed.snapshot_codec import pack
from mnemojax._src.distributed.worker import coordination
from mnemojax._src.distributed.worker.recovery import recover_world
from mnemojax._src.errors import StateUnavailableError


class _Coordinator:
    """Decides world g+1 with both workers, then (a member having died) world g+2."""

    def __init__(self):
        self.calls = []

    def report_failure(self, *, generation, reason):
        self.calls.append(("report", generation))

    def watch(self, *, generation, timeout_s):  # no death heard of during a connect
        time.sleep(timeout_s)
        return wire.WorldFailed(generation=generation, failed=())

    def agree(self, *, generation, last_step, first_replayable=None):
        self.calls.append(("agree", generation))
        members = (0, 1) if generation == 0 else (0,)
        return Agreement(generation=generation + 1, worker_id=0, process_id=0,
                         num_processes=len(members), coordinator=f"127.0.0.1:{9000 + generation}",
                         resume_step=-1, survivors=members, previous_members=(0, 1, 2),
                         sources={}, lost=(2,), why="test")


def _recover(monkeypatch, coordinator, attach, *, attach_timeout_s):
    """`recover_world` of process 0 of a world of 3 after a failure, with ``attach`` for
    `coordination.attach_worker`."""
    monkeypatch.setattr(coordination, "detach_worker", lambda: None)
    monkeypatch.setattr(coordination, "attach_worker", attach)
    world = WorldSpec(coordinator="127.0.0.1:1", process_id=0, num_processes=3,
                      attach_timeout_s=attach_timeout_s)
    return recover_world(coordinator, world, last_step=4, reason="peer died")


def test_a_world_that_does_not_form_is_agreed_again(monkeypatch):
    """connect of world 1 times out (a member died after the decision): the survivor
    reports it and agrees again over world 1; world 2 forms."""
    attached = []

    def attach(world, *, init_timeout_s, cannot_form):
        attached.append((world.generation, init_timeout_s))
        if world.generation == 1:
            raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")

    coordinator = _Coordinator()
    rec = _recover(monkeypatch, coordinator, attach, attach_timeout_s=7)
    assert rec.rounds == 2 and rec.world.generation == 2 and rec.world.num_processes == 1
    assert rec.members == (0, 1, 2)  # the world that failed, not the one that never formed
    assert attached == [(1, 7), (2, 7)]
    assert coordinator.calls == [("report", 0), ("agree", 0), ("report", 1), ("agree", 1)]


def test_a_survivor_that_cannot_fetch_stays_out_and_agrees_again(monkeypatch):
    """Every source of the agreed copy died since the decision: the survivor does not join
    that world (so it cannot form for anyone) and goes straight to the next agreement."""
    from mnemojax._src.distributed.worker import recovery as dist_recovery

    attached, fetches = [], []

    class Sourced(_Coordinator):
        def agree(self, **kw):
            a = super().agree(**kw)
            return dataclasses.replace(a, resume_step=4, sources={0: ("127.0.0.1:1",)},
                                       lost=(), why="")

    def fetch(addrs, origin, step, *, secret, header_only):
        assert secret == b"k" * 32 and header_only  # only what each copy covers, not it
        fetches.append(addrs)
        if len(fetches) == 1:
            raise StateUnavailableError("no copy of worker 0 step 4: refused")
        return bytearray(b"".join(bytes(p) for p in pack(4, 0, [], num_leaves=0))), addrs[0]

    monkeypatch.setattr(coordination, "detach_worker", lambda: None)
    monkeypatch.setattr(coordination, "attach_worker",
                        lambda world, *, init_timeout_s, cannot_form: attached.append(world.generation))
    monkeypatch.setattr(dist_recovery, "fetch_snapshot", fetch)
    coordinator = Sourced()
    rec = recover_world(coordinator, WorldSpec(coordinator="127.0.0.1:1", process_id=0,
                                               num_processes=3, secret=b"k" * 32),
                        last_step=4)
    assert rec.rounds == 2 and attached == [2] and list(rec.state.headers) == [0]
    assert coordinator.calls == [("report", 0), ("agree", 0), ("report", 1), ("agree", 1)]


def test_a_fresh_process_joins_the_given_world_or_agrees_again_tracing_replacements(
        monkeypatch):
    """A spare given world 1 (in place of worker 0): world 1 does not form, so it agrees
    again over world 1 with any step; world 2 has spare 5 in place of spare 4, which
    traces back to worker 0 of the world that failed first."""
    from mnemojax._src.distributed.agreement import ANY_STEP
    from mnemojax._src.distributed.worker.recovery import join_world

    def agreement(generation, survivors, previous, replaces):
        return Agreement(generation=generation, worker_id=4, process_id=0,
                         num_processes=2, coordinator=f"127.0.0.1:{9000 + generation}",
                         resume_step=-1, survivors=survivors, previous_members=previous,
                         sources={}, replaces=replaces)

    agreed = []

    class Again(_Coordinator):
        def report_failure(self, *, generation, reason):
            agreed.append(("report", generation))

        def agree(self, *, generation, last_step, first_replayable=None):
            agreed.append(("agree", generation, last_step))
            return agreement(2, (5, 1), (4, 1), {5: 4})

    def attach(world, *, init_timeout_s, cannot_form):
        if world.generation == 1:
            raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")

    monkeypatch.setattr(coordination, "attach_worker", attach)
    world = WorldSpec(coordinator="127.0.0.1:1", process_id=0, num_processes=2,
                      generation=1, attach_timeout_s=7)
    rec = join_world(Again(), world, agreement(1, (4, 1), (0, 1), {4: 0}))
    assert rec.rounds == 2 and rec.world.generation == 2
    assert agreed == [("report", 1), ("agree", 1, ANY_STEP)]
    assert rec.members == (0, 1) and rec.replaces == {5: 0}


def test_a_recovery_continued_by_another_agreement_keeps_the_world_that_failed():
    """Processes that the new mesh leaves idle leave; the others agree again over the world
    they formed. The result plans from the world that failed first: its members, each
    joiner traced back to the member it replaces, phases and rounds summed."""
    from mnemojax._src.distributed.worker.recovery import AgreedCopies, WorldRecovery

    def rec(generation, members, survivors, replaces, rounds):
        agreement = Agreement(generation=generation, worker_id=0, process_id=0,
                              num_processes=len(survivors), coordinator="127.0.0.1:1",
                              resume_step=3, survivors=survivors, previous_members=members,
                              sources={}, replaces=replaces)
        world = WorldSpec(coordinator="127.0.0.1:1", process_id=0,
                          num_processes=len(survivors), generation=generation)
        copies = AgreedCopies(3, generation - 1, {}, {}, b"")
        return WorldRecovery(agreement, world, copies, {"agree": 1.0, "attach": 0.5},
                             rounds, members, replaces)

    first = rec(1, (0, 1, 2, 3), (0, 5, 2), {5: 1}, 1)  # spare 5 took worker 1's place
    later = rec(2, (0, 5, 2), (0, 6), {6: 5}, 2)  # 2 left; spare 6 took 5's place
    both = first.then(later)
    assert both.members == (0, 1, 2, 3) and dict(both.replaces) == {6: 1}
    assert both.agreement is later.agreement and both.world is later.world
    assert both.rounds == 3 and both.phases == {"agree": 2.0, "attach": 1.0}


def test_a_member_known_dead_before_the_world_formed_starts_the_next_round(monkeypatch):
    """The launcher tells of world 1's member 1 dying before world 1 formed: the
    survivor's connect is given up (`coordination_test.py` has the real connect) and it
    agrees again over world 1, saying why."""

    class Told(_Coordinator):
        def __init__(self):
            super().__init__()
            self.reasons = []

        def report_failure(self, *, generation, reason):
            super().report_failure(generation=generation, reason=reason)
            self.reasons.append(reason)

        def watch(self, *, generation, timeout_s):
            if generation == 1:
                return wire.WorldFailed(generation=1, failed=(1,))
            return super().watch(generation=generation, timeout_s=timeout_s)

    def attach(world, *, init_timeout_s, cannot_form):
        if world.generation == 1:  # the connect would block for the timeout
            raise coordination.ConnectAbandoned(
                f"world 1 cannot form: {cannot_form.result(timeout=10)}", threading.Thread())

    coordinator = Told()
    rec = _recover(monkeypatch, coordinator, attach, attach_timeout_s=3600)
    assert rec.rounds == 2 and rec.world.generation == 2
    assert coordinator.calls == [("report", 0), ("agree", 0), ("report", 1), ("agree", 1)]
    assert "workers [1] died before it formed (told by the launcher)" in coordinator.reasons[1]


def test_the_members_watch_waits_out_a_poll_that_heard_nothing():
    """A long poll that returns at once with nothing for the connect (a regrow asked for:
    the world can still form) is not asked again at once: 2 polls in 0.5 s, not a busy
    loop (a review counted 416,335 in 1 s)."""
    from mnemojax._src.distributed.worker.recovery import _MembersWatch

    calls = []

    class Regrow:
        def watch(self, *, generation, timeout_s):
            calls.append(generation)
            return wire.WorldFailed(generation=generation, failed=(), regrow=True)

    watch = _MembersWatch(Regrow(), 1)
    time.sleep(0.5)
    watch.stop()
    assert 1 <= len(calls) <= 2 and not watch.heard.done()
