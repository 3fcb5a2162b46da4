"""`distributed.agreement`: what a copy covers and which step every survivor resumes from."""

from __future__ import annotations

import pytest

from mnemojax._src.distributed.agreement import (
    Agreement,
    CopyInfo,
    choose_resume_step,
    missing_leaves,
)


def copy(origin, step, cols, generation=0, num_leaves=1):
    """A copy of leaf 0 (shape (2, 6)) holding columns ``cols`` = (start, stop) pairs."""
    return CopyInfo(origin, step, generation, num_leaves,
                    tuple((0, (2, 6), ((0, 2), c)) for c in cols))


def test_missing_leaves_counts_distinct_shards_once():
    assert missing_leaves([copy(0, 5, [(0, 3)]), copy(1, 5, [(3, 6)])]) == []
    # A replica of the same shard does not make up for a missing one.
    assert missing_leaves([copy(0, 5, [(0, 3)]), copy(1, 5, [(0, 3)])]) == [0]
    assert missing_leaves([copy(0, 5, [(0, 6)], num_leaves=2)]) == [1]


def test_resume_step_is_newest_step_whose_copies_cover_the_state():
    holdings = {"a0": [copy(0, 5, [(0, 3)]), copy(0, 6, [(0, 3)]), copy(2, 6, [])],
                "a1": [copy(1, 5, [(3, 6)]), copy(0, 5, [(0, 3)])],
                "a2": [copy(1, 6, [(3, 6)])]}
    assert choose_resume_step(holdings) == (6, 0)
    del holdings["a2"]  # 1's step-6 shards are gone: step 5 is the newest complete one
    assert choose_resume_step(holdings) == (5, 0)
    assert choose_resume_step({"a0": [copy(0, 6, [(0, 3)])]}) is None
    # The same step replayed in a newer world is preferred (its own mesh, its own tiling).
    holdings["a3"] = [copy(0, 5, [(0, 6)], generation=1)]
    assert choose_resume_step(holdings) == (5, 1)


def test_copy_info_from_a_payloads_metadata():
    meta = {"step": 4, "worker_id": 1, "num_leaves": 2, "generation": 3,
            "shards": [{"leaf": 1, "shape": [2, 6], "dtype": "<f4",
                        "index": [[0, 2], [3, 6]], "offset": 0, "nbytes": 24}]}
    assert CopyInfo.from_meta(1, meta) == CopyInfo(1, 4, 3, 2, ((1, (2, 6), ((0, 2), (3, 6))),))
    with pytest.raises(KeyError):
        CopyInfo.from_meta(1, {"step": 4})


def test_a_world_with_no_copy_to_resume_from_is_said_as_a_checkpoint_fallback():
    """The launchers log where a world resumes: a step, or, with no complete copy in
    memory (``resume_step == -1``: e.g. a world formed before the first publish after a
    restore), the persistent checkpoint (a user trial read "from step -1")."""
    def agreement(step, lost=()):
        return Agreement(generation=1, worker_id=0, process_id=0, num_processes=2,
                         coordinator="h:1", resume_step=step, survivors=(0, 1),
                         previous_members=(0, 1, 2), sources={}, lost=lost)
    assert agreement(4).resume_said == "from step 4"
    assert agreement(-1).resume_said == ("from the persistent checkpoint, if any (no "
                                         "complete copy in memory)")
    assert agreement(-1, (2,)).resume_said.endswith("memory: workers [2] lost)")
