"""Times the calls of a multi-process recovery in every worker (issue 13 diagnostics).

    PYTHONPATH=tests/jobs/recovery_timers:. python -m tests.jobs.two_kills
    grep PROF <its output dir>/workers.log

Python imports ``sitecustomize`` at start-up from the path: in a worker of ``mnemojax
launch`` (``MNEMOJAX_PROCESS_ID`` or ``MNEMOJAX_SPARE`` set) this turns the ``mnemojax``
logger to INFO on stderr (the step compiler logs its lower and compile times there) and
wraps the recovery's calls, each logging ``TIMER <name> <seconds>``. Elsewhere it does
nothing.
"""

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
import time

TIMED = {
    "mnemojax._src.recovery": ["compile_for_world", "ProcessRecovery.recover"],
    "mnemojax._src.distributed.worker.session": [
        "DistributedSession.compiled", "DistributedSession.restore",
        "DistributedSession.recover", "DistributedSession.publish"],
    "mnemojax._src.distributed.worker.agent_client": [
        "AgentClient.await_replicated", "AgentClient.publish"],
    "mnemojax._src.runtime": ["RuntimeBuilder.build"],
    "mnemojax._src.distributed.worker.coordination": ["attach_worker", "detach_worker"],
}
log = logging.getLogger("mnemojax")


def _timed(module, qualname: str) -> None:
    *path, name = qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log.info("TIMER %s %.3f", qualname, time.perf_counter() - t)

    setattr(owner, name, timed)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the named functions of each module in `TIMED` once it is executed."""

    def find_spec(self, name, path, target=None):
        if name not in TIMED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for qualname in TIMED[name]:
                _timed(module, qualname)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("MNEMOJAX_PROCESS_ID") is not None or os.environ.get("MNEMOJAX_SPARE"):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"PROF w{os.environ.get('MNEMOJAX_WORKER_ID')} %(asctime)s %(message)s"))
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    sys.meta_path.insert(0, _Finder())
