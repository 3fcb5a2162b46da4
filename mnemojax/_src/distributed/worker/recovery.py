"""The worker's recovery sequence after a peer failure (the resilient step calls it
through `session.DistributedSession.recover`).

`recover_world` runs steps 1-3 of the agreement protocol (see `distributed.agreement`) and
the in-process re-initialisation of DESIGN §4, then fetches the snapshots of the agreed step
that cover the state from the live agents. The caller then rebuilds its mesh over
``jax.devices()``, compiles, waits at `coordination.barrier`, restores
(`state_transfer.restore_leaves`) and replays.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from mnemojax._src.distributed import snapshot_codec
from mnemojax._src.distributed.agreement import ANY_STEP, Agreement
from mnemojax._src.distributed.env import WorldSpec
from mnemojax._src.distributed.worker import coordination
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
        payloads: the snapshots of ``agreement.resume_step`` named in its ``sources``
            (CRC-checked); together they cover every leaf.
        phases: seconds per phase: ``detach``, ``agree``, ``attach``, ``fetch``.
        fetched_from: old worker id -> agent address its copy came from.
        rounds: agreement rounds it took (more than 1 when a survivor died after a decision).
        members: worker ids of the world that failed (before the first round).
        replaces: joiner (spare) -> the member of that world whose rank it took, across
            every round.
    """

    agreement: Agreement
    world: WorldSpec
    payloads: list[bytearray]
    phases: dict[str, float]
    fetched_from: dict[int, str]
    rounds: int = 1
    members: tuple[int, ...] = ()
    replaces: Mapping[int, int] = dataclasses.field(default_factory=dict)


def recover_world(coordinator: Coordinator, world: WorldSpec, *, last_step: int,
                  reason: str = "", first_replayable: int | None = None) -> WorldRecovery:
    """Detaches, agrees, joins the survivors' world and fetches the agreed state.

    Detaching comes first, so the old world's service can stop at decision time. The caller
    must hold no ``jax.Array`` of the old world (drop them and leave the ``except`` block
    whose traceback references them) before calling. Detaching does not free a peer still
    blocked in a collective with this process (measured: the old CPU client and its gloo
    pairs live on while anything refers to them, e.g. the user's ``Mesh``); the peers learn
    of the death from the launcher instead (`peer_watch`).

    Barrier semantics: `Coordinator.agree` returns once every live member of ``world`` has
    arrived (or was declared dead); every survivor gets the same agreement or an
    `AgreementError`. The agreed payloads are fetched, then the new world is joined, which is
    a second barrier (``connect``): when a member of the new world died after the decision,
    or could not fetch the agreed state (its sources died since), it times out
    (``world.attach_timeout_s``) for every survivor alike, and they agree again over the new
    world (another round).

    When ``agreement.resume_step == -1`` (no step's state survives, `Agreement.lost`), the
    new world is joined but nothing is fetched: the caller falls back or raises.

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
    or a spare taking a dead member's rank) joins the world ``agreement`` decided: fetches
    the agreed state, then connects. As for a survivor, a world that does not form (a
    member died after the decision, a copy could not be fetched) is agreed on again, over
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
    """Agreement rounds (``agree(generation)``) until this process has fetched the agreed
    state and joined the agreed world (`recover_world`)."""
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
        # A joiner of a later round may replace one of an earlier round's: trace each back
        # to the member of the world that failed first (whose devices it takes).
        for joiner, dead in agreement.replaces.items():
            replaces[joiner] = replaces.pop(dead, dead)
        phases["agree"] += time.perf_counter() - t
        world = dataclasses.replace(
            world, coordinator=agreement.coordinator, process_id=agreement.process_id,
            num_processes=agreement.num_processes, generation=agreement.generation,
            worker_id=world.stable_id)
        # Fetch before joining: if every source of a copy died since the decision, this
        # process stays out of the new world, so it never forms and everyone agrees again.
        t = time.perf_counter()
        try:
            payloads, fetched_from = fetch_agreed(agreement, world.secret or b"")
        except StateUnavailableError as e:
            phases["fetch"] += time.perf_counter() - t
            _next_round(coordinator, world, f"the agreed state could not be fetched: {e}")
            continue
        phases["fetch"] += time.perf_counter() - t
        t = time.perf_counter()
        try:
            coordination.attach_worker(world, init_timeout_s=world.attach_timeout_s)
            phases["attach"] += time.perf_counter() - t
            break
        except RuntimeError as e:  # a member of the new world never came (connect timed out)
            phases["attach"] += time.perf_counter() - t
            _next_round(coordinator, world, f"world did not form within "
                                            f"{world.attach_timeout_s} s: {e}")
    logger.info("world %d: ranks %s, resume from step %d after %d round(s) (%s)",
                agreement.generation, agreement.survivors, agreement.resume_step, rounds,
                ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()))
    return WorldRecovery(agreement, world, payloads, phases, fetched_from, rounds, members,
                         replaces)


def fetch_agreed(agreement: Agreement,
                 secret: bytes) -> tuple[list[bytearray], dict[int, str]]:
    """The agreed step's payloads from the sources (each worker's own agent first),
    checked to be of the agreed step and world."""
    payloads, fetched_from = [], {}
    for origin, addrs in agreement.sources.items():
        payload, fetched_from[origin] = fetch_snapshot(addrs, origin, agreement.resume_step,
                                                       secret=secret)
        meta = snapshot_codec.read_meta(payload)
        if (meta["step"], meta.get("generation", 0)) != (agreement.resume_step,
                                                          agreement.resume_generation):
            raise StateUnavailableError(
                f"the copy of worker {origin} from {fetched_from[origin]} is of step "
                f"{meta['step']} (world {meta.get('generation', 0)}), not the agreed step "
                f"{agreement.resume_step} (world {agreement.resume_generation})")
        payloads.append(payload)
    return payloads, fetched_from


def _next_round(coordinator: Coordinator, world: WorldSpec, why: str) -> None:
    logger.warning("world %d: %s; agreeing again", world.generation, why)
    coordinator.report_failure(generation=world.generation, reason=why[:500])
