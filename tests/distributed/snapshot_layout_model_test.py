"""The snapshot-layout model (`tests.jobs.snapshot_layout_model`) against the layout the
agents run today, and the layouts WORKSPACE_NOTES weighs for issue 12's memory target."""

from __future__ import annotations

import pytest

from mnemojax._src.distributed import shm
from mnemojax._src.distributed.agent.replica_store import ReplicaStore
from tests.jobs.snapshot_layout_model import Protocol, State, check, describe

# The agents' layout: two own slots, two replicas kept, the copy sent straight from its
# slot; in series the buddy makes room before a copy arrives.
TODAY = dict(own_slots=shm.NUM_SLOTS, keep=ReplicaStore().keep, zero_copy=True)


def _shares(nbytes: int) -> int:
    return round(nbytes / (1 << 30))


def test_todays_layout_in_series_survives_any_host_loss_at_its_counted_memory():
    result = check(Protocol("series", make_room=True, **TODAY))
    assert result.safe, describe(result.unrecoverable[0])
    assert result.max_steps_lost == 1
    # The agent's own accounting of its peak (`shm.agent_peak_bytes`, margins aside) and
    # the 4x at rest measured by `tests.jobs.agent_memory`.
    assert result.peak_units == _shares(shm.agent_peak_bytes(1 << 30, 1 << 30, in_series=True))
    assert result.rest_units == 4 == result.peak_units


def test_the_default_order_has_the_window_the_notes_name_and_making_room_needs_series():
    """The same layout without the wait in series loses a step, with or without room made
    first: a lost host's last copy still on the wire while a peer whose buddy it was
    overwrites the step everyone else must go back to. Its peak is the default
    `agent_peak_bytes` (no room made)."""
    result = check(Protocol("sync", **TODAY))
    assert not result.safe
    s: State = result.unrecoverable[0]
    assert s.dead is not None
    assert any(w.done > min(v.done for i, v in enumerate(s.workers) if i != s.dead)
               for w in s.workers)
    assert result.peak_units == _shares(shm.agent_peak_bytes(1 << 30, 1 << 30)) == 5
    assert not check(Protocol("sync", make_room=True, **TODAY)).safe


@pytest.mark.parametrize("protocol", [
    Protocol("lag", 1, 1),  # session 10's design as written
    Protocol("lag", 1, 1, live_source=True),
    Protocol("series", 2, 1),
    Protocol("series", 1, 2, live_source=True),
], ids=str)
def test_layouts_under_4x_lose_a_step_when_survivors_abandon_their_step(protocol):
    """The lost worker completed a step whose copy replaced its older one at its buddy,
    while the survivors abandoned that step: nothing holds the older one anymore."""
    result = check(protocol)
    assert not result.safe
    assert result.rest_units < 4


@pytest.mark.parametrize("protocol, rest, peak", [
    (Protocol("lag", 1, 2, live_source=True), 3, 4),
    (Protocol("series", 2, 1, finish_inflight=True), 3, 5),
    (Protocol("lag", 1, 1, live_source=True, finish_inflight=True), 2, 3),
    (Protocol("lag", 1, 2, live_source=True, make_room=True), 3, 3),
], ids=str)
def test_the_layouts_under_4x_that_survive_and_what_they_assume(protocol, rest, peak):
    result = check(protocol)
    assert result.safe, describe(result.unrecoverable[0])
    assert (result.rest_units, result.peak_units) == (rest, peak)
