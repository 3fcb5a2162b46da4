"""Starting an agent process: its command line (no JAX import), its arguments, PDEATHSIG."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """This process gets SIGTERM when its parent dies (Linux PDEATHSIG), so nothing leaks:
    the agent's SIGTERM handler ends its main loop, which kills its worker and removes its
    shared-memory segment (a SIGKILL would leave the segment behind when the launcher is
    itself SIGKILLed and cannot sweep).

    Called in the child itself (never as ``preexec_fn``: forking a multithreaded parent,
    like a JAX process, and running Python before ``exec`` can deadlock).
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def agent_command(*args: str) -> list[str]:
    """The command line that runs an agent without importing JAX.

    ``python -m`` of an agent module would run ``mnemojax/__init__.py``, which imports JAX
    (about a second and 100+ MB per agent). The bootstrap registers a bare ``mnemojax``
    package module first, so only the light modules the agent needs are loaded.
    """
    import mnemojax
    pkg_dir = os.path.dirname(os.path.abspath(mnemojax.__file__ or ""))
    bootstrap = ("import sys, types; pkg = types.ModuleType('mnemojax'); "
                 f"pkg.__path__ = [{pkg_dir!r}]; sys.modules['mnemojax'] = pkg; "
                 "from mnemojax._src.distributed.agent.bootstrap import main; "
                 "sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", bootstrap, *args]


def main(argv: list[str] | None = None) -> int:
    """Parses the agent's arguments and runs it until shutdown (or SIGTERM)."""
    # Here, not at the top: the launcher imports this module for `agent_command` only.
    from mnemojax._src.distributed import auth
    from mnemojax._src.distributed.agent.agent import Agent

    p = argparse.ArgumentParser(prog="mnemojax agent")
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--launcher", required=True, help="host:port of the launcher")
    p.add_argument("--hang-factor", type=float, default=10.0)
    p.add_argument("--hang-min-s", type=float, default=5.0)
    p.add_argument("--parent-pid", type=int, default=None, help="die with this parent")
    p.add_argument("--shm-prefix", default=f"mnjx{os.getpid()}_")
    p.add_argument("--host", default="127.0.0.1", help="address to serve copies on")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s agent %(message)s")
    secret = auth.secret_from_env(os.environ)  # never argv: command lines are world-readable
    if secret is None:
        p.error(f"{auth.JOB_SECRET} is not set (the launcher sets it)")
    agent = Agent(worker_id=args.worker_id, launcher=args.launcher, command=command,
                  hang_factor=args.hang_factor, hang_min_s=args.hang_min_s,
                  shm_prefix=args.shm_prefix, secret=secret, host=args.host)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())  # the main loop cleans up
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
