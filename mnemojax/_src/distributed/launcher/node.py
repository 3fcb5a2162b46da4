"""One node's launcher of a job that spans several (``mnemojax launch --rdzv etcd://...``).

Like `launcher.Launcher`, it starts this node's agents and workers and serves their events
and requests; unlike it, it decides nothing alone. The job's state lives in etcd
(`plane`): the node registers itself and its agents under a lease, waits for every node,
and world 0 is created once (by the lowest rank; its coordination service runs there).
Every later world is decided by whichever node's survivor completes the barrier first, and
its service runs on that node. So no node is special after world 0: losing any one,
including the one hosting the current coordination service, is a failure the others
recover from.

Each node acts on what the mirror of the keys shows (`NodeLauncher._on_view`): a new world
stops the old world's service where it ran and re-forms this node's part of the buddy
ring; a worker of this node declared dead elsewhere (evicted) is killed; the job's end,
decided on any node, ends this node too (a worker's error status, or a stop signal that
every node forwards to its workers).

**Coordinator loss.** With jaxlib 0.10, a JAX client whose coordination service dies
aborts its process: no survivor of the node that ran the service can re-initialise in
place. Their agents live on, with the copies. So a worker that crashes while its world's
service cannot be reached is not dead but *restarted*: its node arrives at the agreement
for it (any step its agents' copies cover will do), and once the next world is decided
(its service on a surviving node), starts a fresh process in it with the agreement in
``MNEMOJAX_RESUME``. That process's ``step.restore()`` fetches the agreed state from the
agents, and its loop starts after that step (`NodeLauncher._respawn_loop`).

**Spares** (``--spares S``) are started with the job: an agent and a worker process that
waits in ``mnemojax.initialize()`` (`wire.AwaitJoin`, answered here). A world decided after
a loss takes one in place of each dead member (`book.AgreementBook.decide`); the spare then
joins it like a restarted worker, with Python and JAX already loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mnemojax._src.distributed import auth, env, wire
from mnemojax._src.distributed.agreement import ANY_STEP, Agreement
from mnemojax._src.distributed.launcher.etcd_store import (
    EtcdStore,
    FencedOutError,
    LeaseKeeper,
    RendezvousError,
)
from mnemojax._src.distributed.launcher.launcher import RETIRE_AFTER_PUBLISHES, Launcher
from mnemojax._src.distributed.launcher.options import LaunchOptions, worker_env
from mnemojax._src.distributed.launcher.plane import (
    EtcdArbiter,
    JobView,
    agreement_of,
    ring,
)
from mnemojax._src.errors import AgreementError, DistributedError, WorldConfigError

logger = logging.getLogger("mnemojax")

FORM_TIMEOUT_S = 120.0  # every node must have registered by then
SAY_WAIT_S = 15.0  # a launcher waiting for the others says so this often
PROBE_TIMEOUT_S = 0.5  # a coordination service that does not accept by then is gone
PROGRESS_EVERY_S = 5.0  # how often a node writes its workers' newest steps (`status`)


def shared_secret(environ: dict[str, str] | None = None) -> bytes:
    """The job secret every node's launcher must be given (the same on each).

    Raises:
        WorldConfigError: it is not set, or not valid.
    """
    secret = auth.secret_from_env(os.environ if environ is None else environ)
    if secret is None:
        raise WorldConfigError(
            f"a job across nodes needs {auth.JOB_SECRET}: the same secret (hex, >= 16 bytes) "
            f"in every launcher's environment, e.g. {auth.JOB_SECRET}=$(openssl rand -hex 32)")
    return secret


class NodeLauncher(Launcher):
    """Runs node ``options.node_rank``'s share of a job over ``options.nnodes`` nodes.

    Args:
        options: with ``rdzv`` set.
        command: the worker command.
        store: the job's keys (default: from ``options.rdzv`` and ``rdzv_id``).
        extra_env, on_event: as `Launcher`.
    """

    def __init__(self, options: LaunchOptions, command: Sequence[str], *,
                 store: EtcdStore | None = None, extra_env: dict[str, str] | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None):
        if options.rdzv is None:
            raise WorldConfigError("NodeLauncher needs options.rdzv (etcd://HOST:PORT)")
        super().__init__(options, command, extra_env=extra_env, on_event=on_event,
                         secret=shared_secret())
        self.store = store if store is not None else EtcdStore.from_url(
            options.rdzv, options.rdzv_id)
        self.plane = EtcdArbiter(
            self.store, node_rank=options.node_rank, nproc=options.nproc,
            agree_timeout_s=options.agree_timeout_s, roster=self.roster,
            services=self.services, record=self._record, on_view=self._on_view,
            outage_s=options.etcd_outage_s)
        self.arbiter = self.plane
        self._lease: LeaseKeeper | None = None
        self._lease_lost = False
        self._world_seen = 0  # world 0's ring is set at the start
        self._dead_seen: set[int] = set()
        self._killed: set[int] = set()
        self._end_seen = False
        self._coordinator_lost = False
        # Crashed with their world's service, to restart: worker -> that world.
        self._respawning: dict[int, int] = {}
        self._probed: dict[int, bool] = {}  # world -> its service was gone when probed
        self._regrow_asked: set[int] = set()  # worlds this node asked to grow back
        self._offered: set[int] = set()  # spares published in etcd (`_offer_spares`)
        self._withdrawn: set[int] = set()  # of those, taken back as frozen (said once)
        self._progress_stop = threading.Event()
        self._progress_thread: threading.Thread | None = None
        self._progress_put: tuple = ()  # what `progress/<rank>` holds

    # -- the mirror's news (``roster.cv`` held) -----------------------------------------------
    def _on_view(self, view: JobView) -> None:
        o = self.options
        for g in sorted(g for g in view.worlds() if g > self._world_seen):
            self._world_seen = g
            record = view.world(g) or {}
            members = view.worlds()[g]
            first = agreement_of(record, members[0]) if members else None
            self._record({"op": "world", "generation": g, "members": record.get("members"),
                          "coordinator": record.get("coordinator"),
                          "host_node": record.get("host_node"),
                          "resume_step": None if first is None else first.resume_step})
            logger.info("mnemojax launch: world %d: workers %s%s, coordination service on "
                        "node %s", g, list(members),
                        "" if first is None else f", {first.resume_said}",
                        record.get("host_node"))
            if self.services.stop(g - 1):  # every survivor detached before agreeing
                self._record({"op": "old_service_stopped", "generation": g - 1})
            for w in members:  # their steps of the world before are no news of this one
                self.steps.pop(w, None)
            self._set_buddies(view, members, first, newest=g == view.latest())
            for w in sorted(self._idle):  # this node's spares the world takes in
                agreement = agreement_of(record, w)
                if agreement is not None and w in self._idle:
                    self._spare_joined(w, agreement)  # answers its `wire.AwaitJoin`
        if (g := view.regrow_due()) is not None and g not in self._regrow_asked and o.recover \
                and not self._stopping():
            self._regrow_asked.add(g)
            self.plane.request_regrow(g)
            self._record({"op": "regrow", "generation": g, "spares": view.idle_spares()})
            logger.warning("mnemojax launch: world %d has %d of world 0's %d workers, and "
                           "idle spares %s are there to fill it: it re-forms, larger (the "
                           "agreement says which join)", g, len(view.worlds()[g]),
                           view.full_size(), view.idle_spares())
        current = view.world(view.latest()) or {}
        if current.get("host_node") in view.lost_nodes() and not self._coordinator_lost:
            self._coordinator_lost = True
            self._record({"op": "coordinator_lost", "generation": view.latest(),
                          "node": current.get("host_node")})
            logger.warning(
                "mnemojax launch: node %s, which ran world %d's coordination service, is "
                "lost (dead, or cut off from etcd). Where its service is gone, jaxlib 0.10 "
                "aborts every JAX client of it: those survivors are restarted into the next "
                "world from their agents' copies; the others recover in place",
                current.get("host_node"), view.latest())
        dead = view.dead()
        if new := dead - self._dead_seen:
            self._dead_seen |= new
            left = new & view.left()
            exits = view.exits()  # (left out of a world after their loop was done)
            done = {w for w in new - left if exits.get(w) == 0}
            died = sorted(new - left - done)
            self._record({"op": "dead", "workers": died, "left": sorted(left),
                          "finished": sorted(done)})
            lost = sorted(view.lost_nodes())
            if died and (end := view.end()) is not None:  # (a stop, an error: expected)
                logger.warning("mnemojax launch: workers %s ended (%s)", died,
                               end.get("why", "the job is ending"))
            elif died and o.node_rank in lost:  # (a trial: "dead (nodes [1] lost)" on 1)
                logger.warning("mnemojax launch: the other nodes took this node (%d) for lost "
                               "(its etcd lease ended): workers %s are out of the job",
                               o.node_rank, died)
            elif died:
                logger.warning("mnemojax launch: workers %s dead%s", died,
                               f" (nodes {lost} lost)" if lost else "")
            if done and view.end() is None:
                logger.warning("mnemojax launch: workers %s, done with their loop (status 0), "
                               "are out of the next world", sorted(done))
            if left:
                logger.warning("mnemojax launch: workers %s left the job (no device for them "
                               "in the new world, or a joiner that could not fetch the "
                               "state)", sorted(left))
            self.roster.command_all(wire.PauseWatchdog())  # survivors may block a while
            if not o.recover and self._failed_code is None and died:
                self._failed_code = 128 + 9  # --no-recover: any death ends it
                self.plane.end(f"the job is ending: workers {died} died and recovery is off",
                               code=self._failed_code)
        for w in dead & set(self.agents):  # a spare that joined is a worker like any
            if w not in self.roster.exit_codes and w not in self._killed | self._departed:
                self._killed.add(w)  # evicted by another node: fence it here
                self.roster.command(w, wire.KillWorker())
        stopping = view.stopping()
        if (stopping is not None and stopping.get("node") != o.node_rank
                and self._stop_forwarded is None):
            self._record({"op": "job_stopping", **stopping})
            logger.warning("mnemojax launch: node %s stops the job (signal %s)",
                           stopping.get("node"), stopping.get("signal"))
            self._stop_forwarded = int(stopping["signal"])
        end = view.end()
        if end is not None and not self._end_seen:
            self._end_seen = True
            if end.get("node") != o.node_rank:
                self._record({"op": "job_ending", **end})
                logger.warning("mnemojax launch: node %s ends the job: %s", end.get("node"),
                               str(end.get("why", "")).removeprefix("the job is ending: "))
                if end.get("signal") is not None and self._stop_forwarded is None:
                    self._stop_forwarded = int(end["signal"])
                elif end.get("code") and self._worker_error is None:
                    # Every node ends with the status of the one that ended the job.
                    worker = end.get("worker_id")
                    self._worker_error = (-1 if worker is None else int(worker),
                                          int(end["code"]), time.monotonic())

    def _set_buddies(self, view: JobView, members: Sequence[int],
                     agreement: Agreement | None, *, newest: bool = True) -> None:
        """Tells this node's agents their buddies in the ring over ``members``' agents,
        the step the world resumed from (what a new buddy gets first) and, for the
        ``newest`` world, the oldest world whose copies they keep (`wire.SetBuddy.for_world`)."""
        agents = view.agents()
        order = ring([m for m in members if m in agents], self.options.nproc, view.homes())
        for i, m in enumerate(order):
            if m in self.roster.links:
                buddy = agents[order[(i + 1) % len(order)]] if len(order) > 1 else None
                self.roster.command(m, wire.SetBuddy.for_world(buddy, agreement,
                                                               newest=newest))

    def _on_lease_lost(self) -> None:
        with self.roster.cv:
            self._lease_lost = True
            self.roster.cv.notify_all()

    # -- the launcher's hooks -----------------------------------------------------------------
    def _worker_gone(self, worker_id: int, code: int) -> None:
        if worker_id in self._departed:  # it left the job: its exit is no death to act on
            if worker_id not in self.roster.exit_codes:
                self.plane.publish_exit(worker_id, code)
            super()._worker_gone(worker_id, code)
            return
        if worker_id in self._idle:  # a waiting spare ended: one spare fewer, nothing more
            self._idle.discard(worker_id)
            self.roster.exit_codes[worker_id] = code
            self.plane.publish_exit(worker_id, code)
            self.plane.member_died(worker_id)
            self._record({"op": "spare_lost", "worker_id": worker_id, "code": code})
            if code != 0 and not self._stopping_now():  # (not the job's end)
                self._restart_as_spare(worker_id, "(a spare) ended " + (
                    f"by signal {-code}" if code < 0 else f"with status {code}"))
            return
        if code > 0 and (worker_id in self._killed or worker_id in self.plane.view.dead()):
            code = -9  # evicted elsewhere: its exit (its agreement failed) is no user error
        if code != 0 and self.plane.stale() and worker_id not in self.roster.exit_codes:
            # (`stale` is False once the plane closed: its mirror stops then)
            # (the job-wide line comes from etcd's keys, which do not change meanwhile: a
            # user trial saw nothing for 16 s)
            logger.warning("mnemojax launch: worker %d of this node ended (status %d) while "
                           "etcd does not answer; the other nodes learn of it once it does",
                           worker_id, code)
        if (code < 0 and worker_id not in self.roster.exit_codes and self.options.recover
                and self._world_service_gone(worker_id)):
            # It died with its world's coordination service (jaxlib 0.10 aborts every
            # client of a dead service): restart it into the next world (`_respawn_loop`).
            generation = self.plane.view.latest()
            self.roster.exit_codes[worker_id] = code
            self._respawning[worker_id] = generation
            self.plane.arrive_for(worker_id, generation)
            self._record({"op": "respawning", "worker_id": worker_id, "code": code,
                          "generation": generation})
            self.roster.command_all(wire.PauseWatchdog(), but=worker_id)
            self.roster.cv.notify_all()
            return
        if worker_id not in self.roster.exit_codes:
            self.plane.publish_exit(worker_id, code)
        super()._worker_gone(worker_id, code)
        if code != 0 and not self.options.recover:
            self.plane.end(f"the job is ending: worker {worker_id} failed ({code}) and "
                           "recovery is off", code=128 - code if code < 0 else code,
                           worker_id=worker_id)

    def _world_service_gone(self, worker_id: int) -> bool:
        """Whether the coordination service of ``worker_id``'s current world is gone (its
        node is lost, or it did not accept a connection within `PROBE_TIMEOUT_S`; probed
        once per world, as the lock is held: give ``--host`` as an address, no name to
        resolve)."""
        view = self.plane.view
        record = view.world(view.latest()) or {}
        if worker_id not in record.get("members", ()):
            return False
        if record.get("host_node") in view.lost_nodes():
            return True
        if record.get("host_node") == self.options.node_rank:
            return False  # in this process, alive
        generation = view.latest()
        if generation not in self._probed:  # once per world: the lock is held
            host, _, port = str(record.get("coordinator", "")).rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
                    self._probed[generation] = False
            except (OSError, ValueError):
                self._probed[generation] = True
        return self._probed[generation]

    def _respawn_loop(self) -> None:
        """Restarts the workers of this node that died with their world's coordination
        service, in the next world, once it is decided (any node may decide it)."""
        cv = self.roster.cv
        while True:
            with cv:
                cv.wait_for(lambda: bool(self._respawning) or self.plane.closed)
                if self.plane.closed:
                    return
                generation = min(self._respawning.values())
                first = min(w for w, g in self._respawning.items() if g == generation)
                if self._stopping():  # (a fresh process never got the stop: none now)
                    self._restart(generation, {})
                    continue
            try:  # drives the decision; the others' arrivals are in (`_worker_gone`)
                self.plane.agree(wire.Agree(worker_id=first, generation=generation,
                                            last_step=ANY_STEP))
            except AgreementError as e:
                logger.warning("mnemojax launch: agreement for the restart failed: %s", e)
                time.sleep(0.1)
            except Exception:  # the thread must live on: the next world may still come
                logger.exception("mnemojax launch: error while restarting workers")
                time.sleep(0.5)
            with cv:
                record = self.plane.view.world(generation + 1)
                if record is not None:
                    self._restart(generation, record)
                elif self.plane.ending() is not None or first in self.plane.view.dead():
                    self._restart(generation, {})  # no next world for them: dead

    def _restart(self, generation: int, record: dict[str, Any]) -> None:
        """Starts this node's workers that crashed with world ``generation``'s service and
        are members of world ``generation + 1`` (``record``); the others are dead
        (``roster.cv`` held)."""
        for w in sorted(w for w, g in self._respawning.items() if g == generation):
            del self._respawning[w]
            if agreement_of(record, w) is None:
                self._record({"op": "respawn_failed", "worker_id": w,
                              "generation": generation})
                self.plane.publish_exit(w, self.roster.exit_codes.get(w, -1))
                self.plane.member_died(w)
            else:
                self._restart_one(w, generation + 1, record)
        self.roster.cv.notify_all()

    def _restart_one(self, worker_id: int, generation: int, record: dict[str, Any]) -> None:
        """Starts a fresh process for ``worker_id`` in world ``generation``, with its
        agreement in ``MNEMOJAX_RESUME`` (``roster.cv`` held)."""
        o, view = self.options, self.plane.view
        agreement = agreement_of(record, worker_id)
        assert agreement is not None
        if worker_id not in self.roster.links:  # its agent is gone: nothing to start it
            self._record({"op": "respawn_failed", "worker_id": worker_id,
                          "generation": generation, "why": "agent lost"})
            self.plane.member_died(worker_id)
            return
        agents = view.agents()
        order = ring([m for m in record.get("members", ()) if m in agents], o.nproc,
                     view.homes())
        w = worker_id
        nxt = order[(order.index(w) + 1) % len(order)] if w in order else None
        self.roster.exit_codes.pop(w, None)
        self.roster.command(w, wire.Start(env={
            **worker_env(o, w, coordinator=agreement.coordinator, control=self.control,
                         extra_env=self.extra_env),
            env.PROCESS_ID: str(agreement.process_id),
            env.NUM_PROCESSES: str(agreement.num_processes),
            env.GENERATION: str(generation),
            env.RESUME: json.dumps(wire.AgreementReply(agreement=agreement).to_wire())},
            buddy=agents.get(nxt) if nxt is not None and len(order) > 1 else None))
        self._record({"op": "restarted", "worker_id": w, "generation": generation,
                      "resume_step": agreement.resume_step})
        logger.warning("mnemojax launch: worker %d restarted into world %d, %s", w,
                       generation, agreement.resume_said)

    def _agents_to_retire(self) -> tuple[int, list[int]]:
        # Every member's publishes in the current world: this node's from its own count,
        # the others' from their ``progress/<rank>`` (written every `PROGRESS_EVERY_S`).
        view = self.plane.view
        g = view.latest()
        members = view.worlds().get(g, ())
        if (g <= 0 or g != self._world_seen or not members or view.arrivals(g)
                or view.dead() & set(members) or view.regrows(g)):
            return g, []  # (a recovery under way may need any copy)
        counts = {**view.publishes(g), **{w: len(s) for w, s in self._published.items()}}
        if any(counts.get(m, 0) < RETIRE_AFTER_PUBLISHES for m in members):
            return g, []
        return g, [w for w in self._out_of_the_job(members) if w not in self._respawning]

    def agent_joined(self, hello: wire.Hello, link: socket.socket) -> None:
        with self.roster.cv:  # a restart's agent: reachable by the others before it joins
            if hello.worker_id in self._restarted and self._lease is not None:
                self.plane.publish_agent(hello.worker_id, hello.address, self._lease.lease)
        super().agent_joined(hello, link)

    def _start_fresh(self, worker_id: int, why: str, *, free: bool) -> None:
        # The id is claimed in etcd (no node may take it too), off the launcher's lock.
        threading.Thread(target=self._claim_and_start, args=(worker_id, why, free),
                         name="mnemojax-restart", daemon=True).start()

    def _claim_and_start(self, worker_id: int, why: str, free: bool) -> None:
        """Claims a fresh worker id for a restart of ``worker_id`` (``rejoin/<id>``, as a
        node that rejoins claims its ids; ``home/<id>`` says it runs here), then starts its
        agent. Tried again while etcd does not answer, up to ``etcd_outage_s``."""
        o = self.options
        initial = range(o.world_size, o.world_size + o.nnodes * o.spares)
        deadline = time.monotonic() + o.etcd_outage_s
        while True:
            try:
                view = JobView(self.store.items(), o.nproc)
                if view.end() is not None or view.stopping() is not None:
                    logger.info("mnemojax launch: worker %d is not restarted: the job is "
                                "ending", worker_id)
                    return
                with self.roster.cv:
                    taken = set(self.agents) | set(self._restarted)
                fresh = max(view.used_ids(initial) | taken, default=-1) + 1
                if self.store.create(self.store.key("rejoin", fresh), {
                        "node": o.node_rank, "count": 1, "restarts": worker_id},
                        unless=[self.store.key("end")]):
                    self.store.put(self.store.key("home", fresh), o.node_rank)
                    break
            except FencedOutError:
                logger.warning("mnemojax launch: worker %d is not restarted: the other nodes "
                               "took this node for lost", worker_id)
                return
            except RendezvousError as e:
                if time.monotonic() > deadline:
                    logger.error("mnemojax launch: worker %d is not restarted: etcd did not "
                                 "answer for %.0f s (%s)", worker_id, o.etcd_outage_s, e)
                    return
                time.sleep(0.5)
        with self.roster.cv:  # (the launcher may be past its loop: no agent to start then)
            if not self._stopping_now() and not self.plane.closed:
                self._fresh_started(fresh, worker_id, why, free=free)

    def agent_lost(self, worker_id: int) -> None:
        self.plane.forget_agent(worker_id)
        with self.roster.cv:
            if self._respawning.pop(worker_id, None) is not None:  # nothing to restart it
                self.plane.member_died(worker_id)
        super().agent_lost(worker_id)

    def _say_died(self, worker_id: int, code: int, *, evicted: bool = False) -> None:
        del worker_id, code, evicted  # (said from etcd's keys, for every node: `_on_view`)

    def _spare_warm(self, worker_id: int) -> None:
        # Warm (Python and JAX loaded, waiting): only now may a world take it in
        # (`plane.JobView.idle_spares`), so no world waits on a cold start.
        self._offer_spares()

    def _offer_spares(self) -> None:
        """Publishes this node's spares a world may take in now (`_warm_spares`: warm, idle
        and asking to join), and takes back those that stopped asking (a frozen process:
        a trial's SIGSTOPped spare stalled a recovery until the agreement timeout) or may
        join no more (the job stops); ``roster.cv`` held."""
        if self._lease is None:
            return
        offer = set(self._warm_spares())
        for w in sorted(offer - self._offered):
            self.plane.publish_spare(w, self.options.node_rank, self._lease.lease)
            if w in self._withdrawn:
                self._withdrawn.discard(w)
                self.plane.spare_asks_again(w)
                logger.warning("mnemojax launch: spare %d asks to join again", w)
        for w in sorted((self._offered - offer) & self._idle):  # (one that joined stays)
            quiet = not self._stopping_now() and self._spares_refused is None
            self.plane.withdraw_spare(w, quiet_lease=self._lease.lease if quiet else None)
            self._record({"op": "spare_withdrawn", "worker_id": w})
            if quiet:
                self._withdrawn.add(w)
                logger.warning("mnemojax launch: spare %d stopped asking to join (a frozen "
                               "or stalled process): no world takes it in until it asks "
                               "again", w)
        self._offered = offer  # (a spare that joined is no longer offered, nor taken back)

    def _join_refused(self, worker_id: int) -> str | None:
        why = self.plane.ending()
        if why is None and worker_id in self.plane.view.dead():
            why = f"spare {worker_id} is dead"
        return why

    def _left_elsewhere(self) -> set[int]:
        return self.plane.view.left()

    def _exit_codes(self) -> dict[int, int]:
        return {**self.plane.view.exits(), **self.roster.exit_codes}

    def _finished(self) -> int | None:
        if self._lease_lost:  # the others have declared this node's workers dead
            why = self._lease.why if self._lease is not None else "its etcd lease is gone"
            self._record({"op": "lease_lost", "why": why})
            logger.error("mnemojax launch: node %d: %s; ending its part (status 1)",
                         self.options.node_rank, why)
            return 1
        return super()._finished()

    def _start(self) -> None:
        o, cv = self.options, self.roster.cv
        if self.store.get(self.store.key("end")) is not None:
            raise WorldConfigError(f"rdzv_id={o.rdzv_id!r} names a job that has ended: give "
                                   "each run its own --rdzv-id")
        if self.store.items("world/"):
            if not o.grow_back:
                raise WorldConfigError(
                    f"rdzv_id={o.rdzv_id!r} names a job that is running or has run (its "
                    "worlds are in etcd): give each run its own --rdzv-id, or --grow-back "
                    "to rejoin it")
            self._rejoin_ids()
            o = self.options
        self._control.start()
        self.supervisor.start()
        with cv:
            count = len(o.local_agents)
            if not cv.wait_for(lambda: len(self.roster.addresses) == count, timeout=60):
                raise DistributedError(
                    f"only {len(self.roster.addresses)}/{count} agents said hello")
            agents = dict(self.roster.addresses)
        self._lease = LeaseKeeper(self.store, o.node_ttl_s, on_lost=self._on_lease_lost,
                                  outage_s=o.etcd_outage_s)
        for w, address in agents.items():
            self.store.put(self.store.key("agents", w), address, lease=self._lease.lease)
        for w in o.spare_ids:  # joinable once warm (`_await_join`)
            self.store.put(self.store.key("home", w), o.node_rank)
        self._register({"pid": os.getpid(), "control": self.control,
                        "workers": list(o.local_workers), "shm_prefix": self.shm_prefix,
                        "nproc": o.nproc, "nnodes": o.nnodes, "spares": o.spares,
                        "secret_id": auth.fingerprint(self.secret),
                        "agent_pids": {str(w): p.pid for w, p in self.agents.items()}})
        # Every write from now on needs this registration (this lease's), which the
        # others' view of this node lives by (`EtcdStore.fence`).
        self.store.fence(self.store.key("nodes", o.node_rank), self._lease.lease)
        self.plane.start()
        self._progress_thread = threading.Thread(target=self._progress_loop,
                                                 name="mnemojax-progress", daemon=True)
        self._progress_thread.start()
        view = self._wait_view(lambda v: len(v.live_nodes()) == o.nnodes
                               or v.world(0) is not None,
                               f"all {o.nnodes} nodes to register",
                               missing=lambda v: sorted(set(range(o.nnodes)) - v.live_nodes()))
        try:
            self._check_nodes(view)
        except WorldConfigError as e:  # (the others must not wait for this node)
            with contextlib.suppress(Exception):
                self.store.put(self.store.key("refused", o.node_rank), {"why": str(e)})
            raise
        if o.rejoin_first_id is not None:
            with cv:
                self._start_spares()
            self._record({"op": "rejoined", "generation": view.latest(),
                          "spares": list(o.spare_ids)})
            logger.warning("mnemojax launch: node %d rejoined the running job (world %d) "
                           "with spares %s", o.node_rank, view.latest(), list(o.spare_ids))
            threading.Thread(target=self._respawn_loop, name="mnemojax-respawn",
                             daemon=True).start()
            return
        if view.world(0) is None and o.node_rank == min(view.live_nodes()):
            service = self.services.start(0, o.world_size)
            if not self.store.create(self.store.key("world", 0), {
                    "members": list(range(o.world_size)), "coordinator": service.address,
                    "host_node": o.node_rank}):
                self.services.stop(0)
        view = self._wait_view(lambda v: v.world(0) is not None, "world 0")
        record = view.world(0) or {}
        self._record({"op": "world", "generation": 0, "members": record["members"],
                      "coordinator": record["coordinator"], "host_node": record["host_node"]})
        logger.warning("mnemojax launch: world 0: workers %s, coordination service on node "
                       "%s (%s); this node %d runs workers %s", record["members"],
                       record["host_node"], record["coordinator"], o.node_rank,
                       list(o.local_workers))
        threading.Thread(target=self._respawn_loop, name="mnemojax-respawn",
                         daemon=True).start()
        everyone = view.agents()
        order = ring(list(range(o.world_size)), o.nproc)
        with cv:
            for w in o.local_workers:
                nxt = order[(order.index(w) + 1) % len(order)]
                self.roster.command(w, wire.Start(
                    env=worker_env(o, w, coordinator=record["coordinator"],
                                   control=self.control, extra_env=self.extra_env),
                    buddy=everyone.get(nxt) if len(order) > 1 else None))
            self._start_spares()

    def _rejoin_ids(self) -> None:
        """Takes fresh worker ids for this node, which rejoins a running job
        (``--grow-back``): after every id the job has used, claimed once in etcd
        (``rejoin/<first id>``). First waits until no world member is one of this node's
        old workers (the survivors have left them out): this node's new lease must not
        make them look alive.

        Raises:
            DistributedError: they are still members after `FORM_TIMEOUT_S`.
        """
        o = self.options
        count = o.nproc + o.spares
        initial = range(o.world_size, o.world_size + o.nnodes * o.spares)
        deadline = time.monotonic() + FORM_TIMEOUT_S
        claim = {"node": o.node_rank, "count": count, "nonce": secrets.token_hex(8)}
        said = started = time.monotonic()
        while True:
            view = JobView(self.store.items(), o.nproc)
            if view.end() is not None:
                raise WorldConfigError(f"node {o.node_rank} cannot rejoin: the job is "
                                       f"ending ({view.end()})")
            if view.stopping() is not None:
                raise WorldConfigError(f"node {o.node_rank} cannot rejoin: the job is "
                                       f"stopping ({view.stopping()})")
            if view.finished_nodes() and not view.live_nodes():
                raise WorldConfigError(f"node {o.node_rank} cannot rejoin: the job has "
                                       f"finished (nodes {sorted(view.finished_nodes())} "
                                       "ended their part)")
            if (o.node_rank in view.live_nodes()
                    and time.monotonic() > started + o.node_ttl_s + 2):
                # (a lost launcher's key lives until its lease ends: waited for that)
                other = self.store.get(self.store.key("nodes", o.node_rank)) or {}
                raise WorldConfigError(
                    f"node {o.node_rank} cannot rejoin: it is running (launcher pid "
                    f"{other.get('pid')}); --grow-back restarts a node that was lost")
            current = view.worlds().get(view.latest(), ())
            exits = view.exits()
            mine = [w for w in current if view.node(w) == o.node_rank and w not in exits]
            if mine and time.monotonic() - said >= SAY_WAIT_S:
                said = time.monotonic()
                logger.warning("mnemojax launch: node %d waits to rejoin: its old workers %s "
                               "are still members of world %d (until the others leave "
                               "them out, at most %.0f s)", o.node_rank, mine,
                               view.latest(), FORM_TIMEOUT_S)
            if not mine:
                first = max(view.used_ids(initial), default=-1) + 1
                if self.store.create(self.store.key("rejoin", first), claim,
                                     unless=[self.store.key("end")]):
                    break
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"node {o.node_rank} cannot rejoin: its old workers {mine} are still "
                    f"members of world {view.latest()} after {FORM_TIMEOUT_S:.0f} s"
                    if mine else f"node {o.node_rank} could not claim worker ids in "
                    f"{FORM_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        self.options = dataclasses.replace(o, rejoin_first_id=first)
        self.supervisor.options = self.options
        # What happened before is not this node's news.
        self._world_seen = view.latest()
        self._dead_seen = set(view.dead())
        self._record({"op": "rejoin_ids", "first": first, "count": count})

    def _check_nodes(self, view: JobView) -> None:
        """Every node was launched alike: the same workers per node, node count and secret.

        Raises:
            WorldConfigError: naming the node and the value that differ.
        """
        o = self.options
        mine = {"nproc": o.nproc, "nnodes": o.nnodes, "spares": o.spares,
                "secret_id": auth.fingerprint(self.secret)}
        for key, record in sorted(view.items.items()):
            if key.startswith("nodes/") and isinstance(record, dict):
                for name, value in mine.items():
                    if record.get(name) != value:
                        what = "MNEMOJAX_JOB_SECRET" if name == "secret_id" else name
                        raise WorldConfigError(
                            f"node {key.split('/')[1]} was launched with another {what} "
                            f"than node {o.node_rank}" + (
                                "" if name == "secret_id"
                                else f" ({record.get(name)} != {value})"))

    def _register(self, node: dict[str, Any]) -> None:
        """Registers this node under its rank, with its lease; a rank another live
        launcher holds is waited for up to the node lease (a restarted host's old entry
        ends with it), then refused.

        Raises:
            WorldConfigError: another launcher of this job holds the rank.
        """
        o = self.options
        key = self.store.key("nodes", o.node_rank)
        deadline = time.monotonic() + o.node_ttl_s + 2
        assert self._lease is not None
        while not self.store.create(key, node, lease=self._lease.lease):
            if time.monotonic() > deadline:
                other = self.store.get(key) or {}
                raise WorldConfigError(
                    f"node rank {o.node_rank} is taken: another launcher of job "
                    f"{o.rdzv_id!r} holds it (pid {other.get('pid')}, control "
                    f"{other.get('control')}); give each node its own --node-rank "
                    f"(0..{o.nnodes - 1})")
            time.sleep(0.5)

    def _wait_view(self, ready: Callable[[JobView], bool], what: str, *,
                   missing: Callable[[JobView], list[int]] | None = None) -> JobView:
        """The job's view once `ready`; says every `SAY_WAIT_S` what is awaited (with
        `missing`: the node ranks not yet there).

        Raises:
            DistributedError: not ready within `FORM_TIMEOUT_S`, naming what is missing.
        """
        o = self.options
        t0 = time.monotonic()
        with self.roster.cv:
            while not ready(view := self.plane.view):
                waited = time.monotonic() - t0
                if missing and (refused := view.refused()):
                    rank, why = sorted(refused.items())[0]
                    raise WorldConfigError(f"node {o.node_rank}: node {rank} refused to run "
                                           f"the job: {why}")
                absent = f"; nodes {missing(view)} have not registered" if missing else ""
                if waited >= FORM_TIMEOUT_S:
                    hint = (": is each launched with the same --rdzv and --rdzv-id "
                            f"{o.rdzv_id!r}, --nnodes {o.nnodes}, its own --node-rank and "
                            "the same job secret (MNEMOJAX_JOB_SECRET)?") if missing else ""
                    raise DistributedError(f"node {o.node_rank}: waited "
                                           f"{FORM_TIMEOUT_S:.0f} s for {what} in etcd"
                                           f"{absent}{hint}")
                if waited >= SAY_WAIT_S:
                    logger.warning("mnemojax launch: node %d: waiting for %s (%.0f s of "
                                   "%.0f s)%s", o.node_rank, what, waited, FORM_TIMEOUT_S,
                                   absent)
                self.roster.cv.wait_for(lambda: ready(self.plane.view),
                                        timeout=min(SAY_WAIT_S, FORM_TIMEOUT_S - waited))
            return view

    def _progress_loop(self) -> None:
        """Writes this node's workers' newest published steps to ``progress/<rank>``
        every `PROGRESS_EVERY_S` when they changed (``mnemojax status`` reads them; not
        under the lease: a finished job still shows where it got to)."""
        while not self._progress_stop.wait(PROGRESS_EVERY_S):
            self._put_progress(retry_s=PROGRESS_EVERY_S)

    def _put_progress(self, *, retry_s: float) -> None:
        with self.roster.cv:
            steps = dict(self.steps)
            # Its workers' publishes in the current world, for the other nodes'
            # `_agents_to_retire`.
            counted = (self._world_seen, {w: len(s) for w, s in self._published.items()})
        if not steps or (steps, counted) == self._progress_put:
            return
        try:
            self.store.put(self.store.key("progress", self.options.node_rank),
                           {"steps": {str(w): s for w, s in sorted(steps.items())},
                            "generation": counted[0],
                            "publishes": {str(w): n for w, n in sorted(counted[1].items())},
                            "t": time.time()}, retry_s=retry_s)
        except RendezvousError as e:  # etcd out of reach: the next round tries again
            logger.debug("mnemojax launch: progress not written: %s", e)
        else:
            self._progress_put = (steps, counted)

    def _stopping(self) -> bool:
        """A stop signal reached this node or another (call with ``roster.cv`` held)."""
        return (bool(self._stop_signals) or self._stop_forwarded is not None
                or self.plane.view.stopping() is not None)

    def _others_running(self) -> bool:
        """Whether a member of the current world on another node has neither exited nor
        died (call with ``roster.cv`` held)."""
        view = self.plane.view
        exits, dead = view.exits(), view.dead()
        return any(view.node(m) != self.options.node_rank and m not in exits
                   and m not in dead for m in view.worlds().get(view.latest(), ()))

    def cleanup(self) -> None:
        with self.roster.cv:  # (before cleanup kills what is left: a clean end only)
            done = (self._ended_by_job and not self._lease_lost and self._lease is not None
                    and all(w in self.roster.exit_codes for w in self.roster.worker_pids))
            codes = {str(w): c for w, c in sorted(self.roster.exit_codes.items())}
        super().cleanup()
        if done:  # (before the lease goes: the others must not take it for a node lost)
            with contextlib.suppress(Exception):  # (etcd gone: it is lost to them, as before)
                self.store.put(self.store.key("finished", self.options.node_rank),
                               {"exit_codes": codes})
        self._progress_stop.set()
        if self._progress_thread is not None:
            self._progress_thread.join(timeout=PROGRESS_EVERY_S)
            if not self._progress_thread.is_alive():  # (else still writing: no race)
                self._put_progress(retry_s=2.0)  # the last steps, for a job that has ended
        self.plane.join()
        if self._lease is not None:
            self._lease.close(revoke=True)
            self._lease = None
