"""Every message between the launcher, the agents and the workers: one frozen class each.

A message travels as one frame (`transport`): a JSON header, the dict `Message.to_wire`
returns (its ``op`` names the message), then an optional binary payload (a snapshot).
`decode` turns a received header back into its class and checks every field against its
declared type: a missing field, or one of the wrong type, raises `ProtocolError` naming it
(``.op``, ``.field``).
The format is shared by the processes of one mnemojax version only. No JAX here.

==========================  =====================================  ===========================
sender -> receiver          message                                reply
==========================  =====================================  ===========================
agent -> launcher (link)    Hello, WorkerStarted, WorkerExit,      none (events)
                            Progress, Hang, ReplicaRefused,
                            WorkerPhase
launcher -> agent (link)    Start, SetBuddy, PauseWatchdog,        none (commands)
                            KillWorker, Shutdown
worker -> launcher          ReportFailure                          Ok
worker -> launcher          Agree (a barrier, `agreement`)         AgreementReply | ErrorReply
worker -> launcher          Barrier (after each compile)           BarrierReply | ErrorReply
worker -> launcher          WatchWorld (a long poll, `peer_watch`)  WorldFailed | ErrorReply
launcher -> agent           HoldingsQuery                          Holdings
worker -> its agent         Alloc                                  Allocated
worker -> its agent         Published, Phase, InStep               none
worker -> its agent         AwaitReplicated (before a publish)     Replicated
worker -> its agent         Hold (+ payload, own connection)       Ok | ErrorReply
agent -> its ring buddy     Replica (+ payload)                    Ok | ErrorReply
anyone -> agent             Get                                    Snapshot (+ payload) | ErrorReply
server -> client (setup)    AuthChallenge; the client answers      AuthAccepted, or closed
                            AuthResponse (`auth`)
agent -> launcher (link)    RefusedConnection                      none (event)
==========================  =====================================  ===========================
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn, Self

from mnemojax._src.distributed.agreement import Agreement, CopyInfo
from mnemojax._src.errors import ProtocolError


class _Fields:
    """Typed reads of one (possibly nested) header; a bad field raises `ProtocolError`."""

    def __init__(self, op: str, header: Mapping[str, Any], prefix: str = ""):
        self.op, self._header, self._prefix = op, header, prefix

    def fail(self, name: str, problem: str) -> NoReturn:
        field = self._prefix + name
        raise ProtocolError(f"malformed {self.op!r} message: field {field!r} {problem}",
                            op=self.op, field=field)

    def _raw(self, name: str) -> Any:
        if name not in self._header:
            self.fail(name, "is missing")
        return self._header[name]

    def integer(self, name: str) -> int:
        value = self._raw(name)
        if type(value) is not int:  # bool is an int subclass: not accepted
            self.fail(name, f"must be an integer, got {value!r}")
        return value

    def opt_integer(self, name: str) -> int | None:
        return None if self._header.get(name) is None else self.integer(name)

    def flag(self, name: str) -> bool:
        value = self._raw(name)
        if type(value) is not bool:
            self.fail(name, f"must be true or false, got {value!r}")
        return value

    def number(self, name: str) -> float:
        value = self._raw(name)
        if type(value) not in (int, float):
            self.fail(name, f"must be a number, got {value!r}")
        return float(value)

    def opt_number(self, name: str) -> float | None:
        return None if self._header.get(name) is None else self.number(name)

    def text(self, name: str) -> str:
        value = self._raw(name)
        if not isinstance(value, str):
            self.fail(name, f"must be a string, got {value!r}")
        return value

    def opt_text(self, name: str) -> str | None:
        return None if self._header.get(name) is None else self.text(name)

    def text_map(self, name: str) -> dict[str, str]:
        value = self._raw(name)
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            self.fail(name, "must map strings to strings")
        return dict(value)

    def integers(self, name: str) -> tuple[int, ...]:
        value = self._raw(name)
        if not isinstance(value, list) or any(type(v) is not int for v in value):
            self.fail(name, f"must be a list of integers, got {value!r}")
        return tuple(value)

    def int_map(self, name: str) -> dict[int, int]:
        value = self._raw(name)
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and k.isdigit() and type(v) is int for k, v in value.items()):
            self.fail(name, f"must map worker ids to worker ids, got {value!r}")
        return {int(k): v for k, v in value.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._header

    def intervals(self, name: str) -> tuple[tuple[int, int], ...]:
        value = self._raw(name)
        if not isinstance(value, list) or not all(
                isinstance(v, list) and len(v) == 2 and all(type(i) is int for i in v)
                for v in value):
            self.fail(name, f"must be a list of [start, stop] pairs, got {value!r}")
        return tuple((v[0], v[1]) for v in value)

    def addresses_by_worker(self, name: str) -> dict[int, tuple[str, ...]]:
        value = self._raw(name)
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and k.removeprefix("-").isdigit() and isinstance(v, list)
                and all(isinstance(a, str) for a in v) for k, v in value.items()):
            # (a negative id names a survivor's held copy, `agreement.held_origin`)
            self.fail(name, f"must map worker ids to lists of addresses, got {value!r}")
        return {int(k): tuple(v) for k, v in value.items()}

    def nested(self, name: str) -> _Fields:
        value = self._raw(name)
        if not isinstance(value, dict):
            self.fail(name, "must be an object")
        return _Fields(self.op, value, f"{self._prefix}{name}.")

    def records(self, name: str) -> list[_Fields]:
        value = self._raw(name)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            self.fail(name, "must be a list of objects")
        return [_Fields(self.op, v, f"{self._prefix}{name}[{i}].") for i, v in enumerate(value)]


# How a field of each declared type is read back; a message with other field types
# overrides `Message.from_wire` (and `to_wire`).
_READERS: dict[object, Callable[[_Fields, str], Any]] = {
    bool: _Fields.flag, int: _Fields.integer, int | None: _Fields.opt_integer,
    float: _Fields.number, float | None: _Fields.opt_number,
    str: _Fields.text, str | None: _Fields.opt_text,
    dict[str, str]: _Fields.text_map, tuple[int, ...]: _Fields.integers,
}


@functools.cache
def _field_readers(cls: type) -> tuple[tuple[str, Callable[[_Fields, str], Any]], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _READERS[hints[f.name]]) for f in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class Message:
    """Base of every message; ``OP`` names it on the wire.

    A message is a frozen dataclass whose fields are JSON values of the types `_READERS`
    knows (or it overrides both methods).
    """

    OP: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        """The JSON header: ``op`` and every field."""
        return {"op": self.OP, **{f.name: getattr(self, f.name)
                                  for f in dataclasses.fields(self)}}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        """Rebuilds the message from a header whose ``op`` is ``OP`` (checked by `decode`),
        checking each field against its declared type.

        Raises:
            ProtocolError: a field is missing or of the wrong type (named in ``.field``).
        """
        fields = _Fields(cls.OP, header)
        return cls(**{name: read(fields, name) for name, read in _field_readers(cls)})


# -- agent -> launcher: events on the agent's persistent link ----------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """An agent is up: its worker id, the address it serves on, its pid."""

    OP: ClassVar[str] = "hello"
    worker_id: int
    address: str
    pid: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerStarted(Message):
    OP: ClassVar[str] = "worker_started"
    worker_id: int
    pid: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerExit(Message):
    """The agent's worker exited with ``code`` (negative: killed by that signal)."""

    OP: ClassVar[str] = "worker_exit"
    worker_id: int
    code: int
    pid: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress(Message):
    """The worker published the snapshot of ``step``."""

    OP: ClassVar[str] = "progress"
    worker_id: int
    step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hang(Message):
    """The hang watchdog fired (the agent kills the worker)."""

    OP: ClassVar[str] = "hang"
    worker_id: int
    idle_s: float
    median_s: float | None
    step: int | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaRefused(Message):
    """A buddy replica would take the agent's host over its snapshot budget (said once)."""

    OP: ClassVar[str] = "replica_refused"
    worker_id: int
    origin: int
    step: int
    budget_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerPhase(Message):
    """The worker entered ``phase`` (its `Phase`, passed on: the launcher logs it)."""

    OP: ClassVar[str] = "worker_phase"
    worker_id: int
    phase: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class RefusedConnection(Message):
    """The agent closed a connection that failed the handshake (`auth`)."""

    OP: ClassVar[str] = "refused_connection"
    worker_id: int
    peer: str
    reason: str


