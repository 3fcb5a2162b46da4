"""`distributed.launcher.book`: the barrier and the decision, without processes."""

from __future__ import annotations

import pytest

from mnemojax._src.distributed.agreement import choose_resume_step, held_origin
from mnemojax._src.distributed.launcher.book import AgreementBook
from mnemojax._src.errors import AgreementError
from tests.distributed.agreement_test import copy


def test_book_barrier_waits_for_live_members_only():
    book = AgreementBook(0, [0, 1, 2])
    book.arrive(2, 0, last_step=6)
    assert not book.complete() and book.missing() == [0, 1]
    book.mark_dead(1)
    assert book.missing() == [0]
    book.arrive(0, 0, last_step=6)
    assert book.complete()
    holdings = {"x": [copy(0, 6, [(0, 3)]), copy(1, 6, [(3, 6)]), copy(0, 5, [(0, 6)])],
                "y": [copy(2, 6, [])]}
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
    both = {"a0": [copy(0, 6, [(0, 3)]), copy(1, 6, [(3, 6)])],
            "a1": [copy(1, 6, [(3, 6)]), copy(0, 6, [(0, 3)])]}
    got = homes.decide(coordinator="c", holdings=both, homes={0: "a0", 1: "a1"})[0].sources
    assert got == {0: ("a0", "a1"), 1: ("a1", "a0")}  # each worker's own agent first
    assert book.decide(coordinator="other", holdings={}) is decision  # decided once


def test_resume_step_is_not_newer_than_any_survivors_last_step():
    """Worker 2 holds no shards and its step 6 failed after worker 0's succeeded: resuming
    from 6 would skip worker 2 ahead of its own state, so the survivors resume from 5."""
    book = AgreementBook(0, [0, 1, 2])
    book.arrive(0, 0, last_step=6)
    book.arrive(2, 0, last_step=5)
    book.mark_dead(1)
    holdings = {"x": [copy(0, 5, [(0, 6)]), copy(0, 6, [(0, 6)]), copy(2, 5, [])]}
    assert choose_resume_step(holdings) == (6, 0)
    assert book.decide(coordinator="c", holdings=holdings)[2].resume_step == 5


def test_book_member_dying_at_the_barrier_is_left_out():
    book = AgreementBook(1, [0, 1, 2])
    book.arrive(0, 1, last_step=4)
    book.arrive(1, 1, last_step=4)
    book.mark_dead(1)  # arrived, then died while waiting
    assert book.missing() == [2] and 1 not in book.arrived
    book.arrive(2, 1, last_step=4)
    decision = book.decide(coordinator="c", holdings={"x": [copy(0, 4, [(0, 6)])]})
    assert set(decision) == {0, 2} and decision[2].generation == 2
    book.mark_dead(2)  # after the decision: the next world's book handles it
    assert set(book.decision) == {0, 2}


def test_book_says_which_workers_state_is_lost():
    book = AgreementBook(0, [0, 1, 2, 3])
    for w in (2, 3):
        book.arrive(w, 0, last_step=4)
    book.mark_dead(0)
    book.mark_dead(1)
    holdings = {"a2": [copy(2, 4, [(3, 6)]), copy(1, 3, [(0, 3)])],
                "a3": [copy(3, 3, []), copy(3, 4, [])]}
    decision = book.decide(coordinator="c", holdings=holdings)
    # Worker 1's step 3 survives (its step 4 does not): worker 0 alone has no copy at all.
    assert decision[2].resume_step == -1 and decision[3].lost == (0,)
    assert "workers [0]" in decision[3].why
    # Worker 3 holds no shards in world 0: missing its step-4 copy would lose nothing.
    del holdings["a3"][1]
    again = AgreementBook(0, [0, 1, 2, 3])
    for w in (2, 3):
        again.arrive(w, 0, last_step=4)
    again.mark_dead(0)
    again.mark_dead(1)
    assert again.decide(coordinator="c", holdings=holdings)[2].lost == (0,)
    assert decision[2].sources == {} and decision[2].survivors == (2, 3)
    # A second round over a world that never formed ({2, 3}): the newest copies are of
    # world 0, so its members are the ones named.
    again = AgreementBook(1, [2, 3])
    for w in (2, 3):
        again.arrive(w, 1, last_step=4)
    decision = again.decide(coordinator="c", holdings=holdings,
                            members_of={0: (0, 1, 2, 3), 1: (2, 3)})
    assert decision[2].lost == (0,)
    # Every worker has some copy, but none of worker 1 at the newest step: it is named.
    holdings["a2"].append(copy(0, 3, [(0, 3)]))
    again = AgreementBook(0, [0, 1, 2, 3])
    for w in (2, 3):
        again.arrive(w, 0, last_step=4)
    again.mark_dead(0)
    again.mark_dead(1)
    decision = again.decide(coordinator="c", holdings=holdings)
    assert decision[2].lost == (0, 1)
    assert "each worker has copies, but none of step 4 of workers [0, 1]" in decision[2].why


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


