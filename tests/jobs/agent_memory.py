"""Measures the host memory an agent holds for snapshots, against its worker's own shard.

PYTHONPATH=. python -m tests.jobs.agent_memory [--mib 1,16,128] [--steps 4]

Two real agents (threads of this process, each with its own shared-memory slots and
replica store, replicating to each other over TCP with the job secret) and two workers'
clients publishing equal shares of S MiB per step, as in a job of two hosts. After each
step's replicas have arrived, the agent of worker 1 is read: its two slots (shared memory,
`SnapshotHolder.buffer`) and the replicas it keeps of worker 0 (`ReplicaStore.nbytes`).
The peak adds the one replica frame received while the two held are still kept (by
design: the frame is stored as it arrived, after the step it outdates is dropped).
Prints one row per size: the figures and their ratios to the own shard S.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from mnemojax._src.distributed import wire
from mnemojax._src.distributed.agent.agent import Agent
from mnemojax._src.distributed.snapshot_codec import ShardEntry, pack
from mnemojax._src.distributed.worker.agent_client import AgentClient
from tests.distributed.fakes import SECRET, FakeLauncher, held, wait_until


def measure(mib: int, steps: int) -> dict[str, float]:
    """The held and peak snapshot bytes of one agent whose worker publishes ``mib`` MiB."""
    fake = FakeLauncher()
    agents = [Agent(worker_id=i, launcher=fake.address, command=[], secret=SECRET)
              for i in range(2)]
    threads = [threading.Thread(target=a.run, daemon=True) for a in agents]
    for t in threads:
        t.start()
    clients: list[AgentClient] = []
    try:
        wait_until(lambda: len(fake.addresses) == 2)
        for i in range(2):  # a ring of two: each agent keeps the other's replicas
            fake.command(i, wire.SetBuddy(buddy=fake.addresses[1 - i]))
        clients = [AgentClient(a.address, secret=SECRET) for a in agents]
        share = np.ones(mib * 2**20 // 4, np.float32)
        for step in range(1, steps + 1):
            for worker, client in enumerate(clients):
                entry = ShardEntry(0, (2 * share.size,),
                                   ((worker * share.size, (worker + 1) * share.size),), share)
                client.publish(step, pack(step, worker, [entry], num_leaves=1))
            wait_until(lambda s=step: agents[1].snapshots.replicas.steps(0)[-1:] == [s],
                       timeout=120)
        assert held(agents[1].address)[0] == {"0": [steps - 1, steps],  # every copy checks
                                              "1": [steps - 1, steps]}
        holder = agents[1].snapshots
        assert holder.buffer is not None
        slots = 2 * holder.buffer.slot_bytes
        replicas = holder.replicas.nbytes()
        frame = len(holder.replicas.get(0, steps)[0])  # one more arriving, at the peak
        return {"own_mib": mib, "slots": slots, "replicas": replicas,
                "held": slots + replicas, "peak": slots + replicas + frame,
                "own": share.nbytes}
    finally:
        for c in clients:
            c.close()
        for i in list(fake.links):
            fake.command(i, wire.Shutdown())
        for t in threads:
            t.join(timeout=30)
        fake.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="1,16,128", help="own shard sizes, MiB")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"{'own shard':>10} {'2 slots':>10} {'replicas':>10} {'held':>10} {'peak':>10} "
          f"{'held/own':>9} {'peak/own':>9} {'fixed':>9}")
    for mib in (int(m) for m in args.mib.split(",")):
        t = time.perf_counter()
        r = measure(mib, args.steps)
        own = r["own"]
        print(f"{own / 2**20:>8.1f} M {r['slots'] / 2**20:>8.1f} M "
              f"{r['replicas'] / 2**20:>8.1f} M {r['held'] / 2**20:>8.1f} M "
              f"{r['peak'] / 2**20:>8.1f} M {r['held'] / own:>9.3f} {r['peak'] / own:>9.3f} "
              f"{(r['held'] - 4 * own) / 1024:>7.1f} K  ({time.perf_counter() - t:.1f} s)",
              flush=True)


if __name__ == "__main__":
    main()
