"""``mnemojax launch``: start N workers with K CPU devices each, their agents and the
coordination service, on 127.0.0.1. Usage::

    mnemojax launch --nproc 4 --devices-per-proc 2 -- python train.py ...

A job over several nodes runs one launcher per node, torchrun-style; they meet in etcd
(`plane`) and share the job secret from the environment::

    export MNEMOJAX_JOB_SECRET=...   # the same on every node (hex, >= 16 bytes)
    mnemojax launch --rdzv etcd://HOST:2379 --rdzv-id JOB --nnodes 2 --node-rank R \
        --nproc 4 -- python train.py ...

Exit status: 0 when the final world's workers all exit 0; a worker's own non-zero status
when it ends the job (an uncaught exception: 1); 124 after ``--timeout-s``; 143 after
SIGTERM and 130 after SIGINT to the launcher (forwarded to the workers as SIGTERM, their
preemption notice; they have ``--stop-grace-s`` to checkpoint and exit).
"""

from __future__ import annotations

import argparse
import logging

from mnemojax._src.distributed.launcher.launcher import Launcher
from mnemojax._src.distributed.launcher.options import LaunchOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``launch`` options to ``parser``."""
    parser.add_argument("--nproc", type=int, required=True, help="worker processes")
    parser.add_argument("--devices-per-proc", type=int, default=1, help="CPU devices per worker")
    parser.add_argument("--heartbeat-s", type=int, default=10,
                        help="coordination heartbeat timeout (>= 10 on small machines)")
    parser.add_argument("--collective-timeout-s", type=int, default=20,
                        help="bound on a CPU collective; a worker's death reaches the "
                             "survivors at once, this bounds a peer that is alive but never "
                             "sends")
    parser.add_argument("--hang-factor", type=float, default=10.0,
                        help="hang = no step for this multiple of the median step time")
    parser.add_argument("--hang-min-s", type=float, default=5.0, help="floor of the hang limit")
    parser.add_argument("--agree-timeout-s", type=float, default=60.0,
                        help="members not at the agreement barrier by then are evicted")
    parser.add_argument("--no-recover", action="store_true",
                        help="end the job at the first worker failure")
    parser.add_argument("--timeout-s", type=float, default=None, help="kill the job after this")
    parser.add_argument("--stop-grace-s", type=float, default=60.0,
                        help="after SIGTERM/SIGINT, how long the workers may take to "
                             "checkpoint and exit")
    parser.add_argument("--rdzv", default=None, metavar="etcd[s]://HOST:PORT[,HOST:PORT]",
                        help="the etcd cluster where the launchers of several nodes meet "
                             "(etcds://: TLS, files from MNEMOJAX_ETCD_CACERT, "
                             "MNEMOJAX_ETCD_CERT, MNEMOJAX_ETCD_KEY)")
    parser.add_argument("--rdzv-id", default="mnemojax",
                        help="the job's name in etcd (unique per run)")
    parser.add_argument("--nnodes", type=int, default=1, help="launchers (nodes) of the job")
    parser.add_argument("--node-rank", type=int, default=0, help="this node (0..nnodes-1)")
    parser.add_argument("--node-ttl-s", type=int, default=5,
                        help="a node silent in etcd for this long is lost")
    parser.add_argument("--etcd-outage-s", type=float, default=300.0,
                        help="with --rdzv: how long this node keeps its workers running, "
                             "and an agreement waits, while no etcd member answers (an "
                             "outage of the etcd cluster itself: its new leader renews "
                             "every lease)")
    parser.add_argument("--spares", type=int, default=0,
                        help="warm spare processes this node keeps (on one machine too); "
                             "a world formed after a loss takes one in place of each dead "
                             "member, so the mesh keeps its size (the job's loop must start "
                             "at step.restore())")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="a worker that crashes (or leaves the job) is started again "
                             "as a warm spare, at most this many times (per node with "
                             "--rdzv); the job grows back to its first size once spares "
                             "can fill every rank it lost")
    parser.add_argument("--grow-back", action="store_true",
                        help="with --rdzv: this node may rejoin the job while it runs (a "
                             "restarted host): its processes wait as spares, and the job "
                             "grows back to its first size once there are enough")
    parser.add_argument("--host", default="127.0.0.1",
                        help="with --rdzv: the address of this node that the others reach "
                             "(its agents and coordination services listen there)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the worker command, e.g. -- python train.py")


def run(args: argparse.Namespace) -> int:
    """Runs the job; returns its exit status (forwarded from the workers)."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("mnemojax launch: give the worker command after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launch %(message)s")
    options = LaunchOptions(
        nproc=args.nproc, devices_per_proc=args.devices_per_proc, heartbeat_s=args.heartbeat_s,
        collective_timeout_s=args.collective_timeout_s, hang_factor=args.hang_factor,
        hang_min_s=args.hang_min_s, agree_timeout_s=args.agree_timeout_s,
        recover=not args.no_recover, job_timeout_s=args.timeout_s,
        stop_grace_s=args.stop_grace_s, rdzv=args.rdzv, rdzv_id=args.rdzv_id,
        nnodes=args.nnodes, node_rank=args.node_rank, node_ttl_s=args.node_ttl_s,
        etcd_outage_s=args.etcd_outage_s,
        host=args.host, spares=args.spares, grow_back=args.grow_back,
        max_restarts=args.max_restarts)
    if options.rdzv is not None:
        from mnemojax._src.distributed.launcher.node import NodeLauncher
        return NodeLauncher(options, command).run()
    return Launcher(options, command).run()


def main(argv: list[str] | None = None) -> int:
    from mnemojax._src.cli import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(prog="mnemojax launch",
                                     formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
