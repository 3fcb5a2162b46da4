"""`distributed.launcher.barriers`: each barrier is decided once, the same for everyone."""

from __future__ import annotations

from mnemojax._src.distributed.launcher.barriers import BarrierBook

KEY = (0, "mnemojax-compiled-0")


def test_barrier_passes_when_every_member_has_arrived():
    book = BarrierBook()
    book.arrive(KEY, 2)
    book.arrive(KEY, 0)
    assert book.outcome(KEY, (0, 1, 2), dead=()) is None
    assert book.missing(KEY, (0, 1, 2)) == [1]
    book.arrive(KEY, 1)
    assert book.outcome(KEY, (0, 1, 2), dead=()) == ()
    # Decided: a death afterwards does not change it (it surfaces in the next collective).
    assert book.outcome(KEY, (0, 1, 2), dead={1}) == ()


def test_a_death_before_every_arrival_fails_it_for_everyone():
    book = BarrierBook()
    book.arrive(KEY, 0)
    book.arrive(KEY, 1)  # arrived, then died: it cannot run the next collective
    assert book.outcome(KEY, (0, 1, 2), dead={1}) == (1,)
    book.arrive(KEY, 2)  # a latecomer gets the same outcome, not a pass
    assert book.outcome(KEY, (0, 1, 2), dead={1}) == (1,)
    assert book.outcome(KEY, (0, 1, 2), dead={1, 2}) == (1,)


def test_barriers_of_other_worlds_and_names_are_independent():
    book = BarrierBook()
    book.arrive(KEY, 0)
    assert book.outcome(KEY, (0, 1), dead={1}) == (1,)
    other = (1, "mnemojax-compiled-1")
    book.arrive(other, 0)
    assert book.outcome(other, (0,), dead=()) == ()
