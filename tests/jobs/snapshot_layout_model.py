"""An exhaustive model of where snapshot copies live, to check layouts before building them.

Every interleaving of a few workers in lockstep (each on its own host, ring buddy
``w + 1``), their publishes, the agents' replication, and the loss of one whole host at
any moment is explored. A state after the loss is *recoverable* when some step ``r`` no
newer than every survivor's last completed step (the agreement's ``max_step``) has a
complete copy of every worker's shards: a survivor's in its own agent's slots (or, where
the protocol says so, in its live arrays), a lost worker's at its buddy's agent. Host
memory is counted in units of one worker's share.

Protocols (``Protocol.kind``):

- ``sync``: the default order (`session.publish`): a publish of ``k`` waits until the
  buddy holds ``k - 1``, writes the oldest of the own slots, returns; the agent's
  replicator sends the newest published step while the next step runs (out of a copy of
  the slot before session 11, straight from the slot since: ``zero_copy``).
- ``series``: `SnapshotOptions.replicate_in_series`: the publish writes its slot, then
  waits until the buddy holds ``k``.
- ``lag``: the design in WORKSPACE_NOTES ("Design toward issue 12's memory target"):
  after step ``N``, rewrite the one own slot in place from ``N - 1``'s arrays, then send
  ``N`` straight from the step's outputs (streamed: no share on the sender) and wait for
  the buddy's ack; the buddy double-buffers the replica only while one arrives.

The agents today: ``series`` or ``sync`` with 2 own slots, 2 kept, ``zero_copy``, and
``make_room`` in series (`tests/distributed/snapshot_layout_model_test.py` builds them
from the product's constants).

What the model leaves out: wait timeouts (a wait that gives up is the documented residual
window; in series the worker then stops asking for room), corrupt copies, held copies of
data-parallel replicas, the persistent tier, and everything after the first failure (a
second world, its replays and new buddies, resends): one failure from steady training.

``PYTHONPATH=. python -m tests.jobs.snapshot_layout_model`` prints the table quoted in
WORKSPACE_NOTES.md; ``tests/distributed/snapshot_layout_model_test.py`` checks it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import deque
from typing import NamedTuple

TORN = -1  # an own slot being written: neither its old nor its new step is whole


@dataclasses.dataclass(frozen=True)
class Protocol:
    """One layout and publish order.

    Attributes:
        kind: ``sync``, ``series`` or ``lag`` (module docstring).
        own_slots: own-copy slots per agent.
        keep: the buddy's replicas kept per origin (one more while one arrives).
        live_source: whether a survivor's live arrays of its last completed step count as
            a source of its own shards (today they do not: a held copy adds only regions
            its snapshot lacks).
        finish_inflight: whether a survivor finishes a step whose collectives completed
            before the loss, instead of abandoning it when it learns of the loss. Then a
            step's collectives are one event for every worker; without it, a survivor may
            complete a step the lost worker had dispatched, or abandon it, either way (a
            lost host's last sends of a collective can be lost with it, so a worker
            that completed a step does not prove its peers can).
        zero_copy: whether the replicator sends straight from the slot (the agents do
            since session 11; before, they read the copy out first: one more share on the
            sender while it is on the wire).
        make_room: whether the buddy drops its oldest copy of the origin when a new one
            starts to arrive (the agents do for a worker in series since session 11;
            otherwise once it has arrived whole and checked).
    """

    kind: str
    own_slots: int
    keep: int
    live_source: bool = False
    finish_inflight: bool = False
    zero_copy: bool = False
    make_room: bool = False

    def __str__(self) -> str:
        extras = [name for name, on in (
            ("live arrays", self.live_source), ("in-flight step finished", self.finish_inflight),
            ("sent from the slot", self.zero_copy), ("room made first", self.make_room)) if on]
        return f"{self.kind}: {self.own_slots} own + {self.keep} kept" + "".join(
            f", {e}" for e in extras)


class Worker(NamedTuple):
    done: int  # the last step completed
    phase: str  # run | wait_pre | write | wait_post | rewrite | send
    own: tuple[int | None, ...]  # per slot: the step it holds whole, None, or TORN
    writing: int | None  # the step going into the torn slot


class Agent(NamedTuple):
    sent: int  # the newest own step sent (or being sent) to the buddy
    sending: int | None  # the step on the wire to the buddy
    store: frozenset[int]  # the predecessor's steps held whole
    receiving: int | None  # the predecessor's step arriving


class State(NamedTuple):
    workers: tuple[Worker, ...]
    agents: tuple[Agent, ...]
    dead: int | None  # the host lost (worker and agent), if any
    synced: int  # the newest step whose collectives completed (``finish_inflight``)


@dataclasses.dataclass(frozen=True)
class Result:
    protocol: Protocol
    states: int
    unrecoverable: tuple[State, ...]  # the first few found (shortest traces first)
    rest_units: int  # the most host memory when nothing is in flight, in shares
    peak_units: int  # the most at any moment
    max_steps_lost: int  # over recoverable states: the newest step completed - r

    @property
    def safe(self) -> bool:
        return not self.unrecoverable


def _initial(n: int, p: Protocol) -> State:
    own = (0,) + (None,) * (p.own_slots - 1)
    return State(tuple(Worker(0, "run", own, None) for _ in range(n)),
                 tuple(Agent(0, None, frozenset({0}), None) for _ in range(n)), None, 0)


def _whole(own: tuple[int | None, ...]) -> set[int]:
    return {s for s in own if s is not None and s != TORN}


def _oldest_slot(own: tuple[int | None, ...]) -> int:
    return min(range(len(own)), key=lambda i: -1 if own[i] is None else own[i])


def _put(store: frozenset[int], step: int, keep: int) -> frozenset[int]:
    return frozenset(sorted(store | {step})[-keep:])


def _successors(s: State, p: Protocol, n: int, max_step: int):
    workers, agents = list(s.workers), list(s.agents)
    alive = [w for w in range(n) if w != s.dead]

    def with_worker(w: int, **kw) -> State:
        ws = list(workers)
        ws[w] = workers[w]._replace(**kw)
        return s._replace(workers=tuple(ws))

    def buddy_holds(w: int, step: int, st: State) -> bool:
        b = (w + 1) % n
        return b == st.dead or step in st.agents[b].store

    if s.dead is None:
        for h in range(n):
            yield s._replace(dead=h)
        k = s.synced + 1
        if p.finish_inflight and k <= max_step and all(
                v.done == k - 1 and v.phase == "run" for v in workers):
            yield s._replace(synced=k)
    for w in alive:
        wk = workers[w]
        b = (w + 1) % n
        if wk.phase == "run":
            k = wk.done + 1
            # Lockstep: step k completes only once every worker (the lost one too, before
            # it died) has dispatched it.
            if p.finish_inflight:
                can = s.synced >= k
            else:
                can = k <= max_step and all(
                    v.done >= k or (v.done == k - 1 and v.phase == "run") for v in workers)
            if can:
                if p.kind == "lag":
                    if k - 1 in _whole(wk.own):
                        yield with_worker(w, done=k, phase="send")
                    else:
                        yield with_worker(w, done=k, phase="rewrite",
                                          own=(TORN,), writing=k - 1)
                else:
                    yield with_worker(w, done=k, phase="wait_pre")
        elif wk.phase == "wait_pre":
            if p.kind == "series" or buddy_holds(w, wk.done - 1, s):
                slot = _oldest_slot(wk.own)
                own = list(wk.own)
                own[slot] = TORN
                yield with_worker(w, phase="write", own=tuple(own), writing=wk.done)
        elif wk.phase == "write":
            own = tuple(wk.writing if x == TORN else x for x in wk.own)
            yield with_worker(w, phase="wait_post" if p.kind == "series" else "run",
                              own=own, writing=None)
        elif wk.phase == "wait_post":
            if buddy_holds(w, wk.done, s):
                yield with_worker(w, phase="run")
        elif wk.phase == "rewrite":
            yield with_worker(w, phase="send", own=(wk.writing,), writing=None)
        elif wk.phase == "send":
            a = agents[w]
            if a.sending is None and a.sent < wk.done and b != s.dead:
                yield _start_send(s, p, w, wk.done, n)
            if buddy_holds(w, wk.done, s):
                yield with_worker(w, phase="run")
    # The agents' replication of published slots (sync, series): the newest one not sent.
    for w in alive:
        if p.kind == "lag":
            continue
        a, b = agents[w], (w + 1) % n
        newest = max(_whole(workers[w].own), default=-1)
        if a.sending is None and newest > a.sent and b != s.dead:
            yield _start_send(s, p, w, newest, n)
    # A copy on the wire lands whole (the buddy keeps the newest ``keep``), unless the
    # buddy is lost; it is dropped when the sender is.
    for w in range(n):
        a, b = agents[w], (w + 1) % n
        if a.sending is None or b == s.dead:
            continue
        if w == s.dead:
            continue
        ags = list(agents)
        ags[w] = a._replace(sending=None)
        ags[b] = agents[b]._replace(store=_put(agents[b].store, a.sending, p.keep),
                                    receiving=None)
        yield s._replace(agents=tuple(ags))


def _start_send(s: State, p: Protocol, w: int, step: int, n: int) -> State:
    b = (w + 1) % n
    ags = list(s.agents)
    ags[w] = ags[w]._replace(sent=step, sending=step)
    store = ags[b].store
    if p.make_room:
        store = frozenset(sorted(store)[-(p.keep - 1):]) if p.keep > 1 else frozenset()
    ags[b] = ags[b]._replace(store=store, receiving=step)
    return s._replace(agents=tuple(ags))


def _resume_step(s: State, p: Protocol, n: int) -> int | None:
    """The newest step the survivors can resume from, or None."""
    alive = [w for w in range(n) if w != s.dead]
    newest = min(s.workers[w].done for w in alive)
    for r in range(newest, -1, -1):
        if all(_holds(s, p, w, r, n) for w in range(n)):
            return r
    return None


def _holds(s: State, p: Protocol, w: int, step: int, n: int) -> bool:
    """Whether worker ``w``'s shards of ``step`` survive: at its buddy's agent, or (when
    ``w`` lives) in its own agent's slots or its live arrays."""
    b = (w + 1) % n
    if b != s.dead and step in s.agents[b].store:
        return True
    if w == s.dead:
        return False
    wk = s.workers[w]
    return step in _whole(wk.own) or (p.live_source and step == wk.done)


