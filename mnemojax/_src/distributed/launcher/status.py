"""``mnemojax status --rdzv etcd://HOST:PORT --rdzv-id JOB``: a multi-node job as etcd has
it (`plane`): the live nodes, the current world and where its coordination service runs,
the step each world resumed from, the workers' newest published steps (each node writes
them every few seconds), the dead workers, the exits and why the job ended. ``--json``
prints the summary as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from mnemojax._src.distributed.launcher.etcd_store import EtcdStore, RendezvousError
from mnemojax._src.distributed.launcher.plane import JobView, agreement_of


def summary(store: EtcdStore, nproc: int | None = None) -> dict[str, Any]:
    """The job's state as one dict (``nproc``: workers per node, read from the nodes'
    records when not given)."""
    return summary_of(store.items(), nproc)


def summary_of(items: dict[str, Any], nproc: int | None = None) -> dict[str, Any]:
    """`summary` of the job's keys ``items`` (its prefix taken off)."""
    if nproc is None:
        nproc = max((int(v.get("nproc", 0)) for k, v in items.items()
                     if k.startswith("nodes/") and isinstance(v, dict)), default=1) or 1
    view = JobView(items, nproc)
    left, exits = view.left(), view.exits()
    latest = view.latest()
    world = view.world(latest) or {}
    steps: dict[int, int] = {}
    written = None  # when the newest progress record was written
    for key, record in items.items():
        if key.startswith("progress/") and isinstance(record, dict):
            steps.update({int(w): int(s) for w, s in record.get("steps", {}).items()})
            written = max(written or 0.0, float(record.get("t", 0.0)))
    members = world.get("members", [])
    return {"steps": dict(sorted(steps.items())),
            # The newest step every member of the current world has published.
            "step": min((steps[w] for w in members if w in steps), default=None)
            if members and all(w in steps for w in members) else None,
            "progress_age_s": None if written is None else round(time.time() - written, 1),
            "resumed_from": {g: _resume_step(view.world(g) or {}) for g in view.worlds()},
            "live_nodes": sorted(view.live_nodes()),
            "generation": latest, "members": world.get("members", []),
            "coordinator": world.get("coordinator"), "host_node": world.get("host_node"),
            "worlds": {g: list(m) for g, m in sorted(view.worlds().items())},
            "dead": sorted(view.dead() - left), "left": sorted(left),
            "idle_spares": view.idle_spares(), "exits": exits, "end": view.end(),
            # Spares taken back as they stopped asking to join (a trial: not shown), and
            # why a worker was declared dead where its exit does not say (an eviction).
            "quiet_spares": view.quiet_spares(), "dead_why": view.dead_why(),
            # Fresh id -> the worker it restarted (`--max-restarts`; a trial: not shown).
            "restarts": {int(k.split("/", 1)[1]): int(v["restarts"])
                         for k, v in sorted(items.items()) if k.startswith("rejoin/")
                         and isinstance(v, dict) and "restarts" in v},
            "stopping": view.stopping(),
            # Every member of the last world exited 0, with no stop told: done (no node
            # writes an end then, as one node's end is not the job's).
            "finished": view.end() is None and view.stopping() is None
            and bool(world.get("members")) and all(exits.get(w) == 0
                                                   for w in world["members"]),
            "empty": not items}


def _resume_step(record: dict[str, Any]) -> int | None:
    """The step a world's members resumed from (None for world 0, which started): one
    agreement decides it for all of them."""
    members = record.get("members") or ()
    first = agreement_of(record, members[0]) if members else None
    return None if first is None else first.resume_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rdzv", required=True, metavar="etcd[s]://HOST:PORT[,HOST:PORT]")
    parser.add_argument("--rdzv-id", default="mnemojax", help="the job's name in etcd")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    try:
        s = summary(EtcdStore.from_url(args.rdzv, args.rdzv_id, retry_s=5.0))
    except RendezvousError as e:
        print(f"mnemojax status: {e}", file=sys.stderr)
        return 1
    if s["empty"]:
        print(f"mnemojax status: no job {args.rdzv_id!r} in etcd at {args.rdzv} (nothing "
              "under its name: not started yet, or another --rdzv-id)", file=sys.stderr)
    if args.json:
        print(json.dumps(s, sort_keys=True))
    if s["empty"] or args.json:
        return 1 if s["empty"] else 0
    if s["generation"] < 0:
        print(f"job {args.rdzv_id!r}: no world formed yet; live nodes {s['live_nodes']}")
        return 0
    print(f"job {args.rdzv_id!r}: world {s['generation']}, workers {s['members']}, "
          f"coordination service {s['coordinator']} on node {s['host_node']}")
    if s["steps"]:
        newest = (f"step {s['step']} published by every worker of the world"
                  if s["step"] is not None else "not every worker of the world has published")
        print(f"  {newest}; newest steps {s['steps']} (written {s['progress_age_s']} s ago)")
    print(f"  live nodes: {s['live_nodes']}")
    for g, members in s["worlds"].items():
        resumed = s["resumed_from"].get(g)
        print(f"  world {g}: {members}" + (
            "" if resumed is None else f", resumed from step {resumed}" if resumed >= 0
            else ", resumed from the persistent checkpoint (no complete copy in memory)"))
    if s["idle_spares"]:
        print(f"  idle spares: {s['idle_spares']}")
    if s["restarts"]:
        print("  restarted: " + ", ".join(f"worker {old} as {new}"
                                          for new, old in s["restarts"].items()))
    if s["quiet_spares"]:
        print(f"  spares that stopped asking to join (frozen or stalled?): {s['quiet_spares']}")
    if s["dead"]:
        why = s["dead_why"]
        print(f"  dead workers: {s['dead']}" + "".join(
            f"\n    worker {w}: {why[w]}" for w in s["dead"] if w in why))
    if s["left"]:
        print(f"  workers that left the job: {s['left']}")
    if s["exits"]:
        print(f"  exits: {s['exits']}")
    if s["stopping"]:  # (a trial: a stopped job read "finished")
        print(f"  stopped: signal {s['stopping'].get('signal')} to node "
              f"{s['stopping'].get('node')} ({s['stopping'].get('why')})")
    if s["end"]:
        print(f"  ended: {s['end'].get('why')}")
    elif s["finished"]:
        print(f"  finished: every worker of world {s['generation']} exited 0")
    return 0
