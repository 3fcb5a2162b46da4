"""The worker's recovery sequence after a peer failure (the lead's resilient step calls it).

`recover_world` runs steps 1-3 of the agreement protocol (see `agreement`) and the in-process
re-initialisation of DESIGN §4, then fetches every old worker's snapshot of the agreed step
from the live agents. The caller then rebuilds its mesh over ``jax.devices()``, restores
(`state_transfer.restore_leaves`), compiles, waits at `coordination.barrier` and replays.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from mnemojax._src.distributed import coordination
from mnemojax._src.distributed.agent_client import fetch_snapshot
from mnemojax._src.distributed.agreement import Agreement, Coordinator
from mnemojax._src.distributed.env import WorldSpec

logger = logging.getLogger("mnemojax")


@dataclasses.dataclass(frozen=True)
class WorldRecovery:
    """Result of `recover_world`.

    Attributes:
        agreement: what the survivors agreed on.
        world: this process's place in the new world.
        payloads: every old worker's snapshot of ``agreement.resume_step`` (CRC-checked).
        phases: seconds per phase: ``detach``, ``agree``, ``attach``, ``fetch``.
        fetched_from: old worker id -> agent address its copy came from.
    """

    agreement: Agreement
    world: WorldSpec
    payloads: list[bytearray]
    phases: dict[str, float]
    fetched_from: dict[int, str]


def recover_world(coordinator: Coordinator, world: WorldSpec, *, last_step: int,
                  reason: str = "", own_agent: str | None = None) -> WorldRecovery:
    """Detaches, agrees, joins the survivors' world and fetches the agreed state.

    Detaching comes first: dropping this process's backend closes its gloo connections, so a
    peer still blocked in a collective with it fails at once instead of after the collective
    timeout. For that the caller must hold no ``jax.Array`` of the old world (drop them and
    leave the ``except`` block whose traceback references them) before calling.

    Barrier semantics: `Coordinator.agree` returns once every live member of ``world`` has
    arrived (or was declared dead); every survivor gets the same agreement or an
    `AgreementError`. Joining the new world is a second barrier (``connect``).

    Args:
        coordinator: the agreement service (`LauncherCoordinator` under ``mnemojax launch``).
        world: this process's current world.
        last_step: the newest step this process completed and published.
        reason: what was seen (logged by the coordinator).
        own_agent: this worker's agent, preferred as a source for its own snapshot.
    """
    phases = {}
    t = time.perf_counter()
    coordinator.report_failure(generation=world.generation, reason=reason[:500])
    coordination.detach_worker()
    phases["detach"] = time.perf_counter() - t
    t = time.perf_counter()
    agreement = coordinator.agree(generation=world.generation, last_step=last_step)
    phases["agree"] = time.perf_counter() - t
    new_world = dataclasses.replace(
        world, coordinator=agreement.coordinator, process_id=agreement.process_id,
        num_processes=agreement.num_processes, generation=agreement.generation,
        worker_id=world.stable_id)
    t = time.perf_counter()
    coordination.attach_worker(new_world)
    phases["attach"] = time.perf_counter() - t
    t = time.perf_counter()
    payloads, fetched_from = [], {}
    for origin in agreement.previous_members:
        addrs = list(agreement.sources[origin])
        if own_agent in addrs and origin == world.stable_id:
            addrs.remove(own_agent)
            addrs.insert(0, own_agent)
        payload, fetched_from[origin] = fetch_snapshot(addrs, origin, agreement.resume_step)
        payloads.append(payload)
    phases["fetch"] = time.perf_counter() - t
    logger.info("world %d: ranks %s, resume from step %d (%s)", agreement.generation,
                agreement.survivors, agreement.resume_step,
                ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()))
    return WorldRecovery(agreement, new_world, payloads, phases, fetched_from)
