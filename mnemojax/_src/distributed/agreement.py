"""Agreement among survivors: who is alive, which step to resume from, the new world.

Protocol (one round per failure; ``generation`` counts worlds, 0 at launch):

1. A survivor that sees a failure (a collective error, ``ProcessFailureError``) detaches
   from world g (client shutdown, backends cleared: clients first) and calls
   ``agree(generation=g, last_step=k)``. **Barrier:** the call returns only when every member
   of world g has either called ``agree`` for g or been declared dead (its agent saw the exit,
   its agent vanished, the hang watchdog fired, or it missed the agreement deadline, after
   which it is killed: an evicted member can never come back into a later world).
2. The coordinator then decides once for everyone (**atomic:** every survivor of world g gets
   the same `Agreement`, or every call raises `AgreementError`): the survivors in old rank
   order become ranks 0..n-1 of world g+1; the resume step is the newest step s whose
   copies on live agents (a worker's own agent or its ring buddy), each verified against its
   CRC32C when the agents are asked, cover every element of every leaf (`choose_resume_step`),
   so a recovery never mixes steps across hosts and never restores a corrupt copy. A worker
   whose shards are all replicated elsewhere need not have a copy. The copies include the
   survivors' *held* copies (`held_origin`): at the failure each survivor hands its agent
   the regions of the last good state its devices hold that its snapshot lacks, so a host
   lost together with its ring buddy loses nothing a third survivor still holds; a held
   copy is named among the sources only where the snapshots leave a region uncovered. When no step is complete,
   the decision says which workers' state is lost (``resume_step == -1``).
   Every arrival has detached, so the coordinator then stops world g's service (service
   last) and has already started world g+1's.
3. Each survivor joins world g+1 (its ``connect`` is itself a barrier over world g+1),
   restores state of step s from the agents named in ``sources``, and replays from s+1.

A member that dies while waiting at the barrier leaves it (it is not put into world g+1). One
that dies after the decision never joins world g+1: the others' ``connect`` times out and they
agree again, over world g+1 (a second round; `worker.recovery.recover_world`). One that
dies after world g+1 formed is an ordinary failure of world g+1 (the resilient step
recovers again).

This module holds what both sides share, pure: the decision (`Agreement`), what a copy
covers (`CopyInfo`) and the coverage rule (`missing_leaves`, `choose_resume_step`). The
worker talks to the coordinator through `worker.coordinator_client.Coordinator`
(`LauncherCoordinator` on one machine; a later issue can put the same two calls on etcd);
the launcher decides with `launcher.book.AgreementBook` (tested without processes) and
runs the barrier in `launcher.arbiter.Arbiter`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

# The last step of a process that joins from its agents' copies (restarted, or a spare):
# any step the copies cover will do.
ANY_STEP = 2**62


def held_origin(worker_id: int) -> int:
    """The origin under which worker ``worker_id``'s *held* copy is listed: the regions of
    the last good state its devices held at a failure that its own snapshot lacks
    (data-parallel replicas), handed to its agent then (`wire.Hold`). Negative, so it never
    names a worker: ``-1 - worker_id``."""
    return -1 - worker_id


def snapshots_first(origins: Iterable[int]) -> list[int]:
    """Copy origins in the order a restore takes regions from them: every worker's
    snapshot by worker id, then the held copies (`held_origin`), each only for what no
    copy before it has (`launcher.book` names them so, `worker.recovery.AgreedCopies`
    fetches so)."""
    return sorted(origins, key=lambda o: (o < 0, abs(o)))


def compiled_barrier(generation: int) -> str:
    """The name of the barrier every member of world ``generation`` passes after its first
    compile (`worker.session.DistributedSession.compiled`): passed, the world has formed."""
    return f"mnemojax-compiled-{generation}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Agreement:
    """What every survivor of world ``generation - 1`` agreed on.

    Attributes:
        generation: the new world's generation.
        worker_id: the caller's stable id (its host slot; survives renumbering).
        process_id: the caller's rank in the new world.
        num_processes: size of the new world.
        coordinator: ``host:port`` of the new world's coordination service.
        resume_step: the step whose state every survivor restores (then replays s+1...);
            -1 when no step's state is complete anywhere (see ``lost``).
        resume_generation: the world that produced those copies (a step replayed in a
            newer world has copies of both; the fetched payloads must all be of this one).
        survivors: worker ids in new rank order.
        previous_members: worker ids of the old world in old rank order.
        sources: ``origin worker id -> agent addresses`` holding a verified copy of that
            worker's snapshot of ``resume_step`` (first = preferred). Only the origins whose
            shards are needed: together they cover every leaf. A negative origin is a
            survivor's held copy (`held_origin`), named only for regions no snapshot has.
        lost: when ``resume_step == -1``, the old members whose shards no live agent holds
            a verified copy of (their agent and ring buddy are gone, or the copies are
            corrupt, and no survivor's held copy makes up for them). The survivors still form the new world, then fall back to the
            persistent tier or raise a typed error.
        why: when ``resume_step == -1``, why no in-memory state can be used.
        replaces: joiner worker id -> the dead member whose rank (and so whose devices'
            places in the mesh) it takes: a spare that keeps the world at full size. In
            a world that grows back to world 0's size (``num_processes`` above the old
            world's), joiner -> the world-0 worker whose slot it takes; every member is
            then at its world-0 rank. A joiner is a fresh process: it takes the agreed
            state at ``step.restore()``.
    """

    generation: int
    worker_id: int
    process_id: int
    num_processes: int
    coordinator: str
    resume_step: int
    survivors: tuple[int, ...]
    previous_members: tuple[int, ...]
    sources: Mapping[int, tuple[str, ...]]
    lost: tuple[int, ...] = ()
    resume_generation: int = 0
    why: str = ""
    replaces: Mapping[int, int] = dataclasses.field(default_factory=dict)

    @property
    def resume_said(self) -> str:
        """Where the world resumes from, for a log line."""
        if self.resume_step >= 0:
            return f"from step {self.resume_step}"
        return ("from the persistent checkpoint, if any (no complete copy in memory"
                + (f": workers {list(self.lost)} lost" if self.lost else "") + ")")

    @property
    def keep_from(self) -> int:
        """The oldest world whose snapshot copies a later agreement can still choose: the
        resumed copies' world, or this world when none was complete (`wire.SetBuddy`)."""
        return self.resume_generation if self.resume_step >= 0 else self.generation


@dataclasses.dataclass(frozen=True)
class CopyInfo:
    """What one verified snapshot copy covers (from its metadata, `snapshot_codec.read_meta`;
    an agent sends these to the launcher in `wire.Holdings`).

    Attributes:
        origin: the worker whose shards these are.
        step / generation: the step, and the world (one mesh) that produced it.
        num_leaves: leaves in the whole state.
        shards: ``(leaf, global shape, index)`` per shard, index ``((start, stop), ...)``.
    """

    origin: int
    step: int
    generation: int
    num_leaves: int
    shards: tuple[tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]], ...]

    @classmethod
    def from_meta(cls, origin: int, meta: Mapping) -> CopyInfo:
        """Reads a payload's metadata.

        Raises:
            KeyError, TypeError, ValueError: the metadata is not a snapshot's.
        """
        return cls(origin, int(meta["step"]), int(meta.get("generation", 0)),
                   int(meta["num_leaves"]),
                   tuple((int(m["leaf"]), tuple(int(d) for d in m["shape"]),
                          tuple((int(a), int(b)) for a, b in m["index"]))
                         for m in meta["shards"]))


