"""The control plane of a job that spans several launchers (one per node), kept in etcd.

On one machine a single launcher decides every world in memory (`arbiter.Arbiter`). Across
nodes no launcher may be that single point: each node's launcher serves only its own agents
and workers, and the launchers meet only in etcd (`etcd_store`), where transactions decide
each world exactly once and leases say which nodes live. Any node can decide; the
coordination service of a new world runs on the node that decided it, so no node is needed
after the world it served: when the node hosting the current service dies, the others
agree through etcd and the new world's service starts on a surviving node (its workers,
which jaxlib 0.10 aborts with the service, are restarted there: `node`).

The job's keys (under ``/mnemojax/<job>/``)::

    nodes/<rank>              leased by that node's launcher: it lives
    agents/<worker>           leased: the address its agent serves copies on
    spares/<worker>           leased: an idle spare (its agent runs, no worker yet)
    home/<worker>             the node of a spare (workers: worker // nproc)
    world/<g>                 world g, created once: members, coordinator, the agreements
    arrive/<g>/<worker>       a survivor of world g at the agreement barrier
    barrier/<g>/<name>/<w>    a member of world g at a post-compile barrier
    outcome/<g>/<name>        that barrier's outcome, created once
    regrow/<g>                world g is smaller than world 0 and idle spares can fill it:
                              its members re-form it, larger (created once)
    rejoin/<first id>         a node that rejoined the running job (``--grow-back``) took
                              the ids from there, or a node restarted a worker under that
                              id (``--max-restarts``; created once)
    progress/<rank>           that node's workers' newest published steps, and their
                              publishes in the world it saw last (every few seconds)
    dead/<worker>             declared dead (crashed, evicted, or left the job); permanent
    exit/<worker>             its worker's exit status; permanent
    end                       the job is ending (why; a worker's error status), created once

A node whose lease is gone is lost: its workers that had not exited 0 are dead. Every
launcher mirrors the keys (`EtcdArbiter` polls them) and answers its workers' agreement,
barrier and watch requests from that mirror, with the protocol of `distributed.agreement`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agreement import ANY_STEP, Agreement, compiled_barrier
from mnemojax._src.distributed.launcher.book import AgreementBook, open_slots, takes_joiners
from mnemojax._src.distributed.launcher.etcd_store import (
    EtcdRefusedError,
    EtcdStore,
    FencedOutError,
    RendezvousError,
)
from mnemojax._src.distributed.launcher.roster import AgentRoster, ask_holdings
from mnemojax._src.distributed.launcher.services import ServiceHost
from mnemojax._src.errors import AgreementError

T = TypeVar("T")
# The mirror not read for this long (etcd out of reach) evicts nobody (`EtcdArbiter.stale`).
STALE_S = 2.0

logger = logging.getLogger("mnemojax")


def node_of(worker_id: int, nproc: int) -> int:
    """The node that runs ``worker_id`` (workers are numbered node by node)."""
    return worker_id // nproc


def ring(members: Sequence[int], nproc: int,
         home: Mapping[int, int] | None = None) -> list[int]:
    """The buddy ring's order: members interleaved across nodes, so that each worker's
    buddy (the next in the ring) is on another node whenever there is one; a whole node's
    loss then never takes a worker's copy and its buddy's together. ``home``: the node of
    each spare that joined (default: by id)."""
    home = home or {}
    nodes: dict[int, list[int]] = {}
    for w in sorted(members):
        nodes.setdefault(home.get(w, node_of(w, nproc)), []).append(w)
    index = {w: (i, n) for n, ws in nodes.items() for i, w in enumerate(ws)}
    return sorted(members, key=lambda w: (*index[w], w))


@dataclasses.dataclass(frozen=True)
class JobView:
    """One consistent read of the job's keys, and what follows from it (pure).

    Args:
        items: key (without the job's prefix) -> value.
        nproc: workers per node.
        seen_nodes: every node this launcher has ever seen alive (a node seen and now gone
            is lost).
        local_dead: workers this launcher declared dead whose key may not be read back yet.
        local_left: of those, the ones that left the job (`EtcdArbiter.member_left`).
    """

    items: Mapping[str, Any]
    nproc: int
    seen_nodes: frozenset[int] = frozenset()
    local_dead: frozenset[int] = frozenset()
    local_left: frozenset[int] = frozenset()

    def _under(self, prefix: str) -> dict[str, Any]:
        return {k[len(prefix):]: v for k, v in self.items.items() if k.startswith(prefix)}

    def live_nodes(self) -> set[int]:
        return {int(r) for r in self._under("nodes/")}

    def refused(self) -> dict[int, str]:
        """Node rank -> why it refused to run this job (launched unlike another node)."""
        return {int(r): str(v.get("why") if isinstance(v, dict) else v)
                for r, v in self._under("refused/").items()}

    def finished_nodes(self) -> set[int]:
        """Nodes that ended their part of the job on purpose, every worker of theirs
        ended (`node.NodeLauncher.cleanup`): their lease is gone, but they are not lost."""
        return {int(r) for r in self._under("finished/")}

    def lost_nodes(self) -> set[int]:
        """Nodes of the job (seen alive once, or running a member of a world) whose lease
        is gone, other than those that finished."""
        known = set(self.seen_nodes) | {self.node(w)
                                        for g in self.worlds().values() for w in g}
        return known - self.live_nodes() - self.finished_nodes()

    def homes(self) -> dict[int, int]:
        """Spare -> its node."""
        return {int(w): int(r) for w, r in self._under("home/").items()}

    def node(self, worker_id: int) -> int:
        return self.homes().get(worker_id, node_of(worker_id, self.nproc))

    def idle_spares(self) -> list[int]:
        """Spares of live nodes, with a live agent, not dead and not yet in a world, lowest
        id first."""
        used = {w for g in self.worlds().values() for w in g} | self.dead()
        agents = self.agents()
        return sorted(w for w in map(int, self._under("spares/"))
                      if w not in used and w in agents)

    def quiet_spares(self) -> list[int]:
        """Spares taken back because they stopped asking to join (frozen or stalled:
        `EtcdArbiter.withdraw_spare`), not since in a world nor dead."""
        used = {w for g in self.worlds().values() for w in g} | self.dead()
        return sorted(w for w in map(int, self._under("quiet/")) if w not in used)

    def dead_why(self) -> dict[int, str]:
        """Why a worker was declared dead, where its exit does not say it (an eviction)."""
        return {int(w): str(r["why"]) for w, r in self._under("dead/").items()
                if isinstance(r, dict) and r.get("why")}

    def joiners(self, generation: int) -> list[int]:
        """The spares world ``generation + 1`` may take in. A fresh process builds its mesh
        from the user's code, which fits the survivors' only at world 0's size and layout:
        in place of dead members of a world whose every member is at its world-0 rank, or
        to grow a shrunk world back to world 0's size (`book.AgreementBook.decide` takes
        them only then). Never while a member started fresh in a smaller world: it does
        not know world 0's layout (`first_sizes`)."""
        members = self.worlds().get(generation, ())
        full = self.full_size()
        if any(size != full for size in self.first_sizes(generation).values()):
            return []
        return self.idle_spares() if takes_joiners(members, self.slots(), full) else []

    def first_sizes(self, generation: int) -> dict[int, int]:
        """Member of world ``generation`` -> the size of the first world its process ran
        in: world 0's, or that of the world it joined or was restarted into (``fresh`` in
        each world's record). A process knows the layout of its first world only."""
        worlds = self.worlds()
        first: dict[int, int] = {}
        for g in sorted(g for g in worlds if g <= generation):
            fresh = set((self.world(g) or {}).get("fresh", ()))
            for m in worlds[g]:
                if g == 0 or m in fresh or m not in first:
                    first[m] = len(worlds[g])
        return {m: first[m] for m in worlds.get(generation, ())}

    def placed_joiners(self, generation: int, arrived: Sequence[int]) -> list[int]:
        """`joiners`, ordered for `book.AgreementBook.decide` (which gives the k-th joiner
        the k-th slot to fill: a dead member's, or a free one when the world grows back):
        for each such slot, a spare of the node that slot's world-0 worker ran on where one
        waits, so the ring still pairs workers of different nodes."""
        spares = self.joiners(generation)
        targets = self.open_slots(generation, arrived)
        world0 = self.worlds().get(0, ())
        ordered: list[int] = []
        left = list(spares)
        for s in targets:
            if not left:
                break
            node = self.node(world0[s]) if 0 <= s < len(world0) else None
            pick = next((w for w in left if self.node(w) == node), left[0])
            left.remove(pick)
            ordered.append(pick)
        return ordered + left

    def open_slots(self, generation: int, arrived: Sequence[int]) -> list[int]:
        """The slots a joiner may fill in the world after ``generation`` when ``arrived``
        are its survivors: the free slots of world 0's layout when that world is smaller
        than world 0 (it grows back), else the slots of its dead members (-1 for a member
        without one). The one count of free slots that deciding a world (`EtcdArbiter`),
        placing joiners (`placed_joiners`) and a regrow (`regrow_due`) use."""
        return open_slots(self.worlds().get(generation, ()), arrived, self.slots(),
                          self.full_size())

    def full_size(self) -> int:
        """World 0's size: the size the job grows back to."""
        return len(self.worlds().get(0, ()))

    def slots(self) -> dict[int, int]:
        """Member of any world -> its slot: its rank in world 0's layout. A survivor keeps
        its slot; a joiner takes the slot of the member it replaces (`Agreement.replaces`:
        a dead member, or, in a world that grew back, the world-0 worker of a free slot)."""
        worlds = self.worlds()
        slots = {w: i for i, w in enumerate(worlds.get(0, ()))}
        for g in sorted(g for g in worlds if g > 0):
            members = worlds[g]
            first = agreement_of(self.world(g) or {}, members[0]) if members else None
            replaces = first.replaces if first is not None else {}
            for m in members:
                if m in replaces and replaces[m] in slots:
                    slots[m] = slots[replaces[m]]
        return slots

    def used_ids(self, first_spares: range) -> set[int]:
        """Every worker id the job has used: world members, agents, spares, the dead and
        exited, ``first_spares`` (every node's spares at the start) and the ranges that
        rejoining nodes claimed (``rejoin/<first id>``)."""
        used = {w for m in self.worlds().values() for w in m} | set(first_spares)
        for prefix in ("agents/", "spares/", "home/", "dead/", "exit/"):
            used |= {int(w) for w in self._under(prefix)}
        for first, claim in self._under("rejoin/").items():
            used |= set(range(int(first), int(first) + int(claim["count"])))
        return used

    def regrow_due(self) -> int | None:
        """The newest world, when it is smaller than world 0, has formed (its members
        passed the barrier after their compile: asked sooner, the compile and restore of
        its recovery would be thrown away), none of its members is dead and idle spares
        can fill every free slot: the job should grow back now."""
        g = self.latest()
        members = self.worlds().get(g, ())
        if not members or len(members) >= self.full_size() or self.end() is not None:
            return None
        if self.outcome(g, compiled_barrier(g)) != ():
            return None
        if self.dead() & set(members) or self.items.get(f"regrow/{g}") is not None:
            return None
        if set(self.exits()) & set(members):  # the job is finishing
            return None
        if len(self.joiners(g)) < len(self.open_slots(g, members)):
            return None
        return g

    def publishes(self, generation: int) -> dict[int, int]:
        """Worker -> the snapshots it has published in world ``generation``, as its node
        last wrote them (``progress/<rank>``, every few seconds)."""
        out: dict[int, int] = {}
        for record in self._under("progress/").values():
            if isinstance(record, dict) and record.get("generation") == generation:
                out.update({int(w): int(n) for w, n in record.get("publishes", {}).items()})
        return out

    def regrows(self, generation: int) -> bool:
        """World ``generation`` is to re-form, larger (`regrow_due`), and has not yet."""
        return (self.items.get(f"regrow/{generation}") is not None
                and self.world(generation + 1) is None)

    def agents(self) -> dict[int, str]:
        """Worker id -> its agent's address, for agents of live nodes."""
        return {int(w): str(a) for w, a in self._under("agents/").items()}

    def exits(self) -> dict[int, int]:
        return {int(w): int(c) for w, c in self._under("exit/").items()}

    def left(self) -> set[int]:
        """Left the job by choice (`EtcdArbiter.member_left`); `dead` includes them (out of
        the agreement alike)."""
        return {int(w) for w in self._under("left/")} | set(self.local_left)

    def dead(self) -> set[int]:
        """Declared dead, or on a lost node without having exited 0."""
        dead = {int(w) for w in self._under("dead/")} | set(self.local_dead)
        if lost := self.lost_nodes():
            exits = self.exits()
            for g in self.worlds().values():
                dead |= {w for w in g if self.node(w) in lost and exits.get(w) != 0}
        return dead

    def world(self, generation: int) -> dict[str, Any] | None:
        return self.items.get(f"world/{generation}")

    def worlds(self) -> dict[int, tuple[int, ...]]:
        return {int(g): tuple(rec["members"]) for g, rec in self._under("world/").items()}

    def latest(self) -> int:
        """The newest world's generation (-1 before world 0)."""
        return max(self.worlds(), default=-1)

    def arrivals(self, generation: int) -> dict[int, Mapping[str, Any]]:
        return {int(w): v for w, v in self._under(f"arrive/{generation}/").items()}

    def barrier_arrivals(self, generation: int, name: str) -> set[int]:
        return {int(w) for w in self._under(f"barrier/{generation}/{name}/")}

    def outcome(self, generation: int, name: str) -> tuple[int, ...] | None:
        value = self.items.get(f"outcome/{generation}/{name}")
        return None if value is None else tuple(value)

    def end(self) -> Mapping[str, Any] | None:
        return self.items.get("end")

    def stopping(self) -> Mapping[str, Any] | None:
        return self.items.get("stopping")

    def book(self, generation: int) -> AgreementBook:
        """World ``generation``'s agreement book as this view sees it. Once a member has
        arrived, the members that exited 0 (their loop is done) are out of it as the dead
        are: they never come, and the others replay the step they finished without them."""
        book = AgreementBook(generation, self.worlds().get(generation, ()))
        dead = self.dead()
        for w, a in self.arrivals(generation).items():
            if w in book.members and w not in dead:
                book.arrive(w, generation, int(a["last_step"]), a.get("first_replayable"))
        for w in dead:
            book.mark_dead(w)
        if book.arrived:
            for w, code in self.exits().items():
                if code == 0 and w in book.members and w not in book.arrived:
                    book.mark_dead(w)
        return book

    def failed_members(self, generation: int) -> tuple[int, ...]:
        """Members of world ``generation`` known dead (or left out of the next world)."""
        members = self.worlds().get(generation, ())
        after = self.worlds().get(generation + 1)
        if after is not None:
            return tuple(m for m in members if m not in after)
        dead = self.dead()
        return tuple(m for m in members if m in dead)


