"""The worker's handle on the multi-process world, used by the resilient step.

`initialize()` (public as `mnemojax.initialize`) joins the world that ``mnemojax launch``
(or SLURM) describes in the environment; it must run before any JAX use. The resilient
step then finds the session with `current()` and:

* publishes its shards to the agent after every good step (`publish`), once the agent's
  ring buddy holds the one before (so the buddies cannot fall behind the cadence); the
  copy may run while the next step does (`SnapshotOptions.overlap_publish`);
* on a peer failure, hands its agent the replicas its devices hold (`hold`), drops the
  old world's arrays and calls `recover`, which runs the
  agreement protocol and the in-process re-initialisation and returns the agreed state;
* is told of a peer's death by the launcher within milliseconds (`peer_watch`), which
  fails the step's pending wait as a failed collective would, where gloo on CPU would block
  until its collective timeout;
* waits at a barrier after every compile (`compiled`), so no peer enters a collective
  while another still compiles (a false alarm on small machines, DESIGN §4); a peer's
  death fails that barrier at once, and the step recovers as from a failed collective.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from mnemojax._src.distributed import auth, snapshot_codec, transport, wire
from mnemojax._src.distributed.agreement import Agreement, compiled_barrier, held_origin
from mnemojax._src.distributed.env import (
    CONTROL,
    COORDINATOR,
    GENERATION,
    NUM_PROCESSES,
    PEER_WATCH,
    PROCESS_ID,
    RESUME,
    SPARE,
    WORKER_ID,
    WorldSpec,
    world_from_env,
)
from mnemojax._src.distributed.shm import agent_peak_bytes, nbytes_of
from mnemojax._src.distributed.worker import coordination, peer_watch, state_transfer
from mnemojax._src.distributed.worker.agent_client import AgentClient
from mnemojax._src.distributed.worker.coordinator_client import LauncherCoordinator
from mnemojax._src.distributed.worker.peer_watch import PeerWatch
from mnemojax._src.distributed.worker.recovery import (
    CopiesUnreachableError,
    WorldRecovery,
    join_world,
    recover_world,
)
from mnemojax._src.distributed.worker.state_transfer import PutFn
from mnemojax._src.errors import (
    AgreementError,
    DistributedError,
    LeftJobExit,
    SnapshotBudgetWarning,
    WorldConfigError,
)

if TYPE_CHECKING:
    import jax

    from mnemojax._src.snapshot import Packed

log = logging.getLogger("mnemojax")

_current: DistributedSession | None = None

# A `wire.ReportFailure` whose reason starts so is a user's exception, not a peer failure:
# the launcher ends the job with it (`launcher.launcher.UNCAUGHT`, the same text).
UNCAUGHT = "uncaught exception: "
# Said with an uncaught runtime error that a lost peer explains (`_report_uncaught_...`).
GUARD_HINT = ("JAX work outside the resilient step met a lost peer: run it through "
              "step.guard(fn) (an eval, a metrics gather), which recovers the world and runs "
              "it again")

# How long a publish may wait for the buddy to hold the last snapshot (the agent bounds it
# further, to half its hang floor). A copy slower than this per snapshot cannot keep up
# with the cadence anyway: the publish then goes on and says so.
REPLICATION_WAIT_S = 5.0


class DistributedSession:
    """This worker's world, agent connection and coordinator.

    Attributes:
        world: this process's place in the current world (replaced by `recover`).
        agent: the connection to its agent (None outside ``mnemojax launch``).
        coordinator: the agreement service (None outside ``mnemojax launch``).
        publish_refused: snapshots stopped for good (over the host-memory budget).
        peer_watch: tells the step's pending wait of a peer's death (`peer_watch`).
        resume: set when this process is fresh in a running job (restarted after its
            world's coordination service died, or a spare; ``MNEMOJAX_RESUME``): how it
            joined (agreement, the copies' headers); `take_resume` restores its state.
        left: set once this process has left the job (`leave`): raised again by any
            later step.
    """

    def __init__(self, world: WorldSpec):
        self.world = world
        # WorldSpec guarantees a secret wherever there is an agent or a control endpoint.
        secret = world.secret or b""
        self.agent = AgentClient(world.agent, secret=secret) if world.agent else None
        self.coordinator = LauncherCoordinator(world.control, world.stable_id,
                                               secret=secret) if world.control else None
        self.publish_refused = False  # over the host-memory budget (see `publish`)
        self.peer_watch: PeerWatch | None = None  # started by `initialize` under a launcher
        self.resume: WorldRecovery | None = None
        self.left: LeftJobExit | None = None  # this process left the job (`leave`)
        self._publishing: threading.Thread | None = None  # the publish in flight
        self._publish_error: BaseException | None = None  # what it raised
        self._published: tuple[int, int] | None = None  # (step, world) last published
        self._published_nbytes = 0  # its payload
        self.replication_lags = 0  # publishes that overwrote a slot the buddy lacked
        self.packed_publishes = 0  # publishes read from the packs the step wrote
        self.publishes = 0  # snapshots handed to the agent (copies started)
        self._replication_lagging = False
        # The world whose last publish waited in series for the buddy (then the next one
        # need not wait before its copy: two waits between progress signals could add up
        # past the agent's hang floor).
        self._waited_in_series: int | None = None

    @property
    def can_recover(self) -> bool:
        return self.coordinator is not None and self.agent is not None

    def phase(self, name: str) -> None:
        if self.agent is not None:
            self.agent.phase(name)

    def in_step(self, inside: bool) -> None:
        """Tells the agent's hang watchdog whether this worker is inside a call of its step
        (`wire.InStep`): between calls it runs the user's own code (an eval, a save),
        which is no hang however long it takes. Never raises (an agent gone is found by
        the step's own paths)."""
        if self.agent is not None:
            try:
                self.agent.in_step(inside)
            except OSError as e:
                log.debug("mnemojax: telling the agent about the step's bounds: %s", e)

    def compiled(self, timeout_s: float = 300.0) -> None:
        """Barrier after a compile, then tell the watchdog training resumed.

        Barrier: returns once every member of the world has compiled. Under ``mnemojax
        launch`` it is the launcher's (`Coordinator.barrier`): a member's death fails it
        for every member at once (its agent tells the launcher within milliseconds), where
        JAX's ``wait_at_barrier`` would only fail at its timeout. Without a launcher
        (SLURM) it is the coordination service's barrier.

        Raises:
            jax.errors.JaxRuntimeError: a member died before every member had compiled:
                a peer failure, recovered like a collective that failed on a dead peer.
            AgreementError: the launcher could not be reached, or this worker is no
                longer a member of the world (it was evicted).
        """
        name = compiled_barrier(self.world.generation)
        if self.coordinator is None:
            coordination.barrier(name, timeout_s)
        else:
            failed = self.coordinator.barrier(generation=self.world.generation, name=name,
                                              timeout_s=timeout_s)
            if failed:
                raise _peer_failure(f"workers {list(failed)} of world "
                                    f"{self.world.generation} died (or left it for a new "
                                    f"agreement) before every worker had reached barrier "
                                    f"{name!r}")
        self.phase("train")

    @property
    def published_nbytes(self) -> int:
        """The payload of the last snapshot copied to the agent (0 before the first)."""
        return self._published_nbytes

    def publish(self, step: int, leaves: Sequence[jax.Array], *,
                packed: Packed | None = None,
                budget_bytes: int | None = None, background: bool = False,
                in_series: bool = False) -> bool:
        """Hands this worker's shards of the state after `step` to its agent, read from
        ``packed`` when given (the same state packed by the step: `snapshot.Packed`,
        `state_transfer.packed_shards`).

        The copy first waits until the agent's ring buddy holds the last snapshot
        (`_await_replicated`: the slot it overwrites may be the step a failure agrees on).
        With ``in_series`` it waits after the copy instead, until the buddy holds this one
        (`SnapshotOptions.replicate_in_series`); only the first publish of a world waits
        before its copy too. Once that wait after the copy gave up (logged), the next copy
        does not wait again: two waits between progress signals could add up past the
        agent's hang floor. ``background`` is not allowed with it.
        With ``background`` the copy into the agent's shared memory (and its CRC32C) runs
        on a thread while the caller goes on (the next step), one publish in flight: this
        call first waits for the one before (`settle`). The caller must keep ``leaves``
        alive and undonated until then (on CPU the shards are views of device buffers);
        every path that reads the agent's copies or drops the arrays settles first
        (`recover`, `hold`, `leave`, `finish`). Without it the copy is done on return.

        The agent keeps two slots of this worker's snapshot and two of its ring
        predecessor's, so 4 x the payload of host memory at rest, and 5 x at its peak
        (one more copy being received; the copy sent to the buddy is read from its slot),
        or 4 x in series (the buddy drops its oldest copy before a new one arrives):
        `shm.agent_peak_bytes`, with equal shares. Over ``budget_bytes`` at that peak,
        publishing stops for good with a `SnapshotBudgetWarning` (never an OOM of the host):
        a later loss of this worker's shards then falls back to the persistent tier.

        Returns:
            Whether the snapshot is published (with ``background``: its copy started; an
            error of that copy is raised by the next `settle`).
        """
        if in_series and background:
            raise ValueError("publish(in_series=True) cannot run in the background")
        if self.agent is None or self.publish_refused:
            return False
        self.settle()
        # The size from the shards' metadata; their bytes are read (on GPU: copied to the
        # host) by the copy, on its thread when in the background.
        read = state_transfer.packed_shards(leaves, packed) if packed is not None else None
        shards, data = read if read is not None else (
            state_transfer.local_shards(leaves, to_host=False), None)
        head = snapshot_codec.header_of(step, self.world.stable_id, shards,
                                        num_leaves=len(leaves),
                                        generation=self.world.generation)
        nbytes = len(head) + sum(int(e.data.nbytes) for e in shards)
        # Its ring neighbour's share: as large; it publishes as this worker does.
        peak = agent_peak_bytes(nbytes, nbytes, in_series=in_series)
        if budget_bytes is not None and peak > budget_bytes:
            self.publish_refused = True
            warnings.warn(
                f"mnemojax: this worker's snapshots of {nbytes} bytes need {peak} bytes of "
                f"its host's memory at the peak (two slots of its own, two of its ring "
                f"neighbour's{'' if in_series else ' and the one being received'}), over "
                f"host_memory_budget_bytes={budget_bytes}; they are no longer published",
                SnapshotBudgetWarning, stacklevel=3)
            return False
        agent, generation = self.agent, self.world.generation
        self.packed_publishes += read is not None
        self.publishes += 1

        def copy() -> None:
            # The slot this copy overwrites usually holds the step before the last one:
            # it goes only once the buddy has the last one (`_await_replicated`), which
            # the last publish in series of this world already waited for.
            if not (in_series and self._waited_in_series == generation):
                self._await_replicated(agent, step)
            parts = [memoryview(head),
                     *(data if data is not None else snapshot_codec.data_views(shards))]
            # The buddy may make room for it only while the waits in series hold (the
            # last one did not give up): `ReplicaStore.make_room`.
            agent.publish(step, parts, budget_bytes=budget_bytes,
                          in_series=in_series and not self._replication_lagging)
            self._published, self._published_nbytes = (step, generation), nbytes
            if in_series:  # the next step starts once the buddy holds this one
                self._await_replicated(agent, step, then="going on")
                self._waited_in_series = generation

        if not background:
            copy()
            return True

        def copy_in_background() -> None:
            try:
                copy()
            except BaseException as e:  # noqa: BLE001 - raised by the next `settle`
                self._publish_error = e

        self._publishing = threading.Thread(target=copy_in_background,
                                            name=f"mnemojax-publish-{step}", daemon=True)
        self._publishing.start()
        return True

    def _await_replicated(self, agent: AgentClient, step: int, *,
                          then: str = "publishing anyway") -> None:
        """Waits until the agent's ring buddy holds this worker's last snapshot.

        Why: the agent keeps two slots, so publishing ``step`` overwrites the one before
        the last (in steady training; `shm.SnapshotBuffer.publish` has the rule), and the
        buddy keeps two copies. Without the wait a buddy could fall any
        number of steps behind (replication slower than the cadence), and a host lost
        then would find no step that every worker holds. With it, when this worker
        writes N, its buddy holds N - 1, and every peer (which has published N - 1 before
        this step could finish) has N - 1 in its own agent and N - 2 at its buddy. What
        is left: a host whose copy of N - 1 is still on the wire when it dies, while this
        worker's N has already reached its buddy and pushed out N - 2 there (a copy more
        than about twice as slow as this worker's); that loss falls back to the
        persistent tier. The agent bounds the wait (half its hang floor, at most
        `REPLICATION_WAIT_S`); past it, or while the buddy cannot be reached or refuses
        copies, this publishes anyway and says so once per episode.
        """
        lag = agent.await_replicated(REPLICATION_WAIT_S)
        if lag is None:
            self._replication_lagging = False
            return
        self.replication_lags += 1
        if not self._replication_lagging:
            self._replication_lagging = True
            log.warning("mnemojax: step %d: this worker's last snapshot has not reached "
                        "its ring buddy (%s); %s, so a host lost now may find no step "
                        "every worker holds (then the persistent tier). The copies need "
                        "a faster link between hosts, or smaller shares per worker",
                        step, lag, then)

    def publish_idle(self, timeout_s: float | None = None) -> bool:
        """Waits up to ``timeout_s`` for the publish in flight; whether none is left (its
        error, if any, is raised by the next `settle`)."""
        if self._publishing is not None:
            self._publishing.join(timeout_s)
            return not self._publishing.is_alive()
        return True

    def settle(self, *, quiet: bool = False) -> None:
        """Waits for the publish in flight, if any (`publish` with ``background``).

        Raises:
            Exception: what that publish raised (an agent that cannot be reached), unless
                ``quiet`` (then it is logged: a recovery goes on without that copy).
        """
        if self._publishing is not None:
            self._publishing.join()
            self._publishing = None
        error, self._publish_error = self._publish_error, None
        if error is None:
            return
        if not quiet:
            raise error
        log.warning("mnemojax: this worker's last snapshot did not reach its agent: %s: %s",
                    type(error).__name__, error)

    def hold(self, step: int, leaves: Sequence[jax.Array], *,
             budget_bytes: int | None = None) -> int:
        """At a peer failure, before the old world's arrays go: hands the agent the regions
        of the state after ``step`` that this process's devices hold and its snapshots lack
        (data-parallel replicas, `state_transfer.held_shards`) as its held copy
        (`agreement.held_origin`). The agreement may then take a region from it that the
        failure lost with its owner's host and ring buddy. The agent keeps it until the next
        publish.

        Only when this worker published ``step`` in this world (a held copy completes
        that step's snapshots; a restored step is not published again in its new world,
        and the agent's held copy of the world before stays), and only within the budget:
        the regions, with this worker's two slots and its neighbour's two copies, at most
        ``budget_bytes`` (checked before anything is copied; the agent checks again).

        Returns:
            Bytes held (0: nothing to hold, not published, over the budget, or refused;
            logged).
        """
        if self.agent is None:
            return 0
        self.phase("recover")  # the watchdog waits while the copy is made
        self.settle(quiet=True)  # its `published` would drop the held copy
        if self._published != (step, self.world.generation):
            log.info("mnemojax: no held copy: step %d was not published in world %d", step,
                     self.world.generation)
            return 0
        own = self._published_nbytes
        room = transport.MAX_PAYLOAD - (1 << 20)  # one frame carries it, with its metadata
        if budget_bytes is not None:
            room = min(room, budget_bytes - agent_peak_bytes(own, own))
        entries = state_transfer.held_shards(leaves, max_bytes=room)
        if entries is None:
            log.warning("mnemojax: no held copy of step %d: this worker's replicas do not fit "
                        "host_memory_budget_bytes=%s beside its snapshots (or one frame)",
                        step, budget_bytes)
            return 0
        if not entries:
            return 0
        parts = snapshot_codec.pack(
            step, held_origin(self.world.stable_id), entries, num_leaves=len(leaves),
            generation=self.world.generation)
        nbytes = nbytes_of(parts)
        # Loopback at >= 100 MB/s even on a loaded host, plus the agent's CRC check; but
        # well within the agreement's deadline, which evicts a survivor that comes late.
        timeout_s = min(30.0 + nbytes / 100e6, self.world.attach_timeout_s / 2)
        refused = self.agent.hold(step, parts, timeout_s=timeout_s)
        if refused is not None:
            log.warning("mnemojax: the agent did not take this worker's held copy of step "
                        "%d: %s", step, refused)
            return 0
        return nbytes

    def _coordinator(self, to: str) -> LauncherCoordinator:
        if self.coordinator is None:
            raise DistributedError(f"this worker has no coordinator (MNEMOJAX_CONTROL): it "
                                   f"cannot {to}")
        return self.coordinator

    def recover(self, *, last_step: int, reason: str,
                first_replayable: int | None = None) -> WorldRecovery:
        """Agrees with the survivors and joins the new world (see `recover_world`).

        Barrier: returns once the new world has formed (every survivor joined it).
        Drop every array of the old world before calling.

        Raises:
            DistributedError: this session cannot recover (no launcher; `can_recover`).
            AgreementError: the survivors could not agree.
        """
        coordinator = self._coordinator("recover from a peer failure")
        self.settle(quiet=True)  # ``last_step`` is published
        self.phase("recover")
        rec = recover_world(coordinator, self.world, last_step=last_step, reason=reason,
                            first_replayable=first_replayable)
        self.world = rec.world
        return rec

    def leave(self, *, step: int, reason: str) -> NoReturn:
        """This process leaves the job, which goes on without it (the others agree again
        over the world it leaves, as over a dead member's): the new world's mesh gives it
        no device, or, having just joined, it cannot fetch the agreed state. Its agent
        stays, serving its copies.

        Raises:
            LeftJobExit: always, once this process has detached and the launcher knows
                (status 0 unless caught).
            AgreementError: the launcher could not be reached.
            DistributedError: this session has no coordinator (no launcher).
        """
        coordinator = self._coordinator("leave the job")
        self.settle(quiet=True)
        generation = self.world.generation
        self.phase("left")
        # Detached first: once the launcher knows, the others' agreement can decide and the
        # world's service stop, and a client whose service is gone aborts its process.
        coordination.detach_worker()
        coordinator.leave(generation=generation, reason=reason[:500])
        self.left = LeftJobExit(
            f"mnemojax: worker {self.world.stable_id} left the job in world {generation} at "
            f"step {step}: {reason}", step=step, generation=generation)
        raise self.left

    def restore(self, rec: WorldRecovery, shardings: Sequence[jax.sharding.Sharding], *,
                put: PutFn) -> list[jax.Array]:
        """The agreed state on the new world's mesh: one array per sharding, placed with
        ``put`` (the device layer's ``put(host_value, sharding)``, so a fault injector
        sees the placement).

        Only the regions this process's devices hold are fetched (`restore_leaves`).

        Raises:
            jax.errors.JaxRuntimeError: the holders of a copy died since its header was
                read: a peer failure of the new world, recovered like one.
            StateUnavailableError: the copies are of another state or leave a region
                uncovered.
        """
        try:
            return state_transfer.restore_leaves(rec.state, shardings, put=put)
        except CopiesUnreachableError as e:
            raise _peer_failure(f"the agreed state could not be fetched: {e}") from e

    def take_resume(self, shardings: Sequence[jax.sharding.Sharding], *,
                    put: PutFn) -> tuple[int, list[jax.Array]] | None:
        """For a fresh process that joined a running job: the agreed step and state, from
        the copies whose headers it read when it joined (only the regions its devices
        hold, CRC-checked), placed with ``put``. None when
        there is nothing pending, or when no step's state survived in memory
        (``resume_step == -1``; `resume` is then kept: the caller falls back to the
        persistent tier or raises). Once only.

        When no holder of a copy answers with a good one (they died since the join, when
        its header was read, or their copies fail their checks), this process leaves the
        job (`leave`): the others learn it at once and recover their world without it,
        from whatever copies survive or the persistent tier, rather than the job ending
        here.

        Raises:
            StateUnavailableError: the copies are of another state or leave a region
                uncovered.
            LeftJobExit: a copy could not be fetched: this process left the job.
        """
        rec = self.resume
        if rec is None or rec.agreement.resume_step < 0:
            return None
        self.resume = None  # once, whatever happens
        try:
            leaves = state_transfer.restore_leaves(rec.state, shardings, put=put)
        except CopiesUnreachableError as e:
            self.leave(step=rec.agreement.resume_step,
                       reason=f"it joined, but the agreed state could not be fetched: {e}")
        return rec.agreement.resume_step, leaves

    def agree_stop(self, name: str, proposal: int) -> int:
        """The step after which every process stops for a preemption notice: the first
        proposal for ``name`` in this world wins (`coordination.agree_stop_step`)."""
        return coordination.agree_stop_step(f"{self.world.generation}/{name}", proposal)

    def finish(self) -> None:
        self.settle()
        self.phase("finish")


def _peer_failure(what: str) -> Exception:
    """A peer failure the resilient step recovers from, as from a collective that failed
    on a dead peer: the step classifies a non-retryable ``JaxRuntimeError`` under a
    session so (its text must not read as a retryable status)."""
    import jax
    return jax.errors.JaxRuntimeError(f"UNKNOWN: mnemojax: {what}")


def initialize() -> DistributedSession | None:
    """Joins the multi-process world described by the environment, before any JAX use.

    Under ``mnemojax launch`` (``MNEMOJAX_COORDINATOR`` set) or SLURM, joins the launcher's
    coordination service as a client, with recoverability and bounded CPU collectives, and
    returns the session the resilient step will use. Elsewhere returns None and changes
    nothing (a single-process run).

    Raises:
        DistributedError: JAX's backend was already initialised.
    """
    global _current
    if _current is not None:
        return _current
    if started_as_spare():
        _current = session = _join_running_job(_await_join())
    elif COORDINATOR not in os.environ and "SLURM_PROCID" not in os.environ:
        return None
    elif raw := os.environ.get(RESUME):
        _current = session = _join_running_job(
            wire.AgreementReply.from_wire(json.loads(raw)).agreement)
    else:
        _current = session = DistributedSession(coordination.initialize_worker())
    _report_uncaught_exceptions(session)
    if session.coordinator is not None and os.environ.get(PEER_WATCH, "1") != "0":
        session.peer_watch = PeerWatch(
            session.coordinator, lambda: session.world.generation,
            exit_wait_s=session.world.collective_timeout_s + 10.0).start()
    return session


# A waiting spare asks the launcher again this often: one that stops asking (a frozen
# process) is offered to no world from then on (`launcher.Launcher._warm_spares`).
SPARE_POLL_S = 2.0


def _await_join() -> Agreement:
    """A warm spare (``MNEMOJAX_SPARE=1``): waits until a world takes it in, then sets the
    environment of that world. When the job ends first, the process exits 0."""
    control, worker_id = os.environ.get(CONTROL), os.environ.get(WORKER_ID)
    secret = auth.secret_from_env(os.environ)
    if not control or worker_id is None or secret is None:
        raise WorldConfigError(f"{SPARE}=1 needs {CONTROL}, {WORKER_ID} and the job secret: "
                               "only `mnemojax launch --spares` starts a spare")
    # Warm before it says so: the imports are most of a fresh process's start (none
    # starts a backend: jax.distributed is initialised once a world takes it in).
    import flax.nnx  # noqa: F401
    import jax.numpy  # noqa: F401
    import optax  # noqa: F401

    import mnemojax._src.api  # noqa: F401
    coordinator = LauncherCoordinator(control, int(worker_id), secret=secret)
    log.info("mnemojax: spare %s ready, waiting for a world to take it in", worker_id)
    while True:
        try:
            agreement = coordinator.await_join(timeout_s=SPARE_POLL_S)
        except AgreementError as e:
            log.info("mnemojax: spare %s not needed: %s", worker_id, e)
            raise SystemExit(0) from None
        if agreement is not None:
            break
    # It has its agreement: says so (asking once more answers it again at once), or the
    # launcher takes it for frozen and the world forms without it (`Launcher._check_joins`).
    with contextlib.suppress(AgreementError):
        coordinator.await_join(timeout_s=0.0)
    os.environ.update({COORDINATOR: agreement.coordinator,
                       PROCESS_ID: str(agreement.process_id),
                       NUM_PROCESSES: str(agreement.num_processes),
                       GENERATION: str(agreement.generation)})
    return agreement


def started_as_spare() -> bool:
    """This process was started as a spare (it waited, then took a dead member's rank)."""
    return os.environ.get(SPARE) == "1"


def _join_running_job(agreement: Agreement) -> DistributedSession:
    """A fresh process in a running job: fetch the agreed copies, join the agreed world
    (agreeing again if it does not form: `recover_world.join_world`)."""
    world = world_from_env()
    coordination.configure_process(world)
    session = DistributedSession(world)
    if session.coordinator is None:
        raise WorldConfigError(f"{RESUME} is set but {CONTROL} is not: only `mnemojax "
                               "launch` starts a process into a running job")
    rec = join_world(session.coordinator, world, agreement)
    session.world, session.resume = rec.world, rec
    log.warning("mnemojax: joined world %d as process %d; the state of step %d comes from "
                "the agents' copies at step.restore()", rec.world.generation,
                rec.world.process_id, rec.agreement.resume_step)
    return session


def _report_uncaught_exceptions(session: DistributedSession) -> None:
    """Chains ``sys.excepthook``: after the traceback is printed, the launcher is told that
    this worker ends with the user's exception (it then ends the job with it, rather than
    recovering from the exit as from a crash). Best effort: a launcher that cannot be
    reached still sees the exit status (1)."""
    coordinator = session.coordinator
    if coordinator is None:
        return
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        previous(kind, value, tb)
        text = f"{kind.__name__}: {value}"
        if _lost_peer_explains(value):
            text = f"{text[:300]} [{GUARD_HINT}]"
            print(f"mnemojax: {GUARD_HINT}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            coordinator.report_failure(generation=session.world.generation,
                                       reason=f"{UNCAUGHT}{text}"[:500])

    sys.excepthook = hook


def _lost_peer_explains(exc: BaseException) -> bool:
    """A runtime error (not mnemojax's own) raised where a peer's death is heard of, or a
    gloo collective's (a dead peer's connection): JAX work outside the resilient step."""
    import jax  # noqa: PLC0415 - loaded by then: the error is JAX's

    return (isinstance(exc, jax.errors.JaxRuntimeError)
            and (peer_watch.known_death() is not None or "gloo" in str(exc).lower()))


def current() -> DistributedSession | None:
    """The session `initialize` created in this process (None: a single-process run).

    Raises:
        WorldConfigError: ``mnemojax launch`` started this process (``MNEMOJAX_CONTROL``
            is set) but it never called `initialize`: it would train alone, on its own
            devices, while the job believes it is one of its workers.
    """
    if _current is None and CONTROL in os.environ:
        raise WorldConfigError(
            "this process was started by `mnemojax launch` but never called "
            "mnemojax.initialize(): call it at the top of the worker script, before any JAX "
            "use, so that it joins the job's world")
    return _current
