"""The launcher: one job, from the agents' start to the last worker's exit.

`Launcher.run` is the whole job: start the control endpoint (`control`) and the agents
(`supervisor`), wait for every agent's hello, start the recoverable coordination service of
world 0 (`services`), tell each agent to start its worker (environment: `options.worker_env`)
and who its ring buddy is, then serve agent events and the survivors' agreement calls
(`arbiter`) until the current world's workers have all exited. The launcher itself keeps
the job's state: the event log, who failed, and when the job is over.

**Spares** (``--spares S``): agents whose workers start with the job and wait, warm, in
``mnemojax.initialize()`` (`wire.AwaitJoin`, answered here once a world takes them in).
**Restarts** (``--max-restarts N``, one machine): a worker that crashes or leaves the job
is replaced by a fresh agent and warm spare with a new id; a world that shrank re-forms
at world 0's size once warm spares can fill every rank it lost (`Launcher._maybe_regrow`,
`Arbiter.request_regrow`). The node launcher (`node`) shares the spares' half.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from mnemojax._src.distributed import auth, env, shm, wire
from mnemojax._src.distributed.agreement import Agreement
from mnemojax._src.distributed.launcher.arbiter import Arbiter, WorldArbiter
from mnemojax._src.distributed.launcher.control import ControlServer
from mnemojax._src.distributed.launcher.options import LaunchOptions, worker_env
from mnemojax._src.distributed.launcher.roster import AgentRoster
from mnemojax._src.distributed.launcher.services import ServiceHost
from mnemojax._src.distributed.launcher.supervisor import AgentSupervisor
from mnemojax._src.errors import AgreementError, DistributedError

logger = logging.getLogger("mnemojax")

# A worker's `wire.ReportFailure` whose reason starts so carries the user's exception it
# ends with (`worker.session.UNCAUGHT`, the same text; the launcher imports no worker code).
UNCAUGHT = "uncaught exception: "

# A spare between two join polls (one answered, the next on its way: a new connection and
# its handshake, slower on a loaded host) is still asking.
POLL_GAP_S = 3.0

# A spare a world took in must say it has its agreement (`wire.AwaitJoin` once more) this
# long after: one that does not (frozen, stalled) is declared dead, and the world forms
# again without it, instead of waiting for it at the agreement's and barriers' timeouts.
JOIN_ACK_S = 10.0

# The agent of a worker out of the job is ended once every member of the world after it
# has published this many steps after the one that world resumed from
# (`Launcher._retire_agents`): with the default wait before a slot is overwritten, each
# member's own agent then holds two steps of that world and its buddy the first of them,
# so no later agreement goes back to the copies the retired agent holds. (Distinct steps:
# a late publish of the world before, one step ahead at most, cannot count twice.)
RETIRE_AFTER_PUBLISHES = 2


class Launcher:
    """Runs one job. ``on_event(event)`` sees every event (tests and demos use it).

    Events are dicts with an ``op``: the agents' `wire.AgentEvent` s and the workers'
    requests as sent (`wire.Message.to_wire`), and the launcher's own (``agent_lost``,
    ``evicted``, ``corrupt_copy``, ``decided``, ``old_service_stopped`` (its shutdown
    started, on a thread: `ServiceHost.stop`), ``job_timeout``, ``worker_error``).

    A worker killed by a signal (negative exit status) is a crash: the survivors recover.
    A worker that leaves (`wire.Leave`: a recovery gave its process no device, or it joined
    and could not fetch the agreed state) is no longer a member, as if dead, and its exit
    ends nothing, whatever its status.
    A worker that exits with a positive status ended itself (the user's exception, or
    ``sys.exit(n)``): the job ends with that status, never recovered.

    Attributes:
        events: every event, each with ``t`` (``time.time()``), but ``progress`` (one per
            worker and step: `on_event` sees it, `steps` keeps its news), so the list grows
            with the job's failures, not with its length.
        steps: worker id -> the newest step its agent said it published.
        agents: worker id -> agent ``Popen``; ``worker_pids``: worker id -> worker pid.
        agent_addr: worker id -> address of its (live) agent.
        exit_codes: worker id -> its worker's exit status.
        control: the control endpoint's ``host:port``.
        shm_prefix: the prefix of every shared-memory segment of this job.
    """

    def __init__(self, options: LaunchOptions, command: Sequence[str], *,
                 extra_env: dict[str, str] | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 secret: bytes | None = None):
        self.options, self.command = options, list(command)
        self.extra_env = dict(extra_env or {})
        self.on_event = on_event
        self.events: list[dict[str, Any]] = []
        self.steps: dict[int, int] = {}
        # Worker -> the steps it has published in the current world after its resume step
        # (`_retire_agents`), and that step.
        self._published: dict[int, set[int]] = {}
        self._resume_step = -1
        self._retired: set[int] = set()  # agents ended as their copies were outdated
        # Proves every connection of this job (`auth`); several nodes share one.
        self.secret = auth.new_secret() if secret is None else secret
        self.roster = AgentRoster(secret=self.secret)
        self.services = ServiceHost(heartbeat_s=options.heartbeat_s, host=options.host)
        self._idle: set[int] = set()  # warm spares waiting for a world (`wire.AwaitJoin`)
        self._warm: set[int] = set()  # spares that asked to join (Python and JAX loaded)
        self._joins: dict[int, Agreement] = {}  # spare -> the world that took it in
        # Spares taken in that have not said they have their agreement: when they were
        # taken in, and whether it was handed to them once (`_check_joins`).
        self._unacked: dict[int, tuple[float, bool]] = {}
        # Spares whose `wire.AwaitJoin` poll is open now, and when each last poll ended: a
        # spare that stops asking (a frozen process) is offered to no world
        # (`_asking_spares`).
        self._polling: dict[int, int] = {}
        self._asked_at: dict[int, float] = {}
        # `max_restarts`: workers started again as spares (fresh id -> the one it restarts),
        # and the next fresh id.
        self._restarted: dict[int, int] = {}
        self._restarts_used = 0  # (a joiner dropped by a world that never formed: free)
        self._dropped: set[int] = set()
        self._spares_refused: str | None = None  # why no spare can join (`_refuse_spares`)
        self._next_id = options.world_size + options.nnodes * options.spares
        self.arbiter: WorldArbiter = Arbiter(
            range(options.nproc), agree_timeout_s=options.agree_timeout_s,
            roster=self.roster, services=self.services, record=self._record,
            spares=self._warm_spares, on_join=self._spare_joined,
            on_drop=self._joiner_dropped)
        self._failed_code: int | None = None
        self._uncaught: dict[int, str] = {}  # worker id -> the exception it reported
        # The first worker that ended itself with a non-zero status (an uncaught exception,
        # sys.exit(n)): (worker id, status, when). It ends the job; nothing is recovered.
        self._worker_error: tuple[int, int, float] | None = None
        self._stop_signals: list[int] = []  # SIGTERM / SIGINT received, in order
        # A stop another node received (several nodes): stops this one too, but is not a
        # signal of its own (its own SIGTERM after it is a first one, not a second).
        self._stop_forwarded: int | None = None
        self._ended_by_job = False  # `run` ended as the job did (a stop, an end, a status)
        self._departed: set[int] = set()  # workers that left the job (`wire.Leave`): not dead
        self._leave_reasons: dict[int, str] = {}  # why each left (said if nobody is left)
        self._finished_workers: set[int] = set()  # reported their "finish" phase
        # Workers killed (a signal) since the last world was decided: if the job then ends
        # with the others finishing, no world recovered them (said at the end).
        self._unrecovered: dict[int, int] = {}
        self._control = ControlServer(self, secret=self.secret, on_refused=lambda peer, why:
                                      self._record({"op": "refused_connection",
                                                    "peer": peer, "reason": why}))
        self.control = self._control.address
        if orphans := shm.sweep_orphans():
            logger.info("removed %d shared-memory segment(s) of jobs whose launcher is gone: "
                        "%s%s", len(orphans), ", ".join(orphans[:4]),
                        ", ..." if len(orphans) > 4 else "")
        self.shm_prefix = shm.job_prefix()
        self._job_lock = shm.JobLock(self.shm_prefix)  # the job's segments live while held
        self.supervisor = AgentSupervisor(options, self.command, control=self.control,
                                          shm_prefix=self.shm_prefix, secret=self.secret)
        self.agents = self.supervisor.agents
        self.worker_pids = self.roster.worker_pids
        self.agent_addr = self.roster.addresses
        self.exit_codes = self.roster.exit_codes

    def _record(self, event: dict[str, Any]) -> None:
        event = {**event, "t": time.time()}
        if event["op"] == wire.Progress.OP:
            with self.roster.cv:  # (`_published` is cleared under it, below)
                w, step = event["worker_id"], event["step"]
                self.steps[w] = step
                if step > self._resume_step:
                    self._published.setdefault(w, set()).add(step)
        elif event["op"] in ("decided", "world"):  # (a new world: on several nodes, only
            with self.roster.cv:                   # the deciding node records "decided")
                self._unrecovered.clear()
                self._published.clear()
                resume = event.get("resume_step")
                self._resume_step = resume if isinstance(resume, int) else -1
        if event["op"] != wire.Progress.OP:
            self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    # -- what arrives on the control endpoint (`control.ControlHandler`) ----------------------
    def agent_joined(self, hello: wire.Hello, link: socket.socket) -> None:
        with self.roster.cv:
            self.roster.join(hello.worker_id, link, hello.address)
            if (hello.worker_id in self._restarted and hello.worker_id not in self._idle
                    and not self._stopping_now()):
                self._start_spare(hello.worker_id)  # a restart's agent: its worker, warm
            self.roster.cv.notify_all()
        self._record(hello.to_wire())

    def agent_event(self, worker_id: int, event: wire.AgentEvent) -> None:
        self._record(event.to_wire())
        if isinstance(event, wire.Hang):
            logger.warning("mnemojax launch: worker %d hung (no step done, or between steps "
                           "no sign of life, for %.0f s; its last step %s): its agent killed "
                           "it", worker_id, event.idle_s, event.step)
        with self.roster.cv:
            if isinstance(event, wire.WorkerStarted):
                self.roster.worker_pids[worker_id] = event.pid
            elif isinstance(event, wire.WorkerPhase) and event.phase == "finish":
                self._finished_workers.add(worker_id)
            elif isinstance(event, wire.WorkerExit):
                self._worker_gone(worker_id, event.code)
            self.roster.cv.notify_all()

    def agent_lost(self, worker_id: int) -> None:
        with self.roster.cv:
            retired = worker_id in self._retired
        self._record({"op": "agent_ended" if retired else "agent_lost", "worker_id": worker_id})
        with self.roster.cv:
            self.roster.leave(worker_id)
            self._worker_gone(worker_id, -signal.SIGKILL)
            self.roster.cv.notify_all()
        if not retired:
            self.supervisor.kill_group(worker_id, signal.SIGKILL)  # fence its worker

    def request(self, message: wire.Message) -> wire.Message:
        """Answers a worker's request (`control.ControlHandler`); `wire.Agree` and
        `wire.Barrier` block until their barrier is decided."""
        if isinstance(message, wire.ReportFailure):
            self._record(message.to_wire())
            if message.reason.startswith(UNCAUGHT):
                with self.roster.cv:
                    self._uncaught[message.worker_id] = message.reason[len(UNCAUGHT):]
            return wire.Ok()
        if isinstance(message, wire.Leave):
            self._record(message.to_wire())
            if message.reason.startswith(wire.Leave.NO_RESTORE):
                with self.roster.cv:
                    self._refuse_spares(message.reason[len(wire.Leave.NO_RESTORE):])
            logger.warning("mnemojax launch: worker %d leaves the job in world %d (%s); the "
                           "others go on without it", message.worker_id, message.generation,
                           message.reason)
            with self.roster.cv:
                member = message.worker_id in self.arbiter.live_members()
                self._departed.add(message.worker_id)
                self._leave_reasons[message.worker_id] = message.reason
                self.arbiter.member_left(message.worker_id)
                if member:  # the others re-form their world: they may block a while
                    self.roster.command_all(wire.PauseWatchdog(), but=message.worker_id)
                self.roster.cv.notify_all()
            return wire.Ok()
        if isinstance(message, wire.Agree):
            self._record(message.to_wire())
            if (error := self._worker_error) is not None:  # the job is ending: no new world
                return wire.ErrorReply(message=f"the job is ending: worker {error[0]} "
                                               f"exited with status {error[1]}")
            # (after a stop signal too, until its grace ends: a recovery under way
            # completes, and its survivors stop at an agreed step and checkpoint it)
            try:
                return wire.AgreementReply(agreement=self.arbiter.agree(message))
            except AgreementError as e:
                return wire.ErrorReply(message=str(e))
        if isinstance(message, wire.WatchWorld):  # not recorded: one per world and worker
            return self.arbiter.watch(message)
        if isinstance(message, wire.AwaitJoin):
            return self._await_join(message)
        if isinstance(message, wire.Barrier):
            self._record(message.to_wire())
            try:
                return self.arbiter.barrier(message)
            except AgreementError as e:
                return wire.ErrorReply(message=str(e))
        return wire.ErrorReply(message=f"unknown op {message.OP!r}")

    def _warm_spares(self) -> list[int]:
        """The spares a world may take in now: warm, idle and asking to join now (a frozen
        spare stops asking within `session.SPARE_POLL_S`), none while the job stops (each
        is being ended) or once a joiner found the job's loop not starting at
        ``step.restore()`` (``roster.cv`` held)."""
        if self._stopping_now() or self._spares_refused is not None:
            return []
        return sorted(self._idle & self._warm & self._asking_spares())

    def _asking_spares(self) -> set[int]:
        """Spares whose join poll is open, or ended within `POLL_GAP_S` (the moment between
        one poll's answer and the next is no sign of a frozen process) (``roster.cv``
        held)."""
        now = time.monotonic()
        for w in [w for w, t in self._asked_at.items() if now - t > POLL_GAP_S]:
            del self._asked_at[w]  # (else one entry per spare that ever polled)
        return set(self._polling) | set(self._asked_at)

    def _check_joins(self) -> None:
        """A spare taken into a world that has not said it has its agreement within
        `JOIN_ACK_S` (a frozen process: a trial's stalled a recovery for ~1.5 x the
        agreement timeout) is declared dead and killed: the members meet its death at
        their barrier and form the world again without it (``roster.cv`` held)."""
        now = time.monotonic()
        for w, (since, handed) in list(self._unacked.items()):
            if w in self.roster.exit_codes:
                del self._unacked[w]
            elif now - since > JOIN_ACK_S:
                del self._unacked[w]
                self._record({"op": "evicted", "worker_id": w, "why": "joined, then silent"})
                logger.warning(
                    "mnemojax launch: spare %d, taken into world %d, did not say it has its "
                    "agreement within %.0f s (%s): it is declared dead and the world forms "
                    "again without it", w, self._joins[w].generation, JOIN_ACK_S,
                    "it never asked for it" if not handed else "frozen or stalled since")
                self._evict_joiner(w)

    def _evict_joiner(self, worker_id: int) -> None:
        """Declares a spare that joined dead and kills it (``roster.cv`` held)."""
        self.arbiter.member_died(worker_id, (
            f"evicted: taken into world {self._joins[worker_id].generation}, it did not say "
            f"it has its agreement within {JOIN_ACK_S:.0f} s (frozen or stalled)"))
        self.roster.command(worker_id, wire.KillWorker())

    def _offer_spares(self) -> None:
        """Tells the other nodes which spares a world may take in now (``roster.cv`` held):
        one launcher has nobody to tell, its arbiter asks `_warm_spares`."""

    def _refuse_spares(self, why: str) -> None:
        """A spare that joined could not run the job's loop (it does not start at
        ``step.restore()``): no spare joins from now on, none is restarted (``roster.cv``
        held)."""
        if self._spares_refused is None:
            self._spares_refused = why
            self._record({"op": "spares_refused", "why": why})
            logger.error("mnemojax launch: no spare can join this job, none joins from now "
                         "on (the job goes on without): %s", why)

    def _joiner_dropped(self, worker_id: int) -> None:
        """A joiner of a world that never formed is killed (`Arbiter._decide`): its exit
        is no failure (``roster.cv`` held)."""
        self._departed.add(worker_id)
        self._dropped.add(worker_id)
        self._leave_reasons[worker_id] = "the world it joined never formed"

    def _spare_joined(self, worker_id: int, agreement: Agreement) -> None:
        """A world took spare ``worker_id`` in: its `wire.AwaitJoin` gets ``agreement``
        (call with ``roster.cv`` held)."""
        self._idle.discard(worker_id)
        self._joins[worker_id] = agreement
        self._unacked[worker_id] = (time.monotonic(), False)
        self._record({"op": "joined", "worker_id": worker_id,
                      "generation": agreement.generation,
                      "replaces": agreement.replaces.get(worker_id)})
        logger.warning("mnemojax launch: spare %d joined world %d at worker %s's rank, %s",
                       worker_id, agreement.generation, agreement.replaces.get(worker_id),
                       agreement.resume_said)
        self.roster.cv.notify_all()

    def _await_join(self, request: wire.AwaitJoin) -> wire.Message:
        """A warm spare's long poll: its agreement once a world takes it in; an error once
        the job ends (it exits 0)."""
        w, cv = request.worker_id, self.roster.cv
        deadline = time.monotonic() + request.timeout_s
        with cv:
            self._polling[w] = self._polling.get(w, 0) + 1
            if w in self._idle and w not in self._warm:
                self._warm.add(w)  # only now may a world take it in: none waits on a cold
                self._spare_warm(w)  # start
            try:
                while (agreement := self._joins.get(w)) is None:
                    why = self._join_refused(w)
                    if why is not None:
                        return wire.ErrorReply(message=why)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return wire.Joined()
                    cv.wait(timeout=min(left, 0.5))
                if (unacked := self._unacked.get(w)) is not None:
                    if unacked[1]:  # asked again with its agreement in hand: alive
                        del self._unacked[w]
                    else:
                        self._unacked[w] = (unacked[0], True)
                return wire.Joined(agreement=agreement)
            finally:
                self._polling[w] -= 1
                if not self._polling[w]:
                    del self._polling[w]
                    self._asked_at[w] = time.monotonic()

    def _spare_warm(self, worker_id: int) -> None:
        """Spare ``worker_id`` waits, warm (call with ``roster.cv`` held): one launcher
        has nobody to tell."""
        del worker_id

    def _join_refused(self, worker_id: int) -> str | None:
        """Why spare ``worker_id`` will never join (the job ends), or None (call with
        ``roster.cv`` held)."""
        if worker_id not in self._idle:
            return f"spare {worker_id} is not waiting for a world"
        return self.arbiter.ending()

    def _start_spares(self) -> None:
        """Starts this launcher's spares warm: each waits in ``mnemojax.initialize()``
        until a world takes it in (``roster.cv`` held)."""
        for w in self.options.spare_ids:
            self._start_spare(w)

    def _start_spare(self, worker_id: int) -> None:
        """Tells agent ``worker_id`` to start its worker as a warm spare (``roster.cv``
        held)."""
        self._idle.add(worker_id)
        self.roster.command(worker_id, wire.Start(env={
            **worker_env(self.options, worker_id, coordinator="", control=self.control,
                         extra_env=self.extra_env), env.SPARE: "1"}, buddy=None))

    def _restart_as_spare(self, worker_id: int, why: str, *, free: bool = False) -> bool:
        """``max_restarts``: starts a fresh process (a new agent and a warm spare, with a
        new id) for worker ``worker_id``, which crashed, left the job or ended as a spare
        (``roster.cv`` held); whether it did. Not once the job is stopping or ending, nor
        past the budget (``free``: a healthy process the launcher ended, not charged), nor
        once a worker has finished its loop (the job is ending 0)."""
        o = self.options
        if (not o.max_restarts or not o.recover or self._stopping_now()
                or self._spares_refused is not None or self._loop_done()):
            return False
        if not free and self._restarts_used >= o.max_restarts:
            self._record({"op": "restarts_used", "worker_id": worker_id})
            logger.warning("mnemojax launch: worker %d %s: not restarted, all %d restarts "
                           "(--max-restarts%s) are used (a spare may still take its rank)",
                           worker_id, why, o.max_restarts,
                           ", per node" if o.nnodes > 1 else "")
            return False
        self._restarts_used += not free
        self._start_fresh(worker_id, why, free=free)
        return True

    def _loop_done(self) -> bool:
        """A worker of the job exited 0 other than by leaving it: its loop is done, the job
        is ending (``roster.cv`` held)."""
        left = self._departed | self._left_elsewhere()
        return bool(self._finished_workers) or any(
            code == 0 and w not in left for w, code in self._exit_codes().items())

    def _left_elsewhere(self) -> set[int]:
        """Workers of other launchers that left the job (``roster.cv`` held)."""
        return set()

    def _start_fresh(self, worker_id: int, why: str, *, free: bool) -> None:
        """Starts the fresh process of a restart of ``worker_id`` under the next unused id
        (``roster.cv`` held)."""
        fresh, self._next_id = self._next_id, self._next_id + 1
        self._fresh_started(fresh, worker_id, why, free=free)

    def _fresh_started(self, fresh: int, worker_id: int, why: str, *, free: bool) -> None:
        """Starts agent ``fresh`` (its worker is started as a warm spare once it says
        hello: `agent_joined`) in place of ``worker_id`` (``roster.cv`` held)."""
        self._restarted[fresh] = worker_id
        self.supervisor.start_agent(fresh)
        self._record({"op": "restarting", "worker_id": fresh, "restarts": worker_id,
                      "why": why, "charged": not free})
        logger.warning("mnemojax launch: worker %d %s: starting spare %d in its place "
                       "(%s); the job grows back once spares can fill every rank it lost",
                       worker_id, why, fresh, "not charged" if free else
                       f"restart {self._restarts_used} of {self.options.max_restarts}")

    def _maybe_regrow(self) -> None:
        """Asks the current world to re-form at world 0's size once warm spares can fill
        every rank it lost (one machine; ``roster.cv`` held)."""
        arbiter = self.arbiter
        if not isinstance(arbiter, Arbiter) or not self.options.recover:
            return
        warm = self._warm_spares()  # (none while the job stops or ends)
        if not warm or any(m in self._finished_workers or m in self.roster.exit_codes
                           for m in arbiter.book.members):
            return  # (a member done with its loop would never come to the agreement)
        if (g := arbiter.regrow_due(len(warm))) is not None:
            arbiter.request_regrow(g)
            self._record({"op": "regrow", "generation": g, "spares": warm})
            logger.warning("mnemojax launch: world %d has %d of world 0's %d workers, and "
                           "spares %s are ready to fill it: it re-forms, larger", g,
                           len(arbiter.book.members), len(arbiter.worlds[0]), warm)

    def _retire_agents(self) -> None:
        """Ends the agents of workers out of the job (dead, left, restarted under a new id,
        spares that ended) once every member of the current world has published
        `RETIRE_AFTER_PUBLISHES` snapshots in it (`_agents_to_retire`): their copies are
        outdated, and each held its worker's share twice and its ring predecessor's twice
        in host memory (with ``max_restarts``, one more agent per restart). ``roster.cv``
        held."""
        if self._stopping_now():
            return
        for w in self._retired:  # (reaped: no zombie until the end)
            if (proc := self.agents.get(w)) is not None:
                proc.poll()
        generation, out = self._agents_to_retire()
        if not out:
            return
        self._retired.update(out)
        self._record({"op": "agents_retired", "workers": out, "generation": generation})
        logger.info("mnemojax launch: the agents of workers %s are ended: world %d has "
                    "published %d snapshots on every member, their copies are outdated",
                    out, generation, RETIRE_AFTER_PUBLISHES)
        for w in out:
            self.roster.command(w, wire.Shutdown())

    def _out_of_the_job(self, members: Collection[int]) -> list[int]:
        """This launcher's agents whose workers ended and are not in ``members``, not yet
        retired (``roster.cv`` held)."""
        return [w for w in self.roster.links if w in self.roster.exit_codes
                and w not in members and w not in self._retired]

    def _agents_to_retire(self) -> tuple[int, list[int]]:
        """(the current world, the agents `_retire_agents` may end now), from the
        arbiter's book and this launcher's count of publishes (``roster.cv`` held)."""
        arbiter = self.arbiter
        if not isinstance(arbiter, Arbiter):
            return -1, []
        book = arbiter.book
        if book.generation == 0 or book.dead or book.arrived:
            return book.generation, []  # (a recovery under way may need any copy)
        if any(len(self._published.get(m, ())) < RETIRE_AFTER_PUBLISHES
               for m in book.members):
            return book.generation, []
        return book.generation, self._out_of_the_job(book.members)

    def _worker_gone(self, worker_id: int, code: int) -> None:
        """Its worker ended (call with ``roster.cv`` held)."""
        if worker_id in self.roster.exit_codes:
            return
        if worker_id in self._idle:  # a waiting spare ended: one spare fewer, nothing more
            self._idle.discard(worker_id)
            self.roster.exit_codes[worker_id] = code
            self._record({"op": "spare_lost", "worker_id": worker_id, "code": code})
            if (code != 0 and not self._stopping_now()  # (not the job's end)
                    and not self._restart_as_spare(worker_id, "(a spare) ended " + (
                        f"by signal {-code}" if code < 0 else f"with status {code}"))):
                logger.warning("mnemojax launch: spare %d ended (status %d) before a world "
                               "took it in: one spare fewer", worker_id, code)
            return
        self.roster.exit_codes[worker_id] = code
        if worker_id in self._departed:  # it left the job (`wire.Leave`): no failure
            dropped = worker_id in self._dropped
            self._restart_as_spare(worker_id, "was dropped with the world it joined, which "
                                   "never formed" if dropped else "left the job",
                                   free=dropped)
            return
        if code == 0 and isinstance(self.arbiter, Arbiter):
            self.arbiter.member_finished(worker_id)  # (an agreement waits for none)
        members = self.arbiter.live_members()  # (before it is marked dead below)
        if code < 0 and worker_id not in self._finished_workers and worker_id in members:
            self._unrecovered[worker_id] = code  # (not one evicted)
        if code < 0 and worker_id in self._finished_workers:
            # (the job's status stays the others': its work was done, this is no failure
            # of the training; but what it did at exit may not have happened)
            self._record({"op": "died_after_finish", "worker_id": worker_id, "code": code})
            logger.warning("mnemojax launch: worker %d was ended by signal %d after it "
                           "finished (a crash at exit: what it did after the step's close, "
                           "files it wrote then, may be missing)", worker_id, -code)
        if (code > 0 and self._worker_error is None and not self._stop_signals
                and self._stop_forwarded is None):
            self._end_on_worker_error(worker_id, code)
        if code != 0:
            self.arbiter.member_died(worker_id)
            # The survivors may now block for up to the collective timeout.
            self.roster.command_all(wire.PauseWatchdog(), but=worker_id)
            self._failed_code = 128 - code if code < 0 else code  # the newest failure
        crashed = code < 0 and worker_id not in self._finished_workers
        evicted = worker_id not in members  # (killed by the launcher: not in the world)
        if (crashed and not self._stopping_now() and not self._restart_as_spare(
                worker_id, "was evicted" if evicted else f"ended by signal {-code}")):
            self._say_died(worker_id, code, evicted=evicted)

    def _stopping_now(self) -> bool:
        """The job is stopping or ending: deaths are expected (``roster.cv`` held)."""
        return bool(self._stop_signals or self._stop_forwarded is not None
                    or self._worker_error is not None or self.arbiter.ending() is not None)

    def _say_died(self, worker_id: int, code: int, *, evicted: bool = False) -> None:
        """Logs a worker's crash, or the end of one the launcher evicted (``roster.cv``
        held); across nodes each node says it from etcd's keys instead
        (`node.NodeLauncher`)."""
        if evicted:
            logger.warning("mnemojax launch: worker %d, evicted (not at the agreement or a "
                           "barrier in time), ended", worker_id)
            return
        others = self.options.recover and bool(self.arbiter.live_members())
        logger.warning("mnemojax launch: worker %d ended by signal %d%s", worker_id, -code,
                       "; the others recover without it" if others else "")

    def _end_on_worker_error(self, worker_id: int, code: int) -> None:
        """A worker ended itself with a non-zero status: the user's exception (reported by
        the hook `mnemojax.initialize` installs) or ``sys.exit(n)``. Unlike a killed worker
        (a negative status: a signal), this is no crash to recover from: the job ends with
        that status once the others have had ``grace_s`` to end on their own (call with
        ``roster.cv`` held)."""
        self._worker_error = (worker_id, code, time.monotonic())
        error = self._uncaught.get(worker_id)
        # Also for survivors already waiting at the agreement (a peer's exit closed their
        # collective before its agent reported it): no new world. On several nodes the
        # others log this reason (with the worker's exception: its traceback is printed
        # on its node only).
        first_line = error.strip().splitlines()[0] if error and error.strip() else ""
        self.arbiter.end(f"the job is ending: worker {worker_id} exited with status {code}"
                         + (f" ({first_line})" if first_line else ""), code=code,
                         worker_id=worker_id)
        self._record({"op": "worker_error", "worker_id": worker_id, "code": code,
                      "error": error})
        logger.error("mnemojax launch: worker %d exited with status %d%s; ending the job",
                     worker_id, code, f" ({error})" if error else "")

    # -- the job ------------------------------------------------------------------------------
    def _start(self) -> None:
        o = self.options
        self._control.start()
        self.supervisor.start()
        count = len(o.local_agents)  # the workers' and the spares'
        with self.roster.cv:
            if not self.roster.cv.wait_for(lambda: len(self.roster.addresses) == count,
                                           timeout=60):
                raise DistributedError(
                    f"only {len(self.roster.addresses)}/{count} agents said hello")
        service = self.services.start(0, o.nproc)
        logger.info("mnemojax launch: world 0: workers %s, coordination service on %s%s",
                    list(range(o.nproc)), service.address,
                    f"; spares {list(o.spare_ids)}" if o.spares else "")
        with self.roster.cv:
            for w in range(o.nproc):
                buddy = self.roster.addresses[(w + 1) % o.nproc] if o.nproc > 1 else None
                self.roster.command(w, wire.Start(
                    env=worker_env(o, w, coordinator=service.address, control=self.control,
                                   extra_env=self.extra_env), buddy=buddy))
            self._start_spares()

    def _finished(self) -> int | None:
        if (error := self._worker_error) is not None:
            others = self._running_workers()
            if not others or time.monotonic() > error[2] + self.options.grace_s:
                return error[1]
            return None
        if self._failed_code is not None and not self.options.recover:
            return self._failed_code
        current = self.arbiter.live_members()
        if not current:
            self._say_nobody_is_left()
            return self._failed_code if self._failed_code is not None else 1
        exit_codes = self._exit_codes()
        if all(exit_codes.get(m) == 0 for m in current):
            if self._unrecovered:
                self._record({"op": "ended_without", "workers": dict(self._unrecovered)})
                logger.warning(
                    "mnemojax launch: the job ends 0 with workers %s, but %s ended by a "
                    "signal (%s) in its last world, after which no world recovered: what "
                    "it would have done after its last step (a last checkpoint, its "
                    "outputs) is missing", sorted(current), ", ".join(
                        f"worker {w}" for w in sorted(self._unrecovered)),
                    ", ".join(str(-c) for _, c in sorted(self._unrecovered.items())))
            return 0
        return None

    def _say_nobody_is_left(self) -> None:
        """The job ends with no member left: says so, naming those that left it and why
        (e.g. fresh processes whose agreed copies died before they could fetch them; on
        several nodes, the leavers this node's launcher heard of)."""
        left = dict(self._leave_reasons)
        self._record({"op": "no_members", "left": {str(w): r for w, r in left.items()},
                      "failed_code": self._failed_code})
        why = "; ".join(f"worker {w}: {r}" for w, r in sorted(left.items()))
        logger.error("mnemojax launch: no member of the job is left to go on (each died "
                     "or left it%s); ending the job",
                     f"; left, as this launcher heard: {why}" if why else "")

    def _running_workers(self) -> list[int]:
        """This launcher's workers that were started and have not ended, but idle spares
        (call with ``roster.cv`` held)."""
        return [m for m in self.roster.addresses
                if m not in self.roster.exit_codes and m not in self._idle]

    def _exit_codes(self) -> dict[int, int]:
        """Worker id -> its exit status, of every worker of the job known to have ended."""
        return self.roster.exit_codes

    def run(self) -> int:
        """Runs the job; returns its exit status: 0 when the final world's workers all exit
        0; a worker's own non-zero status when it ended the job (its exception); 124 on the
        job timeout; 128 + the signal (143, 130) after SIGTERM or SIGINT to the launcher.

        SIGTERM and SIGINT (caught when run in the main thread) are forwarded to the workers
        as SIGTERM, their preemption notice: each takes its just-in-time checkpoint (where
        the persistent tier is on) and exits; after ``stop_grace_s``, or at a second signal,
        everything left is killed. A recovery under way meanwhile completes (its
        survivors then stop at a step agreed in the new world); no new world forms once
        the grace is over.
        """
        t_end = None if self.options.job_timeout_s is None else (
            time.monotonic() + self.options.job_timeout_s)
        previous = self._catch_stop_signals()
        try:
            self._start()
            with self.roster.cv:
                while (rc := self._finished()) is None:
                    if self._stop_signals or self._stop_forwarded is not None:
                        self._ended_by_job = True
                        return self._stop_workers()
                    if t_end is not None and time.monotonic() > t_end:
                        self._record({"op": "job_timeout"})
                        self.arbiter.end("the job is ending: --timeout-s ran out", code=124)
                        return 124
                    self._offer_spares()
                    self._check_joins()
                    self._maybe_regrow()
                    self._retire_agents()
                    self.roster.cv.wait(timeout=0.2)
            self._ended_by_job = True
            if (g := self.arbiter.regrow_pending()) is not None:  # (a trial: not said)
                logger.info("mnemojax launch: world %d was to re-form larger with the spares; "
                            "the job ended first", g)
            logger.info("mnemojax launch: the job ended, status %d", rc)  # (a trial: the
            return rc                                      # launchers never said it)
        except KeyboardInterrupt:
            return 130
        finally:
            self.cleanup()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _catch_stop_signals(self) -> dict[int, Any]:
        """SIGTERM and SIGINT set a flag that `run` acts on; returns the previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, lambda signum, _: self._stop_signals.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}

    def _stop_workers(self) -> int:
        """Forwards the stop to every running worker (SIGTERM) and waits up to
        ``stop_grace_s`` (or a second signal) for them to exit (call with ``roster.cv``
        held). Returns 128 + the first signal."""
        first = self._stop_signals[0] if self._stop_signals else self._stop_forwarded
        assert first is not None
        why = f"the job is ending: the launcher was signalled ({first})"
        # Worlds may still form meanwhile: survivors of a failure the signal met in their
        # recovery stop at a step agreed in the new world and checkpoint it (a user
        # trial's job lost its checkpoint when the agreement was refused).
        self.arbiter.stopping(why, signal=first)
        self._record({"op": "stop_signal", "signal": first})
        logger.warning("mnemojax launch: signal %d: stopping the workers (SIGTERM), up to "
                       "%.0f s", first, self.options.stop_grace_s)
        running = [w for w in self.roster.worker_pids if w not in self.roster.exit_codes]
        spares = set(self._idle)  # (no step to stop at: they just end)
        for w in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.roster.worker_pids[w], signal.SIGTERM)
        deadline = time.monotonic() + self.options.stop_grace_s
        while ((any(w not in self.roster.exit_codes for w in running)
                or self._others_running())
               and len(self._stop_signals) < 2 and time.monotonic() < deadline):
            self.roster.cv.wait(timeout=0.2)  # (a second signal of its own cuts it short)
        if still := [w for w in running if w not in self.roster.exit_codes]:
            # Its workers outlived the grace: no world forms from now on. (A node whose
            # workers all ended says nothing: another node's survivors may still be
            # forming the world they stop in.)
            self.arbiter.end(why, signal=first)
            if len(self._stop_signals) < 2:
                logger.warning("mnemojax launch: workers %s still running after the stop "
                               "grace (%.0f s, --stop-grace-s): ending them", still,
                               self.options.stop_grace_s)
        self._record({"op": "stopped", "signal": first,
                      "exit_codes": {w: self.roster.exit_codes.get(w) for w in running}})
        if unwatched := [w for w in running if w not in spares
                         and self.roster.exit_codes.get(w) == -signal.SIGTERM]:
            # A step with PersistentOptions(directory=...) takes SIGTERM over and exits 0
            # after the agreed checkpoint; ended by the signal, nothing watched it.
            logger.warning("mnemojax launch: workers %s ended by the SIGTERM, not at a step "
                           "agreed with their peers: they checkpointed nothing (a resilient "
                           "step with PersistentOptions(directory=...) stops at an agreed "
                           "step and checkpoints it; a process still joining its world "
                           "cannot)", unwatched)
        return 128 + first

    def _others_running(self) -> bool:
        """Whether workers of the job this launcher does not run are still running (one
        launcher: none). A launcher whose own workers ended keeps its services (a world's
        coordination service, its agents' copies) for them during a stop."""
        return False

    def cleanup(self) -> None:
        """Ends every agent and worker (process groups), then the services. Idempotent."""
        with self.roster.cv:
            self.arbiter.close()  # long polls return; no agreement can decide any more
        self.roster.command_all(wire.Shutdown())
        self.supervisor.stop()
        self._control.close()
        # Segments first, then the lock: a launcher killed in between leaves its lock file,
        # which the next launcher's sweep on this host finds (segments without one it
        # would leave alone).
        self.supervisor.sweep_segments()
        self._job_lock.release()
        self.services.stop_all()