def agreement_of(record: Mapping[str, Any], worker_id: int) -> Agreement | None:
    raw = record.get("agreements", {}).get(str(worker_id))
    return None if raw is None else wire.AgreementReply.from_wire(raw).agreement


class EtcdArbiter:
    """One node's side of the job's agreement, barriers and watches, kept in etcd; the same
    calls as `arbiter.Arbiter`. Call `member_died`, `end` and `close` with ``roster.cv``
    held; `agree`, `barrier` and `watch` without it.

    Args:
        store: the job's keys.
        node_rank, nproc: this node, and the workers of each node.
        agree_timeout_s: the barrier's deadline, from each arrival.
        roster: this node's agents (and the launcher's lock, ``roster.cv``).
        services: the coordination services this node hosts.
        record: logs a launcher event.
        on_view: called with ``roster.cv`` held after each change of the mirror.
        poll_s: how often the mirror reads the keys.
        outage_s: how long an agreement or a barrier waits for etcd to answer again.
    """

    def __init__(self, store: EtcdStore, *, node_rank: int, nproc: int,
                 agree_timeout_s: float, roster: AgentRoster, services: ServiceHost,
                 record: Callable[[dict[str, Any]], None],
                 on_view: Callable[[JobView], None] | None = None, poll_s: float = 0.05,
                 outage_s: float = 0.0):
        self.store, self.node_rank, self.nproc = store, node_rank, nproc
        self._timeout_s, self._outage_s = agree_timeout_s, outage_s
        self._read_at = self._read_started = time.monotonic()  # the mirror's last read
        self._fenced_said = False
        self._given_up = False  # a write failed after `close`: the others are not tried
        self._roster, self._services, self._record = roster, services, record
        self._on_view, self._poll_s = on_view, poll_s
        self._seen: set[int] = set()
        self._local_dead: set[int] = set()
        self._local_left: set[int] = set()
        self.view = JobView({}, nproc)
        self._ending: str | None = None
        self._closed = False
        self._deciding = threading.Lock()
        self._refreshing = threading.Lock()  # one read-and-install at a time: never older
        # Writes made with the launcher's lock held go through one thread, in order.
        self._writes = concurrent.futures.ThreadPoolExecutor(1, "mnemojax-etcd-write")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._mirror, name="mnemojax-etcd-mirror",
                                        daemon=True)

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    # -- the mirror ---------------------------------------------------------------------------
    def refresh(self) -> JobView:
        """Reads the keys now; returns (and keeps) the new view."""
        with self._refreshing:
            started = time.monotonic()
            items = self.store.items()
            self._read_started, self._read_at = started, time.monotonic()
            return self._install(items)

    def stale(self) -> bool:
        """Whether the mirror has not read etcd for `STALE_S` (etcd out of reach): what it
        shows missing may have arrived, so nobody is evicted on it, and a deadline is
        moved on until it reads again (a full window: the arrivals waited for etcd too)."""
        return not self._closed and time.monotonic() - self._read_at > STALE_S

    def _read_since(self, deadline: float) -> bool:
        """Whether the mirror holds a read begun at or after ``deadline``: what it shows
        missing then had not arrived by the deadline (a review: a view read just before
        the deadline, etcd silent since, evicted members that had arrived)."""
        return self._read_started >= deadline

    def _through_outage(self, fn: Callable[[bool], T], generation: int) -> T:
        """``fn(again)``, again while etcd does not answer, up to ``outage_s`` (an outage of
        the whole cluster: the members wait for it, as the launchers do); ``again`` is
        True from the second call on.

        Raises:
            AgreementError: etcd did not answer within it, or refused this node's writes
                (`FencedOutError`: the others took this node for lost).
        """
        deadline = time.monotonic() + self._outage_s
        again = False
        while True:
            try:
                return fn(again)
            except (FencedOutError, EtcdRefusedError) as e:
                raise AgreementError(str(e), generation=generation) from e
            except RendezvousError as e:
                if time.monotonic() >= deadline or self._closed:
                    raise AgreementError(f"etcd could not be reached: {e}",
                                         generation=generation) from e
                logger.warning("mnemojax launch: etcd does not answer; world %d's agreement "
                               "waits for it (at most %.0f s more)", generation,
                               deadline - time.monotonic())
                time.sleep(0.5)
                again = True

    def _install(self, items: dict[str, Any]) -> JobView:
        with self._roster.cv:
            if items != self.view.items:
                live = {int(k.split("/", 1)[1]) for k in items if k.startswith("nodes/")}
                self._seen |= live
                self.view = JobView(items, self.nproc, frozenset(self._seen),
                                    frozenset(self._local_dead), frozenset(self._local_left))
                if self._on_view is not None:
                    self._on_view(self.view)
                self._roster.cv.notify_all()
            return self.view

    def _mirror(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.refresh()
            except RendezvousError as e:
                logger.warning("etcd unreachable: %s", e)
            except Exception:  # the mirror must outlive a bug in a reaction to it
                logger.exception("mnemojax launch: error while acting on etcd's keys")

    def _write(self, fn: Callable[[], object], *, told: bool = False) -> None:
        """``fn()`` (a write) on the write thread, after the writes before it; tried
        again while etcd does not answer, up to ``outage_s`` (a stop told during an outage
        of the whole cluster reaches the others once it ends: a user trial's was lost
        after one call's 15 s, and the other node trained on). After `close`, a write
        ``told`` to the other nodes (a stop, the job's end) goes on trying as long, and
        `join` waits for it; the others are given up after one failure (a review: each
        waited 15 s at the exit)."""
        def run() -> None:
            deadline = time.monotonic() + self._outage_s
            while True:
                if self._closed and not told and self._given_up:
                    return
                try:
                    fn()
                    return
                except FencedOutError as e:
                    if not self._fenced_said:
                        self._fenced_said = True
                        logger.error("mnemojax launch: %s; this node's writes are refused "
                                     "from now on", e)
                    return
                except RendezvousError as e:
                    if ((self._closed and not told) or time.monotonic() >= deadline
                            or isinstance(e, EtcdRefusedError)):
                        self._given_up = self._given_up or self._closed
                        logger.error("etcd write lost: %s", e)
                        return
                    time.sleep(0.5)
        if not self._closed:
            self._writes.submit(run)

    # -- what the launcher calls --------------------------------------------------------------
    def member_died(self, worker_id: int, why: str = "") -> None:
        """Declares ``worker_id`` dead (``dead/<id>``; ``why``, where its exit does not say
        it, for `mnemojax status`: a spare evicted as silent showed only exit -9)."""
        if worker_id not in self._local_dead:
            self._local_dead.add(worker_id)
            self.view = dataclasses.replace(self.view, local_dead=frozenset(self._local_dead))
            record: dict[str, Any] = {"by_node": self.node_rank}
            if why:
                record["why"] = why
            self._write(lambda: self.store.put(self.store.key("dead", worker_id), record))

    def member_left(self, worker_id: int) -> None:
        """This node's worker left the job (`wire.Leave`): out of the agreement as a dead
        member is, and said to be gone by choice (``left/``, written first: the nodes and
        ``mnemojax status`` tell it from a death)."""
        if worker_id not in self._local_dead:
            self._local_left.add(worker_id)  # (in the view with the death, at once)
            self.view = dataclasses.replace(self.view, local_left=frozenset(self._local_left))
            self._write(lambda: self.store.put(self.store.key("left", worker_id),
                                               {"by_node": self.node_rank}))
        self.member_died(worker_id)

    def publish_exit(self, worker_id: int, code: int) -> None:
        """This node's worker ``worker_id`` ended with ``code`` (a 0 is not a death when
        its node leaves)."""
        self._write(lambda: self.store.put(self.store.key("exit", worker_id), code))

    def arrive_for(self, worker_id: int, generation: int) -> None:
        """This node arrives at world ``generation``'s agreement for its worker
        ``worker_id``, which died with the world's coordination service and will be
        restarted into the next world: any step its agents' copies cover will do."""
        self._write(lambda: self.store.put(self.store.key("arrive", generation, worker_id),
                                           {"last_step": ANY_STEP, "first_replayable": None}))

    def forget_agent(self, worker_id: int) -> None:
        def forget() -> None:
            self.store.delete(self.store.key("agents", worker_id))
            self.store.delete(self.store.key("spares", worker_id))
        self._write(forget)

    def live_members(self) -> list[int]:
        view = self.view
        dead = view.dead()
        return [m for m in view.worlds().get(view.latest(), ()) if m not in dead]

    def end(self, why: str, *, code: int | None = None, worker_id: int | None = None,
            signal: int | None = None) -> None:
        """No new world from now on, on every node: the first ``end`` of the job is every
        node's (a worker's error status ``code``, or a stop ``signal`` they all forward).
        Like every write of a registered node, written only while its registration is
        its own (`EtcdStore.fence`): a node that etcd took for lost cannot end the job the
        others went on with once it reaches etcd again."""
        if self._ending is None:
            self._ending = why
            self._write(lambda: self.store.create(self.store.key("end"), {
                "why": why, "code": code, "worker_id": worker_id, "signal": signal,
                "node": self.node_rank}), told=True)
        self._roster.cv.notify_all()

    def stopping(self, why: str, *, signal: int) -> None:
        """The job stops (``signal``): every node forwards it to its workers (the first
        ``stopping`` of the job is every node's); worlds may still be decided until `end`,
        so that a recovery under way completes and its survivors stop at an agreed step
        and checkpoint it."""
        self._write(lambda: self.store.create(self.store.key("stopping"), {
            "why": why, "signal": signal, "node": self.node_rank}), told=True)
        self._roster.cv.notify_all()

    def close(self) -> None:
        """This launcher is shutting down (the job goes on elsewhere if it can)."""
        self._closed = True
        if self._ending is None:
            self._ending = "the launcher is shutting down"
        self._stop.set()
        self._roster.cv.notify_all()

    def join(self) -> None:
        """Waits for the mirror and the pending writes (after `close`)."""
        self._writes.shutdown(wait=True)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def closed(self) -> bool:
        return self._closed

    def ending(self) -> str | None:
        if self._ending is not None:
            return self._ending
        end = self.view.end()
        return None if end is None else str(end.get("why"))

    def _check_member(self, worker_id: int, generation: int) -> None:
        view = self.view
        if generation != view.latest() or worker_id not in view.worlds().get(generation, ()):
            raise AgreementError(f"worker {worker_id} is not a member of world {generation} "
                                 f"(the current world is {view.latest()})",
                                 generation=generation)
        if worker_id in view.dead():
            raise AgreementError(f"worker {worker_id} was declared dead (evicted)",
                                 generation=generation)

    def _evict(self, members: Sequence[int], **why: Any) -> None:
        where = f"the barrier {why['barrier']!r}" if "barrier" in why else "the agreement"
        for m in members:
            self._record({"op": "evicted", "worker_id": m, **why})
            self.member_died(m, f"evicted: did not come to {where} in time")

    def agree(self, request: wire.Agree) -> Agreement:
        """Barrier, then the decision, as `arbiter.Arbiter.agree`; any node decides, etcd
        keeps the first decision (a transaction), and the new world's coordination service
        runs on the node that made it.

        Raises:
            AgreementError: as `arbiter.Arbiter.agree`.
        """
        return self._through_outage(lambda again: self._agree(request, again),
                                    request.generation)

    def _agree(self, request: wire.Agree, again: bool = False) -> Agreement:
        """``again``: run again after an etcd error, which the decision may have outlived
        (committed, then the reply or the read after it lost): its agreement if so."""
        w, g, cv = request.worker_id, request.generation, self._roster.cv
        with cv:
            if (again and (record := self.view.world(g + 1)) is not None
                    and (agreement := agreement_of(record, w)) is not None):
                return agreement
            self._check_member(w, g)
        self.store.put(self.store.key("arrive", g, w), {
            "last_step": request.last_step, "first_replayable": request.first_replayable})
        deadline = time.monotonic() + self._timeout_s
        while True:
            with cv:
                view = self.view
                if (record := view.world(g + 1)) is not None:
                    agreement = agreement_of(record, w)
                    if agreement is None:
                        raise AgreementError(f"worker {w} died during the agreement",
                                             generation=g)
                    return agreement
                if (why := self.ending()) is not None:
                    raise AgreementError(why, generation=g)
                if w in view.dead():
                    raise AgreementError(f"worker {w} died during the agreement", generation=g)
                book = view.book(g)
                if not (book.complete() and w in book.arrived):
                    left = deadline - time.monotonic()
                    if self.stale():  # (a full window once etcd answers again)
                        deadline = time.monotonic() + self._timeout_s
                    elif (left <= 0 and view.regrows(g)
                          and not view.dead() & set(book.members)):
                        # Nobody died: a member not here is alive between steps (its
                        # agent's watchdog says so), in its own code; it comes at its next
                        # step, or it is done and its exit takes it out (`JobView.book`).
                        deadline = time.monotonic() + self._timeout_s
                    elif left <= 0 and self._read_since(deadline):
                        self._evict(book.missing())
                        deadline = time.monotonic() + self._timeout_s
                    cv.wait(timeout=min(max(left, 0.01), 0.2))
                    continue
            self._decide(g)
            self.refresh()

    def _decide(self, generation: int) -> None:
        """Decides world ``generation + 1`` unless another node has (one at a time here)."""
        with self._deciding:
            view = self.refresh()
            if view.world(generation + 1) is not None:
                return
            book = view.book(generation)
            if not book.complete():
                return
            worlds = view.worlds()
            if (generation > 0 and len(worlds[generation]) > len(worlds[generation - 1])
                    and view.outcome(generation, compiled_barrier(generation)) != ()):
                # A world that grew back and never formed (a member died before its first
                # compile's barrier): its joiners leave with it. They hold nothing, and the
                # survivors are still on the smaller world's layout; they may grow again.
                for joiner in (view.world(generation) or {}).get("fresh", ()):
                    book.mark_dead(joiner)
            agents = view.agents()
            replies = ask_holdings(sorted(set(agents.values())), secret=self._roster.secret)
            for address, reply in replies.items():
                for bad in reply.corrupt:
                    self._record({"op": "corrupt_copy", "agent": address,
                                  **dataclasses.asdict(bad)})
            holdings = {a: list(r.copies) for a, r in replies.items()}
            joiners = view.placed_joiners(generation, list(book.arrived))
            full = view.full_size()
            # A joiner for every free slot (a world that grows back) or dead member, or none.
            joining = len(view.open_slots(generation, list(book.arrived)))
            joining = joining if joining <= len(joiners) else 0
            nxt = generation + 1
            service = self._services.start(nxt, len(book.arrived) + joining)
            try:
                decision = book.decide(coordinator=service.address, holdings=holdings,
                                       homes=agents, members_of=view.worlds(),
                                       joiners=joiners, slots=view.slots(), full_size=full)
            except AgreementError:
                self._services.stop(nxt)
                raise
            survivors = list(next(iter(decision.values())).survivors)  # new rank order
            first = decision[survivors[0]]
            # Processes that start in this world: joiners, and workers restarted into it
            # (they arrived as ``ANY_STEP``, `node`): their first world is this one.
            fresh = sorted(set(first.replaces) | {
                w for w, last in book.arrived.items() if last == ANY_STEP and w in survivors})
            record = {"members": survivors, "coordinator": service.address, "fresh": fresh,
                      "host_node": self.node_rank, "nonce": secrets.token_hex(8),
                      "agreements": {str(m): wire.AgreementReply(agreement=a).to_wire()
                                     for m, a in decision.items()}}
            # The members left out are dead in the same transaction: their nodes kill them.
            left_out = {self.store.key("dead", m): {"by_node": self.node_rank,
                                                    "why": f"not in world {nxt}"}
                        for m in book.members if m not in survivors}
            won = self.store.create(self.store.key("world", nxt), record,
                                    unless=[self.store.key("end")], also=left_out)
            if not won:
                self._services.stop(nxt)
                return
            self._record({"op": "decided", "generation": nxt, "survivors": survivors,
                          "resume_step": first.resume_step, "lost": list(first.lost),
                          "replaces": {str(j): d for j, d in first.replaces.items()},
                          "coordinator": service.address, "node": self.node_rank})

    def barrier(self, request: wire.Barrier) -> wire.BarrierReply:
        """As `arbiter.Arbiter.barrier`; the first outcome written to etcd is every
        member's.

        Raises:
            AgreementError: the caller is not a live member of the current world.
        """
        return self._through_outage(lambda again: self._barrier(request, again),
                                    request.generation)

    def _barrier(self, request: wire.Barrier, again: bool = False) -> wire.BarrierReply:
        w, g, name, cv = request.worker_id, request.generation, request.name, self._roster.cv
        with cv:
            if again and (outcome := self.view.outcome(g, name)) is not None:  # (`_agree`)
                return wire.BarrierReply(failed=tuple(outcome))
            self._check_member(w, g)
        self.store.put(self.store.key("barrier", g, name, w), 1)
        deadline = time.monotonic() + request.timeout_s
        while True:
            with cv:
                view = self.view
                outcome, proposal = view.outcome(g, name), None
                if outcome is None:
                    members, dead = view.worlds().get(g, ()), view.dead()
                    if view.world(g + 1) is None:  # gone to the agreement: failed it
                        dead |= set(view.arrivals(g))
                    arrived = view.barrier_arrivals(g, name)
                    gone = tuple(m for m in members if m in dead)
                    if gone or all(m in arrived for m in members):
                        proposal = gone
                    else:
                        left = deadline - time.monotonic()
                        if self.stale():  # (as in `_agree`)
                            deadline = time.monotonic() + request.timeout_s
                        elif left <= 0 and self._read_since(deadline):
                            self._evict([m for m in members if m not in arrived],
                                        barrier=name)
                            deadline = time.monotonic() + request.timeout_s
                        cv.wait(timeout=min(max(left, 0.01), 0.2))
                        continue
            if outcome is None and proposal is not None:
                key = self.store.key("outcome", g, name)
                if self.store.create(key, list(proposal)):
                    outcome = proposal
                    if outcome:
                        self._record({"op": "barrier_failed", "generation": g, "name": name,
                                      "failed": list(outcome)})
                else:
                    outcome = tuple(self.store.get(key) or ())
            return wire.BarrierReply(failed=tuple(outcome or ()))

    def watch(self, request: wire.WatchWorld) -> wire.WorldFailed:
        """As `arbiter.Arbiter.watch`, from the mirror."""
        g, cv = request.generation, self._roster.cv
        deadline = time.monotonic() + request.timeout_s
        with cv:
            while not (failed := self.view.failed_members(g)):
                if self.view.regrows(g):  # no one died: re-form, larger
                    return wire.WorldFailed(generation=g, failed=(), regrow=True)
                if self.view.world(g + 1) is None and (gone := self.view.arrivals(g)):
                    return wire.WorldFailed(generation=g, failed=(), left=tuple(sorted(gone)))
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    break
                cv.wait(timeout=min(remaining, 0.5))
            return wire.WorldFailed(generation=g, failed=failed)

    def publish_spare(self, worker_id: int, node_rank: int, lease: int) -> None:
        """Says that spare ``worker_id`` waits, warm, for a world (leased with its node;
        call with ``roster.cv`` held)."""
        self._write(lambda: self.store.put(self.store.key("spares", worker_id), node_rank,
                                           lease=lease))

    def publish_agent(self, worker_id: int, address: str, lease: int) -> None:
        """Says where agent ``worker_id`` of this node listens (leased with its node; call
        with ``roster.cv`` held)."""
        self._write(lambda: self.store.put(self.store.key("agents", worker_id), address,
                                           lease=lease))

    def withdraw_spare(self, worker_id: int, *, quiet_lease: int | None = None) -> None:
        """Spare ``worker_id`` is no longer to be taken in; with ``quiet_lease`` because it
        stopped asking to join (``quiet/<id>``, leased with its node, for `mnemojax status`
        until it asks again: `publish_spare`). Call with ``roster.cv`` held."""
        self._write(lambda: self.store.delete(self.store.key("spares", worker_id)))
        if quiet_lease is not None:
            self._write(lambda: self.store.put(self.store.key("quiet", worker_id),
                                               self.node_rank, lease=quiet_lease))

    def spare_asks_again(self, worker_id: int) -> None:
        """A spare taken back as quiet (`withdraw_spare`) asks to join again (call with
        ``roster.cv`` held)."""
        self._write(lambda: self.store.delete(self.store.key("quiet", worker_id)))

    def regrow_pending(self) -> int | None:
        """The newest world, if it was asked to re-form larger and has not yet."""
        g = self.view.latest()
        return g if self.view.regrows(g) else None

    def request_regrow(self, generation: int) -> None:
        """Asks world ``generation``'s members to re-form it, larger (`JobView.regrow_due`);
        created once, whichever node asks first (call with ``roster.cv`` held)."""
        self._write(lambda: self.store.create(self.store.key("regrow", generation),
                                              {"by_node": self.node_rank},
                                              unless=[self.store.key("end")]))
