"""The worker's recovery sequence after a peer failure (the resilient step calls it
through `session.DistributedSession.recover`).

`recover_world` runs steps 1-3 of the agreement protocol (see `distributed.agreement`) and
the in-process re-initialisation of DESIGN §4. Before joining the new world it fetches the
*headers* of the agreed step's copies (what each covers) from the live agents, so a process
whose sources died stays out and the survivors agree again. The caller then rebuilds its
mesh over ``jax.devices()``, compiles, waits at `coordination.barrier`, and restores
(`state_transfer.restore_leaves`): only then, with the new mesh known, does it fetch the
parts of the copies its own devices hold (`AgreedCopies.fetch`), not the whole state
(unless its devices hold all of it, as with replicated leaves).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from mnemojax._src.distributed import snapshot_codec
from mnemojax._src.distributed.agreement import ANY_STEP, Agreement, snapshots_first
from mnemojax._src.distributed.env import WorldSpec
from mnemojax._src.distributed.worker import coordination, peer_watch
from mnemojax._src.distributed.worker.agent_client import fetch_snapshot
from mnemojax._src.distributed.worker.coordinator_client import Coordinator
from mnemojax._src.errors import AgreementError, StateUnavailableError

logger = logging.getLogger("mnemojax")

MAX_ROUNDS = 8  # agreement rounds of one recovery (each new round lost another member)


@dataclasses.dataclass(frozen=True)
class WorldRecovery:
    """Result of `recover_world`.

    Attributes:
        agreement: what the survivors agreed on.
        world: this process's place in the new world.
        state: the copies of ``agreement.resume_step`` named in its ``sources``: their
            headers (checked to be of the agreed step and world), fetched from on restore.
        phases: seconds per phase: ``detach``, ``agree``, ``attach``, ``fetch`` (of the
            headers; the parts are fetched on restore).
        rounds: agreement rounds it took (more than 1 when a survivor died after a decision).
        members: worker ids of the world that failed (before the first round).
        replaces: joiner (spare) -> the member of that world whose rank it took, across
            every round.
    """

    agreement: Agreement
    world: WorldSpec
    state: AgreedCopies
    phases: dict[str, float]
    rounds: int = 1
    members: tuple[int, ...] = ()
    replaces: Mapping[int, int] = dataclasses.field(default_factory=dict)

    def then(self, later: WorldRecovery) -> WorldRecovery:
        """``later`` (an agreement over the world this one formed) as the continuation of
        this recovery: still from the members of the world that failed first, each joiner
        traced back to the member of that world it replaces, phases and rounds summed."""
        replaces = dict(self.replaces)
        _trace_back(replaces, later.replaces)
        phases = {k: self.phases.get(k, 0.0) + later.phases.get(k, 0.0)
                  for k in {*self.phases, *later.phases}}
        return dataclasses.replace(later, phases=phases, rounds=self.rounds + later.rounds,
                                   members=self.members, replaces=replaces)


def _trace_back(replaces: dict[int, int], later: Mapping[int, int]) -> None:
    """Adds a later round's ``later`` (joiner -> the member it replaces) to ``replaces``,
    in place. A joiner of a later round may replace one of an earlier round's: each is
    traced back to the member of the world that failed first (whose devices it takes)."""
    for joiner, gone in later.items():
        replaces[joiner] = replaces.pop(gone, gone)


def recover_world(coordinator: Coordinator, world: WorldSpec, *, last_step: int,
                  reason: str = "", first_replayable: int | None = None) -> WorldRecovery:
    """Detaches, agrees, reads what the agreed copies cover and joins the survivors' world.

    Detaching comes first, so the old world's service can stop at decision time. The caller
    must hold no ``jax.Array`` of the old world (drop them and leave the ``except`` block
    whose traceback references them) before calling. Detaching does not free a peer still
    blocked in a collective with this process (measured: the old CPU client and its gloo
    pairs live on while anything refers to them, e.g. the user's ``Mesh``); the peers learn
    of the death from the launcher instead (`peer_watch`).

    Barrier semantics: `Coordinator.agree` returns once every live member of ``world`` has
    arrived (or was declared dead); every survivor gets the same agreement or an
    `AgreementError`. The agreed copies' headers are read, then the new world is joined,
    which is a second barrier (``connect``): when a member of the new world died after the
    decision, or could not read a copy (its sources died since), that world cannot form,
    and the survivors agree again over it (another round). They give the connect up as soon
    as the launcher tells of that member (`_MembersWatch`: within milliseconds of its death,
    or of its own next agreement), else at ``world.attach_timeout_s`` (what the launcher
    cannot see). The copies' regions are fetched later, on restore (`AgreedCopies.fetch`).

    When ``agreement.resume_step == -1`` (no step's state survives, `Agreement.lost`), the
    new world is joined but nothing is read: the caller falls back or raises.

    Args:
        coordinator: the agreement service (`LauncherCoordinator` under ``mnemojax launch``).
        world: this process's current world.
        last_step: the newest step this process completed and published.
        first_replayable: the oldest step whose batch this process still keeps.
        reason: what was seen (logged by the coordinator).
    """
    phases = {"detach": 0.0, "agree": 0.0, "fetch": 0.0, "attach": 0.0}
    t = time.perf_counter()
    coordinator.report_failure(generation=world.generation, reason=reason[:500])
    coordination.detach_worker()
    phases["detach"] = time.perf_counter() - t
    return _form_world(coordinator, world, phases, lambda generation: coordinator.agree(
        generation=generation, last_step=last_step, first_replayable=first_replayable))


def join_world(coordinator: Coordinator, world: WorldSpec,
               agreement: Agreement) -> WorldRecovery:
    """A fresh process (a worker restarted after its world's coordination service died,
    or a spare taking a dead member's rank) joins the world ``agreement`` decided: reads
    the agreed copies' headers, then connects. As for a survivor, a world that does not form
    (a member died after the decision, a copy could not be read) is agreed on again, over
    that world, with any step the copies cover (`ANY_STEP`).

    Call after `coordination.configure_process` and before any JAX use.
    """
    phases = {"detach": 0.0, "agree": 0.0, "fetch": 0.0, "attach": 0.0}
    given = [agreement]

    def agree(generation: int) -> Agreement:
        if given:
            return given.pop()
        return coordinator.agree(generation=generation, last_step=ANY_STEP)

    return _form_world(coordinator, world, phases, agree)


def _form_world(coordinator: Coordinator, world: WorldSpec, phases: dict[str, float],
                agree: Callable[[int], Agreement]) -> WorldRecovery:
    """Agreement rounds (``agree(generation)``) until this process has read the agreed
    copies' headers and joined the agreed world (`recover_world`)."""
    rounds, members = 0, None
    replaces: dict[int, int] = {}  # joiner -> the member of the failed world it replaces
    while True:
        rounds += 1
        if rounds > MAX_ROUNDS:
            raise AgreementError(f"no world formed after {MAX_ROUNDS} agreement rounds",
                                 generation=world.generation)
        t = time.perf_counter()
        agreement = agree(world.generation)
        members = members or agreement.previous_members
        _trace_back(replaces, agreement.replaces)
        phases["agree"] += time.perf_counter() - t
        world = dataclasses.replace(
            world, coordinator=agreement.coordinator, process_id=agreement.process_id,
            num_processes=agreement.num_processes, generation=agreement.generation,
            worker_id=world.stable_id)
        # Reach every copy before joining: if every source of one died since the decision,
        # this process stays out of the new world, so it never forms and everyone agrees
        # again. (Its parts are fetched on restore; a source lost in between is a peer
        # failure of the new world.)
        t = time.perf_counter()
        try:
            state = AgreedCopies.probe(agreement, world.secret or b"")
        except StateUnavailableError as e:
            phases["fetch"] += time.perf_counter() - t
            _next_round(coordinator, world, f"the agreed state could not be fetched: {e}")
            continue
        phases["fetch"] += time.perf_counter() - t
        t = time.perf_counter()
        watch = _MembersWatch(coordinator, world.generation)
        try:
            coordination.attach_worker(world, init_timeout_s=world.attach_timeout_s,
                                       cannot_form=watch.heard)
            phases["attach"] += time.perf_counter() - t
            break
        except coordination.ConnectAbandoned as e:  # a member died before it connected
            phases["attach"] += time.perf_counter() - t
            _next_round(coordinator, world, str(e))
        except RuntimeError as e:  # a member of the new world never came (connect timed out)
            phases["attach"] += time.perf_counter() - t
            _next_round(coordinator, world, f"world did not form within "
                                            f"{world.attach_timeout_s} s: {e}")
        finally:
            watch.stop()
    logger.info("world %d: ranks %s, resume from step %d after %d round(s) (%s)",
                agreement.generation, agreement.survivors, agreement.resume_step, rounds,
                ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()))
    return WorldRecovery(agreement, world, state, phases, rounds, members, replaces)


class _MembersWatch:
    """While this process connects to world ``generation``, a thread long-polls the
    launcher (`Coordinator.watch`) for a member of it that died or left for a new agreement
    before connecting: the world can then never form, and ``heard`` completes (with what
    was heard) so that the connect is given up at once, not at its timeout. A death is
    known to the launcher within milliseconds (its agent saw the exit); a slow member is
    never reported, so the connect timeout stays the bound for what the launcher cannot
    see. The launcher unreachable: the watch retries, and the timeout decides."""

    POLL_S = 2.0  # one long poll (the thread ends after the one in flight)

    def __init__(self, coordinator: Coordinator, generation: int):
        self.heard: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._coordinator, self._generation = coordinator, generation
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True,
                         name=f"mnemojax-members-watch-{generation}").start()

    def _run(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            try:
                reply = self._coordinator.watch(generation=self._generation,
                                                timeout_s=self.POLL_S)
            except Exception as e:  # noqa: BLE001 - the launcher restarting: ask again
                logger.debug("members watch of world %d: %s", self._generation, e)
                self._stop.wait(0.2)
                continue
            if reply.failed or reply.left:
                what = (f"workers {list(reply.failed)} died" if reply.failed else
                        f"workers {list(reply.left)} left it for a new agreement")
                self.heard.set_result(f"{what} before it formed ({peer_watch.TOLD_BY_LAUNCHER})")
                return
            # Nothing heard: a long poll that came back early (a regrow asked for, which
            # does not keep the world from forming; a launcher closing) waits out its time.
            self._stop.wait(max(0.0, asked + self.POLL_S - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()


class CopiesUnreachableError(StateUnavailableError):
    """No source of a copy answered when its parts were fetched (its holders died since the
    headers were read): a peer failure of the new world, not a lost state."""


class AgreedCopies:
    """The agreed step's copies, one per old worker: what each covers (its header) and the
    agents that hold it, the one that answered first in front. `fetch` takes only the
    regions asked for, from the copies that overlap them.

    Attributes:
        step, generation: the agreed step, and the world whose copies they are.
        headers: old worker id -> its copy's metadata (`snapshot_codec.read_meta`).
        sources: old worker id -> agent addresses holding its copy.
        fetched_from: old worker id -> the agent that served its parts (only the copies
            that `fetch` needed).
        fetched_bytes: bytes of the state's parts received so far (metadata not counted).
    """

    def __init__(self, step: int, generation: int, headers: Mapping[int, Mapping],
                 sources: Mapping[int, tuple[str, ...]], secret: bytes, *,
                 fetch: Callable[..., tuple[bytearray, str]] | None = None):
        self.step, self.generation = step, generation
        self.headers, self.sources = dict(headers), dict(sources)
        self.fetched_from: dict[int, str] = {}
        self.fetched_bytes = 0
        self._secret = secret
        self._fetch = fetch or fetch_snapshot  # (tests give copies of their own)

    @classmethod
    def probe(cls, agreement: Agreement, secret: bytes) -> AgreedCopies:
        """Reads the header of every agreed copy from its sources (each worker's own agent
        first), checked to be of the agreed step and world.

        Raises:
            StateUnavailableError: no source of some copy answered with a good one.
        """
        headers, sources = {}, {}
        for origin, addrs in agreement.sources.items():
            data, addr = fetch_snapshot(addrs, origin, agreement.resume_step, secret=secret,
                                        header_only=True)
            headers[origin] = cls._checked(origin, addr, data, agreement.resume_step,
                                           agreement.resume_generation)
            sources[origin] = (addr, *(a for a in addrs if a != addr))
        return cls(agreement.resume_step, agreement.resume_generation, headers, sources,
                   secret)

    @staticmethod
    def _checked(origin: int, addr: str, data: bytes | bytearray, step: int,
                 generation: int) -> dict:
        meta = snapshot_codec.read_meta(data)
        if (meta["step"], meta.get("generation", 0)) != (step, generation):
            raise StateUnavailableError(
                f"the copy of worker {origin} from {addr} is of step {meta['step']} (world "
                f"{meta.get('generation', 0)}), not the agreed step {step} (world "
                f"{generation})")
        return meta

    def leaves(self, num_leaves: int) -> list[tuple[tuple[int, ...], np.dtype]]:
        """(global shape, dtype) of each of the state's ``num_leaves`` leaves.

        Raises:
            StateUnavailableError: the copies are of a state with another number of leaves,
                disagree on a leaf's shape or dtype, or a leaf is in none of them.
        """
        specs: dict[int, tuple[tuple[int, ...], np.dtype]] = {}
        for origin, meta in self.headers.items():
            if meta["num_leaves"] != num_leaves:
                raise StateUnavailableError(
                    f"the copy of worker {origin} is of a state of {meta['num_leaves']} "
                    f"leaves; this one has {num_leaves}")
            for m in meta["shards"]:
                spec = (tuple(m["shape"]), snapshot_codec.dtype_of(m["dtype"]))
                if specs.setdefault(m["leaf"], spec) != spec:
                    raise StateUnavailableError(
                        f"the copies disagree on leaf {m['leaf']}: {specs[m['leaf']]} and, "
                        f"in worker {origin}'s, {spec}")
        if missing := [i for i in range(num_leaves) if i not in specs]:
            raise StateUnavailableError(f"leaves {missing} are in none of the agreed copies")
        return [specs[i] for i in range(num_leaves)]

    def fetch(self, boxes: Sequence[snapshot_codec.Box]) -> list[snapshot_codec.ShardEntry]:
        """The agreed state's parts inside ``boxes`` (``(leaf, index)`` regions), one
        request per copy that overlaps any of them.

        Raises:
            CopiesUnreachableError: no source of an overlapping copy answered with a
                good one (of the agreed step and world, well formed).
        """
        wanted: dict[int, list[snapshot_codec.Index]] = {}
        for leaf, index in boxes:
            wanted.setdefault(leaf, []).append(index)
        out: list[snapshot_codec.ShardEntry] = []
        covered: set[snapshot_codec.Box] = set()  # shards of the copies asked so far
        for origin in snapshots_first(self.headers):
            shards = [(m["leaf"], tuple(tuple(i) for i in m["index"]))
                      for m in self.headers[origin]["shards"]]
            if origin >= 0:  # a snapshot: the parts of its shards inside the boxes
                mine = [(leaf, index) for leaf, shard in shards
                        for index in wanted.get(leaf, ())
                        if snapshot_codec.overlap(shard, index) is not None]
            else:  # a held copy: only its shards no copy before it has, never twice
                mine = [(leaf, part) for leaf, shard in shards if (leaf, shard) not in covered
                        for index in wanted.get(leaf, ())
                        if (part := snapshot_codec.overlap(shard, index)) is not None]
            covered.update(shards)
            if not mine:
                continue
            pieces = self._pieces(origin, mine)
            self.fetched_bytes += sum(p.data.nbytes for p in pieces)
            out += pieces
        return out

    def _pieces(self, origin: int,
                boxes: Sequence[snapshot_codec.Box]) -> list[snapshot_codec.ShardEntry]:
        """``boxes`` of ``origin``'s copy from the first of its sources that answers with a
        good one (a bad reply moves on to the next source)."""
        errors = []
        for source in self.sources[origin]:
            try:
                data, addr = self._fetch([source], origin, self.step, secret=self._secret,
                                         boxes=boxes)
                self._checked(origin, addr, data, self.step, self.generation)
                pieces = snapshot_codec.unpack(data)[1]
            except (StateUnavailableError, ValueError, KeyError, TypeError) as e:
                errors.append(f"{source}: {e}")
                continue
            self.fetched_from[origin] = addr
            return pieces
        raise CopiesUnreachableError(f"no good copy of worker {origin}'s regions of step "
                                     f"{self.step}: {errors}")


def _next_round(coordinator: Coordinator, world: WorldSpec, why: str) -> None:
    logger.warning("world %d: %s; agreeing again", world.generation, why)
    coordinator.report_failure(generation=world.generation, reason=why[:500])
