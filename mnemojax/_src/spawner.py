"""Starting child processes from a thread that lives as long as this process.

A child that sets PR_SET_PDEATHSIG (Linux) gets its signal when the *thread* that started
it ends, not when its parent process does. A child started from a short-lived thread (a
compile thread that ends with its step, a launcher's link thread that ends with the agent
it served) is killed with that thread. `popen` starts every child from one thread made for
it, which lives until the process exits.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import subprocess
import threading
from typing import Any

_lock = threading.Lock()
_requests: queue.SimpleQueue | None = None


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)``, started from the spawning thread; raises what
    ``Popen`` raises."""
    done: concurrent.futures.Future[subprocess.Popen] = concurrent.futures.Future()
    _queue().put((args, kwargs, done))
    return done.result()


def _queue() -> queue.SimpleQueue:
    global _requests
    with _lock:
        if _requests is None:
            _requests = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_requests,), daemon=True,
                             name="mnemojax-spawner").start()
        return _requests


def _forget() -> None:
    """In a forked child: the parent's spawning thread is not there."""
    global _lock, _requests
    _lock, _requests = threading.Lock(), None


os.register_at_fork(after_in_child=_forget)


def _serve(requests: queue.SimpleQueue) -> None:
    while True:
        args, kwargs, done = requests.get()
        try:
            done.set_result(subprocess.Popen(args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the asking thread raises it
            done.set_exception(e)