# -- launcher -> agent: commands on the same link -------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Start(Message):
    """Start the worker with ``env`` (added to the agent's); ``buddy``: ring successor."""

    OP: ClassVar[str] = "start"
    env: dict[str, str]
    buddy: str | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SetBuddy(Message):
    """Replicate to this agent from now on (None: no ring, a world of one).

    ``resume_step``: the step a new world resumed from, if any (-1: from the persistent
    tier, as `Agreement.resume_step`): a new buddy gets that copy first, not the newest
    (which may be an abandoned step of the old world).

    ``keep_from``: the oldest world whose copies can still serve an agreement (the world
    the resumed copies came from; the new world itself after a resume from the
    persistent tier): the agent drops its replicas from older worlds
    (`ReplicaStore.forget_before`). None: keep them (a buddy set at start).
    """

    OP: ClassVar[str] = "set_buddy"
    buddy: str | None
    resume_step: int | None = None
    keep_from: int | None = None

    @classmethod
    def for_world(cls, buddy: str | None, agreement: Agreement | None, *,
                  newest: bool = True) -> SetBuddy:
        """What a member's agent is told when a world forms by ``agreement`` (None: world
        0): its buddy, the step the world resumed from, and, for the ``newest`` world
        only, the oldest world whose copies it keeps (`Agreement.keep_from`; a launcher
        catching up on several worlds must not drop what the newest one resumed from)."""
        if agreement is None:
            return cls(buddy=buddy)
        return cls(buddy=buddy, resume_step=agreement.resume_step,
                   keep_from=agreement.keep_from if newest else None)