def _units(s: State, p: Protocol, n: int) -> tuple[int, bool]:
    """The most host memory of any live host (shares), and whether nothing is in flight."""
    most, quiet = 0, True
    for w in range(n):
        if w == s.dead:
            continue
        wk, a = s.workers[w], s.agents[w]
        units = sum(x is not None for x in wk.own) + len(a.store)
        units += a.receiving is not None
        if p.kind != "lag" and not p.zero_copy:  # the replicator reads the slot out
            units += a.sending is not None
        quiet &= a.sending is None and a.receiving is None and TORN not in wk.own
        most = max(most, units)
    return most, quiet


def check(p: Protocol, *, workers: int = 3, steps: int = 4, keep_examples: int = 3) -> Result:
    """Explores every interleaving (breadth first) up to ``steps`` steps."""
    start = _initial(workers, p)
    seen, queue = {start}, deque([start])
    bad: list[State] = []
    rest = peak = lost = 0
    while queue:
        s = queue.popleft()
        units, quiet = _units(s, p, workers)
        peak = max(peak, units)
        if quiet:
            rest = max(rest, units)
        # A survivor sees the loss at a wait or a collective: not while it copies.
        # (In series the wait before the copy is skipped: not a wait either.)
        copying = any(s.workers[w].phase in ("write", "rewrite") or (
            p.kind == "series" and s.workers[w].phase == "wait_pre") or (
            p.finish_inflight and s.workers[w].phase == "run" and s.synced > s.workers[w].done)
                      for w in range(workers) if w != s.dead)
        if s.dead is not None and not copying:
            r = _resume_step(s, p, workers)
            if r is None:
                if len(bad) < keep_examples:
                    bad.append(s)
            else:
                newest = max(s.workers[w].done for w in range(workers) if w != s.dead)
                lost = max(lost, newest - r)
        for t in _successors(s, p, workers, steps):
            if t not in seen:
                seen.add(t)
                queue.append(t)
    return Result(p, len(seen), tuple(bad), rest, peak, lost)