def test_resume_step_must_be_replayable_by_every_survivor():
    """A survivor that keeps only the batches from step 6 on cannot resume from step 4: with
    nothing newer complete in memory, the decision says so (then Orbax or a typed error)."""
    book = AgreementBook(0, [0, 1])
    book.arrive(0, 0, last_step=6, first_replayable=6)
    book.arrive(1, 0, last_step=6, first_replayable=3)
    holdings = {"x": [copy(0, 4, [(0, 3)]), copy(1, 4, [(3, 6)])]}
    assert choose_resume_step(holdings, min_step=5) is None
    decision = book.decide(coordinator="c", holdings=holdings)[0]
    assert decision.resume_step == -1 and decision.lost == ()
    assert "older than step 5" in decision.why
    # A newer step of one worker alone does not hide that: step 4 is whole, too old.
    holdings["x"].append(copy(0, 6, [(0, 3)]))
    again = AgreementBook(0, [0, 1])
    again.arrive(0, 0, last_step=6, first_replayable=6)
    again.arrive(1, 0, last_step=6, first_replayable=3)
    decision = again.decide(coordinator="c", holdings=holdings)[0]
    assert decision.resume_step == -1 and decision.lost == ()
    assert "older than step 5" in decision.why


def test_spares_take_the_ranks_of_the_dead_when_there_are_enough():
    holdings = {"x": [copy(0, 6, [(0, 6)])]}

    def decide(joiners):
        book = AgreementBook(0, [0, 1, 2])
        book.arrive(0, 0, last_step=6)
        book.arrive(2, 0, last_step=6)
        book.mark_dead(1)
        return book.decide(coordinator="c", holdings=holdings, joiners=joiners)

    full = decide([7, 8])  # one dead, two spares: the first takes worker 1's rank
    assert set(full) == {0, 7, 2}
    assert [full[w].process_id for w in (0, 7, 2)] == [0, 1, 2]
    assert full[0].survivors == (0, 7, 2) and full[0].num_processes == 3
    assert full[7].replaces == {7: 1} and full[7].resume_step == 6
    shrunk = decide([])  # no spare: the world shrinks, ranks close up
    assert shrunk[2].process_id == 1 and shrunk[2].replaces == {}
    book = AgreementBook(0, [0, 1, 2])  # two dead, one spare: not enough, none joins
    book.arrive(0, 0, last_step=6)
    book.mark_dead(1)
    book.mark_dead(2)
    assert book.decide(coordinator="c", holdings=holdings, joiners=[7])[0].survivors == (0,)


def test_a_shrunk_world_grows_back_to_world_0s_layout_when_spares_fill_every_slot():
    """World 1 = [3, 1] (worker 3 holds slot 3, worker 1 slot 1; slots 0 and 2 free):
    with two joiners, world 2 has world 0's size and every member is at its slot's rank;
    with one, nobody joins (a fresh process's mesh fits world 0's size only)."""
    holdings = {"x": [copy(3, 6, [(0, 6)])]}
    slots = {0: 0, 1: 1, 2: 2, 3: 3}

    def decide(joiners, dead=()):
        book = AgreementBook(1, [3, 1])
        for w in (3, 1):
            if w in dead:
                book.mark_dead(w)
            else:
                book.arrive(w, 1, last_step=6)
        return book.decide(coordinator="c", holdings=holdings, joiners=joiners,
                           slots=slots, full_size=4)

    grown = decide([8, 9])
    assert grown[1].survivors == (8, 1, 9, 3) and grown[1].num_processes == 4
    assert [grown[w].process_id for w in (8, 1, 9, 3)] == [0, 1, 2, 3]
    assert grown[8].replaces == {8: 0, 9: 2} and grown[8].resume_step == 6
    assert decide([8])[1].survivors == (3, 1)  # one joiner for two free slots: none
    # A member dying in the same formation frees its slot too: three joiners fill it.
    assert decide([8, 9, 10], dead=(3,))[1].survivors == (8, 1, 9, 10)
    assert decide([8, 9], dead=(3,))[1].survivors == (1,)