@dataclasses.dataclass(frozen=True)
class PauseWatchdog(Message):
    """A peer failed: the worker may block for up to the collective timeout."""

    OP: ClassVar[str] = "pause_watchdog"


@dataclasses.dataclass(frozen=True)
class KillWorker(Message):
    """Fence the worker (evicted from the agreement)."""

    OP: ClassVar[str] = "kill_worker"


@dataclasses.dataclass(frozen=True)
class Shutdown(Message):
    """End the agent (it kills its worker and removes its segment)."""

    OP: ClassVar[str] = "shutdown"


# -- worker -> launcher: the agreement ------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportFailure(Message):
    OP: ClassVar[str] = "report_failure"
    worker_id: int
    generation: int
    reason: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Leave(Message):
    """`Coordinator.leave`: this worker leaves the job (the new mesh gives its process no
    device, or it joined and cannot fetch the agreed state): a member that is gone, as if
    dead, but no failure of the job."""

    OP: ClassVar[str] = "leave"
    worker_id: int
    generation: int
    reason: str

    # A reason that starts so: a joiner whose loop does not start at ``step.restore()``;
    # no spare can join this job (the launcher takes none from then on).
    NO_RESTORE: ClassVar[str] = "its loop does not start at step.restore(): "


@dataclasses.dataclass(frozen=True, kw_only=True)
class Agree(Message):
    """`Coordinator.agree`: a barrier over world ``generation``'s live members."""

    OP: ClassVar[str] = "agree"
    worker_id: int
    generation: int
    last_step: int
    first_replayable: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgreementReply(Message):
    OP: ClassVar[str] = "agreement"
    agreement: Agreement

    def to_wire(self) -> dict[str, Any]:
        a = self.agreement
        return {"op": self.OP, "agreement": {
            "generation": a.generation, "worker_id": a.worker_id, "process_id": a.process_id,
            "num_processes": a.num_processes, "coordinator": a.coordinator,
            "resume_step": a.resume_step, "survivors": list(a.survivors),
            "previous_members": list(a.previous_members),
            "sources": {str(k): list(v) for k, v in a.sources.items()},
            "lost": list(a.lost), "resume_generation": a.resume_generation, "why": a.why,
            "replaces": {str(k): v for k, v in a.replaces.items()}}}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        f = _Fields(cls.OP, header).nested("agreement")
        return cls(agreement=Agreement(
            generation=f.integer("generation"), worker_id=f.integer("worker_id"),
            process_id=f.integer("process_id"), num_processes=f.integer("num_processes"),
            coordinator=f.text("coordinator"), resume_step=f.integer("resume_step"),
            survivors=f.integers("survivors"), previous_members=f.integers("previous_members"),
            sources=f.addresses_by_worker("sources"), lost=f.integers("lost"),
            resume_generation=f.integer("resume_generation"), why=f.text("why"),
            replaces=f.int_map("replaces") if "replaces" in f else {}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Barrier(Message):
    """`Coordinator.barrier`: wait until every member of world ``generation`` has arrived
    at barrier ``name``, or one of them has died or gone to the next agreement
    (``timeout_s``: then the missing members are evicted, as at the agreement)."""

    OP: ClassVar[str] = "barrier"
    worker_id: int
    generation: int
    name: str
    timeout_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class BarrierReply(Message):
    """The barrier's outcome, the same for every member: passed (``failed`` empty), or
    failed because the members ``failed`` died (or were evicted, or went to the next
    agreement) before all arrived."""

    OP: ClassVar[str] = "barrier_result"
    failed: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WatchWorld(Message):
    """A long poll: answer when a member of world ``generation`` has died (or was evicted,
    or went to the next agreement), or after ``timeout_s`` with none of these (the worker
    asks again)."""

    OP: ClassVar[str] = "watch_world"
    worker_id: int
    generation: int
    timeout_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldFailed(Message):
    """The members of world ``generation`` known dead (empty: none yet, the poll timed
    out). ``regrow``: no one died, but the world is to re-form larger (spares can fill it
    back to world 0's size): its members recover as after a death. ``left``: no death is
    known, but these members left the world for the next agreement (they saw it fail, e.g.
    the agreed state's holders died before they could fetch it): the others recover too."""

    OP: ClassVar[str] = "world_failed"
    generation: int
    failed: tuple[int, ...]
    regrow: bool = False
    left: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class AwaitJoin(Message):
    """A spare's long poll (its process is up, JAX imported, no world yet): answered with
    `Joined` when a world takes it in, or after ``timeout_s`` with none (it asks again);
    `ErrorReply` when the job ends."""

    OP: ClassVar[str] = "await_join"
    worker_id: int
    timeout_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Joined(Message):
    """The agreement of the world that took the spare in (None: not yet)."""

    OP: ClassVar[str] = "joined"
    agreement: Agreement | None = None

    def to_wire(self) -> dict[str, Any]:
        inner = None if self.agreement is None else AgreementReply(
            agreement=self.agreement).to_wire()
        return {"op": self.OP, "agreement": inner}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        inner = header.get("agreement")
        if inner is not None and not isinstance(inner, dict):
            raise ProtocolError(f"{cls.OP}: agreement must be an object or null",
                                op=cls.OP, field="agreement")
        return cls(agreement=None if inner is None else AgreementReply.from_wire(
            {**inner, "op": AgreementReply.OP}).agreement)


# -- launcher -> agent: what it holds ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HoldingsQuery(Message):
    """Which copies do you hold? (each checked against its checksum now)"""

    OP: ClassVar[str] = "holdings"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorruptCopy:
    """A copy that failed its check (``step`` None: its metadata does not parse)."""

    origin: int
    step: int | None
    error: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Holdings(Message):
    """The verified copies an agent holds, and the corrupt ones (never counted)."""

    OP: ClassVar[str] = "held"
    copies: tuple[CopyInfo, ...]
    corrupt: tuple[CorruptCopy, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP,
                "copies": [{"origin": c.origin, "step": c.step, "generation": c.generation,
                            "num_leaves": c.num_leaves,
                            "shards": [{"leaf": leaf, "shape": list(shape),
                                        "index": [list(i) for i in index]}
                                       for leaf, shape, index in c.shards]}
                           for c in self.copies],
                "corrupt": [dataclasses.asdict(c) for c in self.corrupt]}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        f = _Fields(cls.OP, header)
        copies = tuple(
            CopyInfo(c.integer("origin"), c.integer("step"), c.integer("generation"),
                     c.integer("num_leaves"),
                     tuple((s.integer("leaf"), s.integers("shape"), s.intervals("index"))
                           for s in c.records("shards")))
            for c in f.records("copies"))
        corrupt = tuple(CorruptCopy(origin=c.integer("origin"), step=c.opt_integer("step"),
                                    error=c.text("error")) for c in f.records("corrupt"))
        return cls(copies=copies, corrupt=corrupt)


# -- worker -> its agent ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Alloc(Message):
    """Make each snapshot slot at least ``nbytes``; ``budget_bytes``: the host's budget."""

    OP: ClassVar[str] = "alloc"
    nbytes: int
    budget_bytes: int | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Allocated(Message):
    """The shared-memory segment to attach to, and its slot size."""

    OP: ClassVar[str] = "allocated"
    name: str
    slot_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Published(Message):
    """The snapshot of ``step`` is complete in shared memory (also the progress signal);
    ``in_series``: published with `SnapshotOptions.replicate_in_series`."""

    OP: ClassVar[str] = "published"
    step: int
    in_series: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class AwaitReplicated(Message):
    """Before the worker overwrites one of its two slots: answer once the replicator has sent
    the newest snapshot after every publish so far and the ring buddy kept it, or at once
    when there is no buddy or nothing was published (caught up), or when sending fails or
    the buddy refused the last copy (not); at the latest after ``timeout_s``."""

    OP: ClassVar[str] = "await_replicated"
    timeout_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replicated(Message):
    """`AwaitReplicated`'s answer: whether the buddy has every published snapshot, and if
    not, why (``detail``)."""

    OP: ClassVar[str] = "replicated"
    caught_up: bool
    detail: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hold(Message):
    """At a peer failure: keep this (the payload) until the next publish, the regions of
    the last good state (``step``) the worker's devices hold that its snapshots lack, as
    the copy of origin `agreement.held_origin`; ``crc`` is the payload's CRC32C. Answered
    `Ok`, or `ErrorReply` when it fails its check or would exceed the host's budget."""

    OP: ClassVar[str] = "hold"
    step: int
    crc: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phase(Message):
    """The worker entered ``phase`` (``compile``, ``recover``, ``train``, ``finish``, ``left``)."""

    OP: ClassVar[str] = "phase"
    phase: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class InStep(Message):
    """The worker has been between calls of its resilient step for a second or more (again
    every second while it stays there), or entered a call after that (``inside``).
    Between calls it runs its own code (an eval, a save, a slow input pipeline), which the
    hang watchdog does not judge however long it takes (`HangWatchdog.step_bounds`)."""

    OP: ClassVar[str] = "in_step"
    inside: bool


# -- snapshots between agents, and to survivors -------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replica(Message):
    """A copy of worker ``origin``'s snapshot of ``step`` (the payload), for its buddy;
    ``crc`` is the payload's CRC32C (`checksum`), as the worker published it.
    ``make_room``: the buddy may drop what this copy outdates before the payload arrives
    (`ReplicaStore.make_room`; the worker publishes in series); ``generation``: the world
    that produced it (what its metadata says)."""

    OP: ClassVar[str] = "replica"
    origin: int
    step: int
    crc: int
    make_room: bool = False
    generation: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Get(Message):
    """Send me your copy of worker ``origin``'s snapshot of ``step``: all of it; or only
    its metadata (``header_only``, `snapshot_codec.header`: what it covers); or only its
    parts inside ``boxes`` (``(leaf, ((start, stop), ...))`` each, `snapshot_codec.select`),
    the regions the asking process's devices hold on its new mesh."""

    OP: ClassVar[str] = "get"
    origin: int
    step: int
    header_only: bool = False
    boxes: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "origin": self.origin, "step": self.step,
                "header_only": self.header_only,
                "boxes": None if self.boxes is None else [
                    {"leaf": leaf, "index": [list(i) for i in index]}
                    for leaf, index in self.boxes]}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        f = _Fields(cls.OP, header)
        boxes = None if header.get("boxes") is None else tuple(
            (b.integer("leaf"), b.intervals("index")) for b in f.records("boxes"))
        return cls(origin=f.integer("origin"), step=f.integer("step"),
                   header_only=f.flag("header_only") if "header_only" in f else False,
                   boxes=boxes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Snapshot(Message):
    """The reply to `Get`: the payload, with its CRC32C (`checksum`): the one its holder
    checked the copy against, or, for a header or a selection, the one of the bytes cut
    from that checked copy."""

    OP: ClassVar[str] = "snapshot"
    origin: int
    step: int
    crc: int


# -- generic replies ------------------------------------------------------------------------------


# -- every connection's first exchange: the handshake (`auth`) -------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuthChallenge(Message):
    """The server's fresh nonce (hex)."""

    OP: ClassVar[str] = "auth_challenge"
    nonce: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuthResponse(Message):
    """The client's fresh nonce and its proof of the job secret over both nonces."""

    OP: ClassVar[str] = "auth_response"
    nonce: str
    mac: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuthAccepted(Message):
    """The server's proof of the job secret over both nonces."""

    OP: ClassVar[str] = "auth_accepted"
    mac: str


@dataclasses.dataclass(frozen=True)
class Ok(Message):
    OP: ClassVar[str] = "ok"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorReply(Message):
    """The request failed; `transport.request` raises it as `ProtocolError`."""

    OP: ClassVar[str] = "error"
    message: str


AgentEvent = (Hello | WorkerStarted | WorkerExit | Progress | Hang | ReplicaRefused
              | WorkerPhase | RefusedConnection)
Command = Start | SetBuddy | PauseWatchdog | KillWorker | Shutdown

MESSAGES: tuple[type[Message], ...] = (
    Hello, WorkerStarted, WorkerExit, Progress, Hang, ReplicaRefused, WorkerPhase,
    RefusedConnection, Start, SetBuddy, PauseWatchdog, KillWorker, Shutdown,
    ReportFailure, Leave, Agree, AgreementReply, Barrier, BarrierReply, WatchWorld, WorldFailed,
    AwaitJoin, Joined,
    HoldingsQuery, Holdings,
    Alloc, Allocated, Published, AwaitReplicated, Replicated, Hold, Phase, InStep, Replica, Get,
    Snapshot,
    AuthChallenge, AuthResponse, AuthAccepted, Ok, ErrorReply)
_BY_OP: dict[str, type[Message]] = {m.OP: m for m in MESSAGES}


def decode(header: Any) -> Message:
    """The message a received JSON header carries.

    Raises:
        ProtocolError: the header is not an object with a known ``op``, or a field is
            missing or of the wrong type (``.op`` and ``.field`` say which).
    """
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError(f"header {header!r} has no op", field="op")
    cls = _BY_OP.get(header["op"])
    if cls is None:
        raise ProtocolError(f"unknown op {header['op']!r}", op=header["op"], field="op")
    return cls.from_wire(header)