PROTOCOLS = (
    Protocol("sync", 2, 2),
    Protocol("series", 2, 2),
    Protocol("series", 2, 1),
    Protocol("series", 1, 2),
    Protocol("series", 1, 2, live_source=True),
    Protocol("series", 2, 1, live_source=True),
    Protocol("lag", 1, 1),
    Protocol("lag", 1, 1, live_source=True),
    Protocol("lag", 1, 2),
    Protocol("lag", 1, 2, live_source=True),
    Protocol("series", 2, 2, zero_copy=True, make_room=True),
    Protocol("sync", 2, 2, zero_copy=True),
    Protocol("sync", 2, 2, zero_copy=True, make_room=True),
    Protocol("lag", 1, 2, live_source=True, make_room=True),
    Protocol("series", 2, 1, finish_inflight=True),
    Protocol("lag", 1, 1, finish_inflight=True),
    Protocol("lag", 1, 1, live_source=True, finish_inflight=True),
)


def describe(s: State) -> str:
    parts = [f"host {s.dead} lost"]
    for w, (wk, a) in enumerate(zip(s.workers, s.agents, strict=True)):
        own = ",".join("torn" if x == TORN else "-" if x is None else str(x) for x in wk.own)
        parts.append(f"w{w}: done {wk.done} {wk.phase} own[{own}] holds "
                     f"{sorted(a.store)} of w{(w - 1) % len(s.workers)}")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"{args.workers} workers, {args.steps} steps, one host lost at any moment\n")
    print("| protocol | states | safe | at rest (shares) | peak | most steps lost |")
    print("|---|---:|---|---:|---:|---:|")
    results = [check(p, workers=args.workers, steps=args.steps) for p in PROTOCOLS]
    for r in results:
        print(f"| {r.protocol} | {r.states} | {'yes' if r.safe else 'no'} | "
              f"{r.rest_units} | {r.peak_units} | {r.max_steps_lost} |")
    for r in results:
        if r.unrecoverable:
            print(f"\n{r.protocol}: e.g. {describe(r.unrecoverable[0])}")


if __name__ == "__main__":
    main()