def test_a_survivors_held_copy_covers_what_a_lost_host_and_its_buddy_took():
    """Hosts 0 and 1 lost: worker 0's snapshot (columns 0-3; worker 1 owned 3-6) is gone
    with its buddy. Survivors 2 and 3 hold replicas of every column (held copies, listed
    under `held_origin`): step 4 is still complete, from them. Where the snapshots cover
    a region, a held copy is not named; of two held copies of one region, the first."""
    def decide(holdings):
        book = AgreementBook(0, [0, 1, 2, 3])
        for w in (2, 3):
            book.arrive(w, 0, last_step=4)
        book.mark_dead(0)
        book.mark_dead(1)
        return book.decide(coordinator="c", holdings=holdings)[2]

    held = {"a2": [copy(2, 4, []), copy(held_origin(2), 4, [(0, 3), (3, 6)])],
            "a3": [copy(3, 4, []), copy(held_origin(3), 4, [(0, 3), (3, 6)])]}
    agreed = decide(held)
    assert agreed.resume_step == 4 and agreed.lost == ()
    assert agreed.sources == {held_origin(2): ("a2",)}
    # Worker 1's snapshot survives (columns 3-6): a held copy is still needed for 0-3.
    agreed = decide({**held, "b1": [copy(1, 4, [(3, 6)])]})
    assert agreed.sources == {1: ("b1",), held_origin(2): ("a2",)}
    # Every region in a snapshot: no held copy is named.
    agreed = decide({**held, "b0": [copy(0, 4, [(0, 3)])], "b1": [copy(1, 4, [(3, 6)])]})
    assert agreed.sources == {0: ("b0",), 1: ("b1",)}
    # Without held copies the same loss loses worker 0's and 1's state.
    assert decide({a: [c for c in cs if c.origin >= 0] for a, cs in held.items()}).lost \
        == (0, 1)
    # A held copy names no worker: one of a newer step than any snapshot (past the
    # survivors' last step) does not make every member look lost.
    # Here worker 2 owns columns 0-3 (worker 0 owned 3-6, lost).
    newer = {"a2": [copy(2, 4, [(0, 3)]), copy(held_origin(2), 5, [(3, 6)])],
             "a3": [copy(3, 4, [])]}
    agreed = decide(newer)
    assert agreed.resume_step == -1 and agreed.lost == (0, 1), agreed


def test_the_worlds_whose_copies_a_new_world_keeps():
    """`Agreement.keep_from` (what the launchers send the agents): a world formed from
    world 1's copies of step 7 keeps copies of world 1 on, not world 0's, though world 0
    held a whole step 6 too (an older complete step: only a fall-back); a world formed
    with no step held whole keeps only its own."""
    book = AgreementBook(2, [0, 1])
    for w in (0, 1):
        book.arrive(w, 2, last_step=7)
    holdings = {"x": [copy(0, 6, [(0, 6)], generation=0), copy(0, 7, [(0, 3)], generation=1),
                      copy(1, 7, [(3, 6)], generation=1)]}
    agreed = book.decide(coordinator="c", holdings=holdings)[0]
    assert (agreed.resume_step, agreed.resume_generation, agreed.keep_from) == (7, 1, 1)
    lost = AgreementBook(2, [0, 1])
    for w in (0, 1):
        lost.arrive(w, 2, last_step=7)
    nothing = lost.decide(coordinator="c", holdings={"x": [copy(0, 7, [(0, 3)], 1)]})[1]
    assert (nothing.resume_step, nothing.generation, nothing.keep_from) == (-1, 3, 3)