def missing_leaves(copies: Iterable[CopyInfo]) -> list[int]:
    """Leaves not fully covered by the shards of ``copies`` (all of one step and world).

    Shards of one mesh are equal or disjoint, so a leaf is covered when its distinct shards'
    volumes add up to the leaf's size.
    """
    copies = list(copies)
    if not copies:
        return []
    boxes: dict[int, set[tuple[tuple[int, int], ...]]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for c in copies:
        for leaf, shape, index in c.shards:
            boxes.setdefault(leaf, set()).add(index)
            shapes[leaf] = shape
    return [leaf for leaf in range(copies[0].num_leaves)
            if leaf not in boxes or sum(math.prod(b - a for a, b in index)
                                        for index in boxes[leaf]) < math.prod(shapes[leaf])]


def choose_resume_step(holdings: Mapping[str, Sequence[CopyInfo]], *,
                       max_step: int | None = None,
                       min_step: int | None = None) -> tuple[int, int] | None:
    """The newest (step, generation) whose verified copies on live agents cover every leaf.

    Copies of the same step from a newer world (a replayed step) are preferred. None: no
    step is complete anywhere.

    Args:
        holdings: agent address -> the verified copies it holds.
        max_step: no newer step than this (the oldest survivor's last completed step: a
            survivor whose step failed after a peer's succeeded must not be skipped ahead).
        min_step: no older step than this (every survivor must still keep the batches to
            replay from it).
    """
    groups: dict[tuple[int, int], list[CopyInfo]] = {}
    for copies in holdings.values():
        for c in copies:
            if (max_step is None or c.step <= max_step) and (
                    min_step is None or c.step >= min_step):
                groups.setdefault((c.step, c.generation), []).append(c)
    complete = [key for key, copies in groups.items() if not missing_leaves(copies)]
    return max(complete) if complete else None
