"""Measures the host memory an agent holds for snapshots, against its worker's own shard.

PYTHONPATH=. python -m tests.jobs.agent_memory [--mib 1,16,128] [--steps 4] [--in-series]

Two real agents (threads of this process, each with its own shared-memory slots and
replica store, replicating to each other over TCP with the job secret) and two workers'
clients publishing equal shares of S MiB per step, as in a job of two hosts. Memory is
measured, not added up: the agents' process-memory allocations (`tracemalloc`: the
replicas kept, the frames received; a copy is sent straight from its slot) from the first
step on, current after the last step's replicas arrived and peak over the run, halved (the
two agents do the same work), plus the agent's two shared-memory slots (their segment
size). Prints one row per size: the figures and their ratios to the own shard S, beside
`shm.agent_peak_bytes`, the figure the budget checks use. With ``--in-series`` each worker
publishes as `SnapshotOptions.replicate_in_series` does: it waits until its buddy holds a
copy before the next, and the buddy makes room for each copy before it arrives.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.shm import DATA_AT, NUM_SLOTS, agent_peak_bytes
from mnemojax._src.distributed.snapshot_codec import ShardEntry, pack
from mnemojax._src.distributed.worker.agent_client import AgentClient
from tests.distributed.fakes import SECRET, held, running_agents, wait_until


def measure(mib: int, steps: int, *, in_series: bool = False) -> dict[str, float]:
    """The held and peak snapshot bytes of one agent whose worker publishes ``mib`` MiB."""
    with running_agents(2) as (fake, agents):
        for i in range(2):  # a ring of two: each agent keeps the other's replicas
            fake.command(i, wire.SetBuddy(buddy=fake.addresses[1 - i]))
        clients = [AgentClient(a.address, secret=SECRET) for a in agents]
        try:
            return _publish_and_trace(agents, clients, mib, steps, in_series)
        finally:
            for c in clients:
                c.close()
            if tracemalloc.is_tracing():
                tracemalloc.stop()


def _publish_and_trace(agents, clients, mib: int, steps: int,
                       in_series: bool) -> dict[str, float]:
    """Publishes ``steps`` equal shares from both workers, tracing the agents' memory."""
    share = np.ones(mib * 2**20 // 4, np.float32)
    tracemalloc.start()
    for step in range(1, steps + 1):
        for worker, client in enumerate(clients):
            entry = ShardEntry(0, (2 * share.size,),
                               ((worker * share.size, (worker + 1) * share.size),), share)
            client.publish(step, pack(step, worker, [entry], num_leaves=1),
                           in_series=in_series)
        if in_series:
            for client in clients:
                assert client.await_replicated(120.0) is None
        wait_until(lambda s=step: all(a.snapshots.replicas.steps(1 - i)[-1:] == [s]
                                      for i, a in enumerate(agents)), timeout=120)
    time.sleep(0.5)  # the senders are done: their last copies released
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert held(agents[1].address)[0] == {"0": [steps - 1, steps],  # every copy checks
                                          "1": [steps - 1, steps]}
    buffer = agents[1].snapshots.buffer
    assert buffer is not None
    slots = DATA_AT + NUM_SLOTS * buffer.slot_bytes  # the segment: header page, slots
    return {"slots": slots, "heap_held": current / 2, "heap_peak": peak / 2,
            "own": share.nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="1,16,128", help="own shard sizes, MiB")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--in-series", action="store_true")
    args = parser.parse_args()
    print(f"{'own shard':>10} {'2 slots':>10} {'held':>10} {'peak':>10} {'held/own':>9} "
          f"{'peak/own':>9} {'budget/own':>11}")
    for mib in (int(m) for m in args.mib.split(",")):
        t = time.perf_counter()
        r = measure(mib, args.steps, in_series=args.in_series)
        own = r["own"]
        held_b, peak_b = r["slots"] + r["heap_held"], r["slots"] + r["heap_peak"]
        print(f"{own / 2**20:>8.1f} M {r['slots'] / 2**20:>8.1f} M {held_b / 2**20:>8.1f} M "
              f"{peak_b / 2**20:>8.1f} M {held_b / own:>9.3f} {peak_b / own:>9.3f} "
              f"{agent_peak_bytes(own, own, in_series=args.in_series) / own:>11.3f}  ({time.perf_counter() - t:.1f} s)",
              flush=True)


if __name__ == "__main__":
    main()
